"""Stack settings, loaded once into frozen, validated dataclasses.

Usage:
    cfg = infra.config.load()                       # inside a Pulumi program (reads pulumi config)
    cfg = infra.config.parse(raw, stack="aws-dev")  # from a dict of "gpu-train:<key>" -> value
    python -m infra.config deploy-matrix [stacks]   # the stacks the workflows deploy, as GitHub outputs

Every setting lives under the `gpu-train:` namespace of `stacks/Pulumi.<stack>.yaml`. Keys are
camelCase in YAML and snake_case here. Unknown keys are errors (a typo is never ignored), and every
invalid value fails here, before any resource exists, with the full key in the message, for example
`gpu-train:gpuPools[0].maxNodes must be >= minNodes (got 2 < 4)`. All problems are reported at once.

Beyond each value's own shape, the checks here hold the settings against the outside world: regions
that exist (AWS from botocore's endpoint data, GCP from the list below), Kubernetes minors each cloud
offers, the trainer's own configuration schema (`gpu_train.spec.trainer_config.build_config`) for the job's preset
and overrides, the global batch at every world size the job may run at (`gpu_train.spec.trainer_config.batch_layout`),
the teams' quotas against what the job needs, and, for a stack marked `deploy: true`, the
placeholder values that example stacks carry.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PROJECT = "gpu-train"

Cloud = Literal["aws", "gcp"]
Environment = Literal["dev", "staging", "prod"]
Capacity = Literal["spot", "on-demand", "reservation", "capacity-block"]

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
_IMAGE_DIGEST = re.compile(r"^[a-z0-9.\-/:_]+@sha256:[0-9a-f]{64}$")
# Kubernetes object fields are int32; no whole-number setting may exceed one.
_INT_MAX = 2**31 - 1

# Kubernetes minors offered for new clusters (February 2026), the one list the checks use:
# - EKS, standard and extended support: 1.30 to 1.35
#   (https://docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html);
# - GKE per release channel, "Available minor versions" of
#   https://cloud.google.com/kubernetes-engine/docs/release-notes: Rapid 1.32-1.35, Regular 1.32-1.34,
#   Stable 1.32-1.33.
# The platform needs 1.31 or later: the job's Job uses successPolicy, on by default from 1.31
# (KEP-3998, https://kubernetes.io/docs/concepts/workloads/controllers/job/#success-policy).
PLATFORM_MIN_KUBERNETES = (1, 31)
KUBERNETES_VERSIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "aws": {"": ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35")},
    "gcp": {"RAPID": ("1.32", "1.33", "1.34", "1.35"), "REGULAR": ("1.32", "1.33", "1.34"),
            "STABLE": ("1.32", "1.33")},
}
# GCP regions (https://cloud.google.com/compute/docs/regions-zones, February 2026). AWS regions come
# from botocore's endpoint data: the regions where EKS has an endpoint, in every partition.
GCP_REGIONS = frozenset({
    "africa-south1", "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast2", "asia-northeast3",
    "asia-south1", "asia-south2", "asia-southeast1", "asia-southeast2", "australia-southeast1",
    "australia-southeast2", "europe-central2", "europe-north1", "europe-north2", "europe-southwest1",
    "europe-west1", "europe-west2", "europe-west3", "europe-west4", "europe-west6", "europe-west8",
    "europe-west9", "europe-west10", "europe-west12", "me-central1", "me-central2", "me-west1",
    "northamerica-northeast1", "northamerica-northeast2", "northamerica-south1", "southamerica-east1",
    "southamerica-west1", "us-central1", "us-east1", "us-east4", "us-east5", "us-south1", "us-west1",
    "us-west2", "us-west3", "us-west4",
})

# Placeholders that example stacks carry and a deployed stack must not: documentation address ranges
# (RFC 5737, RFC 3849), reserved example domains (RFC 2606, RFC 6761), the account ids AWS's
# documentation uses, the "acme" of example company names, and made-up reservation ids.
DOCUMENTATION_RANGES = tuple(ipaddress.ip_network(n) for n in (
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32"))
_EXAMPLE_DOMAIN = re.compile(r"(^|[.@/])(example\.(com|org|net)|[a-z0-9-]+\.(example|test|invalid|localhost))($|[/:])")
_SAMPLE_ACCOUNTS = frozenset({"123456789012", "111122223333", "444455556666", "555555555555", "777788889999",
                              "000000000000", "012345678901", "210987654321"})
_ACME = re.compile(r"(?<![a-z0-9])acme(?![a-z0-9])", re.IGNORECASE)
_PLACEHOLDER_WORD = re.compile(r"(?<![a-z0-9])(example|sample|placeholder|changeme|replace-?me|dummy|xxx+)(?![a-z0-9])",
                               re.IGNORECASE)
_SEQUENCE = re.compile(r"0123456|1234567|abcdef0|0a1b2c3d|a1b2c3d4|(.)\1{7}")


class ConfigError(ValueError):
    """One or more invalid stack settings; the message lists each with its full key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid stack settings:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------------------------
# The settings tree. Field comments are the reference for docs/configuration.md.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    vpc_cidr: str = "10.0.0.0/16"  # node network (AWS VPC / GCP primary subnet range)
    pod_cidr: str = "100.64.0.0/16"  # pods: AWS secondary VPC CIDR (custom networking) / GCP secondary range
    service_cidr: str = "172.20.0.0/16"  # Kubernetes services
    nat: Literal["single", "per-zone"] = "per-zone"  # NAT gateways: one in dev saves money, one per AZ in prod
    flow_logs: bool = True  # VPC flow logs (AWS: KMS-encrypted log group; GCP: subnet flow logs)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    kubernetes_version: str = "1.33"  # control-plane minor version
    endpoint_public_access: bool = False  # public API endpoint; when on, limited to publicAccessCidrs
    public_access_cidrs: tuple[str, ...] = ()  # CIDRs allowed to reach a public endpoint
    system_node_type: str = ""  # small on-demand pool for controllers ("" = cloud default)
    system_nodes_min: int = 2
    system_nodes_max: int = 4
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = "REGULAR"  # GKE only
    regional: bool = True  # GKE only: regional control plane (else zonal, in zones[0])
    master_cidr: str = "172.16.0.0/28"  # GKE only: private control-plane range


@dataclass(frozen=True, kw_only=True)
class GpuPoolConfig:
    name: str  # DNS label, unique per stack; becomes the node label gpu-train.io/pool
    instance_type: str  # EC2 instance type or GCE machine type (see infra/*/catalog.py)
    capacity: Capacity  # spot | on-demand | reservation | capacity-block (AWS only)
    min_nodes: int = 0
    max_nodes: int
    fabric: bool = False  # EFA (AWS) or GPUDirect TCPX/TCPXO/RDMA (GCP), with compact placement
    zone: str = ""  # required for fabric pools: compact placement lives in exactly one zone
    reservation_id: str = ""  # required for reservation / capacity-block capacity
    placement_group: bool = True  # AWS: cluster placement group for fabric pools
    gpu_driver_version: Literal["DEFAULT", "LATEST"] = "LATEST"  # GKE pinned driver channel
    labels: Mapping[str, str] = field(default_factory=dict)  # extra node labels


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    enabled: bool = True  # Alluxio on the GPU nodes' NVMe in front of the datasets bucket
    page_store_gb: int = 500  # per-worker page store quota on the NVMe path
    masters: int = 1  # 1 in dev, 3 (embedded journal quorum) in prod
    journal_gb: int = 20  # per-master persistent journal (encrypted volume)


@dataclass(frozen=True, kw_only=True)
class MonitoringConfig:
    retention: str = "15d"  # Prometheus TSDB retention
    storage_gb: int = 50  # Prometheus volume (encrypted StorageClass)
    grafana_storage_gb: int = 10
    grafana_exposed: bool = False  # internal load balancer for Grafana; otherwise port-forward only
    checkpoint_max_age_minutes: int = 90  # alert when the newest checkpoint is older than this
    low_utilization_percent: int = 20  # alert when mean GPU utilization stays below this for 30 min


# XIDs the NVIDIA driver raises for faults of an application, not of the GPU: the device plugin ignores
# them for its own health checks (internal/rm/health.go of NVIDIA/k8s-device-plugin v0.20.0), and a
# node must not be quarantined because a user's kernel faulted.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    enabled: bool = True  # GPU node health: problem detection, pre-flight check and quarantine (docs/operations.md)
    remediation: bool = True  # quarantine a faulty GPU node (its pods leave with their grace period); false: report only
    preflight: bool = True  # a new GPU node takes no training pod until its GPU and fabric pre-flight check passes
    node_repair: bool = True  # the clouds' node repair: Karpenter node repair, EKS node group repair, GKE auto-repair
    xid_codes: tuple[int, ...] = (48, 63, 64, 74, 79, 94, 95)  # NVIDIA XID errors that quarantine a GPU node
    # nodes the clouds may repair or replace at once per pool; more GPU nodes quarantined at once raises an alert
    max_concurrent_repairs: int = 1
    dcgm_diag_level: int = 1  # DCGM diagnostics level of the pre-flight check (1: seconds, 2: a few minutes)


@dataclass(frozen=True, kw_only=True)
class TeamMemberConfig:
    # AWS: the ARN of an IAM role or user (arn:aws:iam::<account>:role/<name>) that gets an EKS access entry
    # carrying the team's groups; on GCP people join the Google groups instead
    principal: str
    role: Literal["submitter", "viewer"] = "submitter"  # which of the team's group lists the entry carries


@dataclass(frozen=True, kw_only=True)
class TeamConfig:
    name: str  # DNS label; namespace team-<name>
    # nominal GPUs in the team's ClusterQueue per pool, {pool: GPUs} (pools left out: 0), or one
    # number for every pool (capped at each pool's maxNodes x GPUs)
    gpu_quota: int | Mapping[str, int]
    # Kubernetes groups allowed to submit jobs (GKE: Google group e-mail addresses); the team's
    # RoleBindings name exactly these
    submitters: tuple[str, ...] = ()
    viewers: tuple[str, ...] = ()  # groups allowed to read jobs, their status and logs
    members: tuple[TeamMemberConfig, ...] = ()  # AWS: IAM principals mapped to the groups by EKS access entries


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str  # DNS label; the JobSet name
    team: str  # one of teams[].name: picks the namespace and LocalQueue
    pool: str  # one of gpuPools[].name: where the pods run
    preset: str = "gpt2-124m"  # trainer preset (python -m trainer --preset)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # trainer dotted-key overrides
    nodes: str = "1:1"  # torchrun --nnodes MIN:MAX
    gpus_per_node: int = 0  # 0 = all GPUs of the pool's instance type
    dataset_uri: str = ""  # "" = <datasets bucket>/<job name>/manifest.json
    checkpoint_uri: str = ""  # "" = <checkpoints bucket>/<team>/<job name>
    steps: int = 1000
    global_batch_tokens: int = 524288
    checkpoint_every: int = 200
    suspend: bool = False  # pause (true: quota released, pods gone) and resume (false) through `pulumi up`
    max_restarts: int = 3  # torchrun --max-restarts and the JobSet's failurePolicy.maxRestarts
    data_wait_minutes: int = 10  # how long the pods wait for the dataset manifest before failing the job
    rendezvous_timeout_minutes: int = 35  # torchrun join timeout; at least Kueue's pods-ready timeout (30)


# Retention periods CloudWatch Logs accepts (PutRetentionPolicy's retentionInDays, botocore's logs model).
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                      2922, 3288, 3653)


@dataclass(frozen=True, kw_only=True)
class LogsConfig:
    # AWS: days the team namespaces' container logs stay in CloudWatch Logs (unset: 30); GKE keeps them in
    # Cloud Logging, whose retention is the project's _Default bucket setting
    retention_days: int | None = None


@dataclass(frozen=True, kw_only=True)
class ImageConfig:
    prebuilt: str = ""  # digest-pinned image (repo@sha256:...) to use instead of building one


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    enabled: bool = True
    database: Literal["in-cluster", "managed"] = "in-cluster"  # PostgreSQL in the cluster or the cloud's managed one
    storage_gb: int = 20
    register_name: str = ""  # model registry name for the job's final model ("" = job name)


@dataclass(frozen=True, kw_only=True)
class DeployRunnerConfig:
    kind: Literal["none", "codebuild"] = "none"  # codebuild: a GitHub Actions runner in the VPC (AWS only)
    repository: str = ""  # GitHub <owner>/<name> whose workflow jobs run on it
    connection_arn: str = ""  # AWS CodeConnections connection to GitHub (arn:aws:codeconnections:...)


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    max_gpus: int = 64  # cap on the sum of maxNodes x GPUs over all pools (also a policy)


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    cloud: Cloud  # which cloud layer builds the platform
    environment: Environment  # prod turns on HA defaults; dev/staging require scale-to-zero GPU pools
    region: str  # AWS region or GCP region
    zones: tuple[str, ...]  # zones the network spans (3 recommended)
    stack: str = ""  # the Pulumi stack name (not a setting; filled in by the loader)
    deploy: bool = False  # deployed by the workflows: placeholder values (example CIDRs, domains, ids) are refused
    project: str = ""  # GCP project id (GCP only)
    tags: Mapping[str, str] = field(default_factory=dict)  # extra tags / labels on every resource
    network: NetworkConfig = field(default_factory=NetworkConfig)  # address plan and NAT
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # control plane and system nodes
    gpu_pools: tuple[GpuPoolConfig, ...] = ()  # at least one GPU node pool
    cache: CacheConfig = field(default_factory=CacheConfig)  # Alluxio NVMe cache
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)  # Prometheus, Grafana, alerts
    health: HealthConfig = field(default_factory=HealthConfig)  # GPU node health, pre-flight, quarantine and repair
    teams: tuple[TeamConfig, ...] = ()  # tenants: namespace, queue and GPU quota each
    job: JobConfig | None = None  # the stack's training job (none: the platform only; teams submit theirs)
    logs: LogsConfig = field(default_factory=LogsConfig)  # container logs that outlive their pods
    image: ImageConfig = field(default_factory=ImageConfig)  # trainer image source
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # tracking server and registry
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # guard rails checked here and by policy
    # how the workflows reach the private EKS endpoint (docs/aws.md, docs/ci.md)
    deploy_runner: DeployRunnerConfig = field(default_factory=DeployRunnerConfig)

    @property
    def is_prod(self) -> bool:
        return self.environment == "prod"

    def pool(self, name: str) -> GpuPoolConfig:
        return next(p for p in self.gpu_pools if p.name == name)

    def team(self, name: str) -> TeamConfig:
        return next(t for t in self.teams if t.name == name)

    def pool_capacity(self, pool: GpuPoolConfig) -> int:
        """GPUs the pool can ever hold: maxNodes x GPUs per node (0 for a type not in the catalog)."""
        spec = _catalog(self.cloud).get(pool.instance_type)
        return pool.max_nodes * spec.gpus if spec is not None else 0

    def team_quota(self, team: TeamConfig) -> dict[str, int]:
        """The team's nominal GPU quota on every pool, by pool name."""
        return pool_quotas(team.gpu_quota, {p.name: self.pool_capacity(p) for p in self.gpu_pools})


def pool_quotas(gpu_quota: int | Mapping[str, int], capacities: Mapping[str, int]) -> dict[str, int]:
    """A team's `gpuQuota` setting as nominal GPUs per pool: the mapping's entry (0 when absent), or the
    one number on every pool, capped at the pool's capacity (maxNodes x GPUs per node)."""
    if isinstance(gpu_quota, Mapping):
        return {name: int(gpu_quota.get(name, 0)) for name in capacities}
    return {name: min(int(gpu_quota), capacity) for name, capacity in capacities.items()}


def _catalog(cloud: str) -> Mapping[str, Any]:
    if cloud == "aws":
        from infra.aws.catalog import CATALOG as EC2

        return EC2
    from infra.gcp.catalog import CATALOG as GCE

    return GCE


# --------------------------------------------------------------------------------------------
# Generic typed reader: camelCase keys, unknown keys rejected, types checked.
# --------------------------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        plain = {int: "a whole number", str: "a string", bool: "true or false"}
        return " or ".join(plain.get(a, _type_name(a)) for a in typing.get_args(tp) if a is not type(None))
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (tuple, list):
        return "a list"
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


class _Reader:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, key: str, message: str) -> None:
        self.problems.append(f"{key} {message}")

    def read(self, tp: Any, value: Any, key: str) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            members = [a for a in args if a is not type(None)]
            if len(members) == 1:
                return self.read(members[0], value, key)
            # Several shapes (a number or a mapping): the first that reads without a problem wins.
            for member in members:
                trial = _Reader()
                result = trial.read(member, value, key)
                if not trial.problems:
                    return result
            wrong_shape = [m for m in members if not _same_shape(m, value)]
            if len(wrong_shape) < len(members):
                # The value has one member's shape: report that member's own problems.
                member = next(m for m in members if _same_shape(m, value))
                return self.read(member, value, key)
            self.fail(key, f"must be {_type_name(tp)} (got {type(value).__name__} {value!r})")
            return value
        if dataclasses.is_dataclass(tp):
            return self.read_dataclass(tp, value, key)
        if origin is Literal:
            if value not in args:
                self.fail(key, f"must be one of {_type_name(tp)} (got {value!r})")
            return value
        if origin is tuple:
            if not isinstance(value, list | tuple):
                self.fail(key, f"must be a list (got {type(value).__name__} {value!r})")
                return ()
            return tuple(self.read(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if origin in (Mapping, typing.Mapping, dict):
            if not isinstance(value, dict):
                self.fail(key, f"must be a mapping (got {type(value).__name__} {value!r})")
                return {}
            val_tp = args[1] if len(args) == 2 else Any
            return {str(k): self.read(val_tp, v, f"{key}.{k}") for k, v in value.items()}
        if tp is Any:
            return value
        if tp is bool:
            if not isinstance(value, bool):
                self.fail(key, f"must be true or false (got {value!r})")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(key, f"must be a whole number (got {value!r})")
            elif abs(value) > _INT_MAX:
                self.fail(key, f"must be at most {_INT_MAX} (got {value})")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                self.fail(key, f"must be a finite number (got {value!r})")
                return value
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                self.fail(key, f"must be a string (got {type(value).__name__} {value!r})")
            return value
        raise TypeError(f"unsupported settings type {tp!r} at {key}")

    def read_dataclass(self, cls: type, value: Any, key: str, skip: tuple[str, ...] = ()) -> Any:
        if not isinstance(value, dict):
            self.fail(key, f"must be a mapping (got {type(value).__name__} {value!r})")
            value = {}
        hints = typing.get_type_hints(cls)
        fields = {_camel(f.name): f for f in dataclasses.fields(cls) if f.name not in skip}
        for unknown in sorted(set(value) - set(fields)):
            close = difflib.get_close_matches(str(unknown), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(fields))})"
            self.fail(f"{key}.{unknown}" if key else f"{PROJECT}:{unknown}", "is not a known setting" + hint)
        kwargs = {}
        for camel, f in fields.items():
            sub_key = f"{key}.{camel}" if key else f"{PROJECT}:{camel}"
            if camel in value:
                kwargs[f.name] = self.read(hints[f.name], value[camel], sub_key)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.fail(sub_key, "is required")
        if self.problems:
            # Build what we can so semantic checks still run on the well-formed parts.
            try:
                return cls(**kwargs)
            except TypeError:
                return None
        return cls(**kwargs)


def _same_shape(tp: Any, value: Any) -> bool:
    """Whether a value has the outer shape of a type (mapping, list, scalar), whatever its contents."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or origin in (dict, Mapping, typing.Mapping):
        return isinstance(value, dict)
    if origin in (tuple, list):
        return isinstance(value, list | tuple)
    return not isinstance(value, dict | list | tuple)


# --------------------------------------------------------------------------------------------
# Semantic checks
# --------------------------------------------------------------------------------------------


def _network(value: str, key: str, problems: list[str]) -> ipaddress.IPv4Network | None:
    try:
        return ipaddress.IPv4Network(value, strict=True)
    except ValueError as exc:
        problems.append(f"{key} must be an IPv4 CIDR block (got {value!r}: {exc})")
        return None


def _check(cfg: StackConfig) -> list[str]:
    p: list[str] = []
    k = f"{PROJECT}:"
    from infra.aws.catalog import CATALOG as EC2
    from infra.gcp.catalog import CATALOG as GCE

    if not _DNS_LABEL.match(cfg.stack):
        p.append(f"stack name {cfg.stack!r} must be a lowercase DNS label")
    regions = _regions(cfg.cloud)
    if cfg.region not in regions:
        close = difflib.get_close_matches(cfg.region, sorted(regions), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        p.append(f"{k}region {cfg.region!r} is not {'an AWS' if cfg.cloud == 'aws' else 'a GCP'} region{hint}")
    if not cfg.zones:
        p.append(f"{k}zones must list at least one zone")
    zone_pattern = re.escape(cfg.region) + ("-[a-z]" if cfg.cloud == "gcp" else "[a-z]")
    for i, z in enumerate(cfg.zones):
        if cfg.region in regions and not re.fullmatch(zone_pattern, z):
            p.append(f"{k}zones[{i}] {z!r} is not a zone of region {cfg.region!r}")
    if len(set(cfg.zones)) != len(cfg.zones):
        p.append(f"{k}zones lists a zone twice")
    if cfg.cloud == "aws" and len(set(cfg.zones)) < 2:
        # EKS wants the cluster's subnets in at least two Availability Zones, and so does an RDS subnet
        # group (https://docs.aws.amazon.com/eks/latest/userguide/network-reqs.html).
        p.append(f"{k}zones must list at least two zones on AWS (EKS and RDS need subnets in two "
                 f"Availability Zones; got {list(cfg.zones)})")
    if cfg.cloud == "gcp" and not cfg.project:
        p.append(f"{k}project is required when cloud is gcp")
    elif cfg.cloud == "gcp" and not re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]", cfg.project):
        # https://cloud.google.com/resource-manager/docs/creating-managing-projects (project ID rules)
        p.append(f"{k}project {cfg.project!r} is not a GCP project id (6 to 30 lowercase letters, digits and "
                 "hyphens, starting with a letter)")
    if cfg.cloud == "aws" and cfg.project:
        p.append(f"{k}project is a GCP setting; remove it for cloud aws")
    for tag, v in cfg.tags.items():
        if cfg.cloud == "gcp" and not re.match(r"^[a-z][a-z0-9_-]{0,62}$", tag):
            p.append(f"{k}tags.{tag} is not a valid GCP label key (lowercase letters, digits, _ and -)")
        if not isinstance(v, str) or len(v) > 63:
            p.append(f"{k}tags.{tag} must be a string of at most 63 characters")
        elif cfg.cloud == "gcp" and not re.fullmatch(r"[a-z0-9_-]*", v):
            p.append(f"{k}tags.{tag} value {v!r} is not a valid GCP label value (lowercase letters, digits, _ and -)")

    # Network: valid, disjoint ranges.
    nets = {}
    for name in ("vpc_cidr", "pod_cidr", "service_cidr"):
        key = f"{k}network.{_camel(name)}"
        net = _network(getattr(cfg.network, name), key, p)
        if net is not None:
            nets[key] = net
            if net.prefixlen > 20:
                p.append(f"{key} must be /20 or larger (got /{net.prefixlen})")
    items = list(nets.items())
    for i, (ka, a) in enumerate(items):
        for kb, b in items[i + 1:]:
            if a.overlaps(b):
                p.append(f"{kb} {b} overlaps {ka} {a}")
    if cfg.cloud == "gcp" and len(nets) == 3 and not p:
        p.extend(_gcp_address_plan_problems(cfg))
    if cfg.cloud == "aws" and cfg.network.nat == "single" and cfg.is_prod:
        p.append(f"{k}network.nat must be 'per-zone' in a prod stack (one NAT per AZ survives an AZ outage)")

    # Cluster.
    c = cfg.cluster
    p.extend(_kubernetes_version_problems(cfg))
    if c.endpoint_public_access and not c.public_access_cidrs:
        p.append(f"{k}cluster.publicAccessCidrs must list the allowed CIDRs when endpointPublicAccess is true")
    public = []
    for i, cidr in enumerate(c.public_access_cidrs):
        net = _network(cidr, f"{k}cluster.publicAccessCidrs[{i}]", p)
        if net is not None:
            public.append(net)
    # Normalise the set: several ranges can add up to the whole internet (0.0.0.0/1 + 128.0.0.0/1).
    for net in ipaddress.collapse_addresses(public):
        if net.prefixlen == 0:
            p.append(f"{k}cluster.publicAccessCidrs {list(c.public_access_cidrs)} together open the API "
                     "endpoint to the whole internet (0.0.0.0/0)")
    type_pattern = r"[a-z][a-z0-9-]*\.[0-9a-z-]+" if cfg.cloud == "aws" else r"[a-z][a-z0-9]*-[a-z0-9-]+"
    if c.system_node_type and not re.fullmatch(type_pattern, c.system_node_type):
        example = "m6i.xlarge" if cfg.cloud == "aws" else "e2-standard-4"
        kind = "an EC2 instance type" if cfg.cloud == "aws" else "a GCE machine type"
        p.append(f"{k}cluster.systemNodeType {c.system_node_type!r} is not {kind} name (like {example!r})")
    if c.system_nodes_min < 1 or c.system_nodes_max < c.system_nodes_min:
        p.append(f"{k}cluster.systemNodesMax must be >= systemNodesMin >= 1 "
                 f"(got {c.system_nodes_min}..{c.system_nodes_max})")
    if cfg.cloud == "gcp":
        net = _network(c.master_cidr, f"{k}cluster.masterCidr", p)
        if net is not None and net.prefixlen != 28:
            p.append(f"{k}cluster.masterCidr must be a /28 (got /{net.prefixlen})")
        if net is not None:
            for other_key, other in nets.items():
                if net.overlaps(other):
                    p.append(f"{k}cluster.masterCidr {net} overlaps {other_key} {other}: the control plane's "
                             "range must lie outside the cluster's networks")

    # GPU pools.
    if not cfg.gpu_pools:
        p.append(f"{k}gpuPools must list at least one pool")
    seen: set[str] = set()
    total_gpus = 0
    for i, pool in enumerate(cfg.gpu_pools):
        pk = f"{k}gpuPools[{i}]"
        if not _DNS_LABEL.match(pool.name):
            p.append(f"{pk}.name {pool.name!r} must be a lowercase DNS label of at most 32 characters")
        if pool.name in seen:
            p.append(f"{pk}.name {pool.name!r} is used by another pool")
        seen.add(pool.name)
        catalog = EC2 if cfg.cloud == "aws" else GCE
        spec = catalog.get(pool.instance_type)
        if spec is None:
            p.append(f"{pk}.instanceType {pool.instance_type!r} is not a known {cfg.cloud} GPU type "
                     f"(known: {', '.join(sorted(catalog))})")
        if pool.min_nodes < 0:
            p.append(f"{pk}.minNodes must be >= 0 (got {pool.min_nodes})")
        if pool.max_nodes < pool.min_nodes:
            p.append(f"{pk}.maxNodes must be >= minNodes (got {pool.max_nodes} < {pool.min_nodes})")
        if pool.max_nodes < 1:
            p.append(f"{pk}.maxNodes must be >= 1 (got {pool.max_nodes})")
        if not cfg.is_prod and pool.min_nodes != 0:
            p.append(f"{pk}.minNodes must be 0 in a {cfg.environment} stack (GPU pools scale to zero)")
        if pool.capacity in ("reservation", "capacity-block") and not pool.reservation_id:
            p.append(f"{pk}.reservationId is required for capacity {pool.capacity!r}")
        if pool.capacity not in ("reservation", "capacity-block") and pool.reservation_id:
            p.append(f"{pk}.reservationId only applies to reservation or capacity-block capacity")
        # EC2 capacity reservation ids (capacity blocks too) are cr- and 17 hex digits; a GCE
        # reservation is a lowercase resource name, or projects/<p>/reservations/<name> when shared.
        reservation = (r"cr-[0-9a-f]{17}" if cfg.cloud == "aws"
                       else r"(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/reservations/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
        if pool.reservation_id and not re.fullmatch(reservation, pool.reservation_id):
            kind = "an EC2 capacity reservation id (cr- and 17 hex digits)" if cfg.cloud == "aws" else \
                "a GCE reservation name (lowercase letters, digits and hyphens)"
            p.append(f"{pk}.reservationId {pool.reservation_id!r} is not {kind}")
        if pool.capacity == "capacity-block" and cfg.cloud != "aws":
            p.append(f"{pk}.capacity 'capacity-block' is an AWS market type; use 'reservation' on GCP")
        if pool.fabric:
            if not pool.zone:
                p.append(f"{pk}.zone is required when fabric is true (compact placement is in one zone)")
            if spec is not None:
                has_fabric = spec.efa if cfg.cloud == "aws" else spec.fabric != "none"
                if not has_fabric:
                    p.append(f"{pk}.fabric is true but {pool.instance_type} has no high-bandwidth fabric")
        if pool.zone and pool.zone not in cfg.zones:
            p.append(f"{pk}.zone {pool.zone!r} is not one of zones {list(cfg.zones)}")
        if spec is not None and spec.accelerator == "neuron":
            p.append(f"{pk}.instanceType {pool.instance_type} has Trainium chips; the trainer image needs NVIDIA GPUs")
        for label in pool.labels:
            if label.startswith(("gpu-train.io/", "nvidia.com/", "karpenter.sh/")):
                p.append(f"{pk}.labels.{label} uses a reserved prefix")
        if spec is not None:
            total_gpus += spec.gpus * pool.max_nodes
    if total_gpus > cfg.limits.max_gpus:
        p.append(f"{k}gpuPools allow up to {total_gpus} GPUs, over {k}limits.maxGpus = {cfg.limits.max_gpus}")

    # Cache and monitoring.
    if cfg.cache.masters not in (1, 3, 5):
        p.append(f"{k}cache.masters must be 1, 3 or 5 (an odd journal quorum; got {cfg.cache.masters})")
    if cfg.is_prod and cfg.cache.enabled and cfg.cache.masters == 1:
        p.append(f"{k}cache.masters must be 3 or 5 in a prod stack (a single master is a single point of failure)")
    for name in ("page_store_gb", "journal_gb"):
        if getattr(cfg.cache, name) < 1:
            p.append(f"{k}cache.{_camel(name)} must be >= 1")
    if not _DURATION.match(cfg.monitoring.retention):
        p.append(f"{k}monitoring.retention must be a Prometheus duration like '15d' "
                 f"(got {cfg.monitoring.retention!r})")
    if cfg.monitoring.storage_gb < 1 or cfg.monitoring.grafana_storage_gb < 1:
        p.append(f"{k}monitoring.storageGb and grafanaStorageGb must be >= 1")
    if not 1 <= cfg.monitoring.low_utilization_percent <= 100:
        p.append(f"{k}monitoring.lowUtilizationPercent must be between 1 and 100 "
                 f"(got {cfg.monitoring.low_utilization_percent})")
    if cfg.monitoring.checkpoint_max_age_minutes < 1:
        p.append(f"{k}monitoring.checkpointMaxAgeMinutes must be >= 1 "
                 f"(got {cfg.monitoring.checkpoint_max_age_minutes})")

    p.extend(_health_problems(cfg.health))

    # Teams.
    if not cfg.teams:
        p.append(f"{k}teams must list at least one team")
    team_names: set[str] = set()
    for i, team in enumerate(cfg.teams):
        tk = f"{k}teams[{i}]"
        if not _DNS_LABEL.match(team.name):
            p.append(f"{tk}.name {team.name!r} must be a lowercase DNS label")
        if team.name in team_names:
            p.append(f"{tk}.name {team.name!r} is used by another team")
        team_names.add(team.name)
        p.extend(_team_quota_problems(cfg, team, tk))
        for field_name in ("submitters", "viewers"):
            for j, group in enumerate(getattr(team, field_name)):
                if not group.strip():
                    p.append(f"{tk}.{field_name}[{j}] must name a group (got {group!r})")
                elif group.startswith("system:"):
                    # https://kubernetes.io/docs/reference/access-authn-authz/authentication/ (system: is reserved)
                    p.append(f"{tk}.{field_name}[{j}] {group!r} uses the system: prefix Kubernetes reserves for "
                             "its own groups")
        p.extend(_member_problems(cfg, team, tk))
    p.extend(_principal_problems(cfg))
    if cfg.cloud == "gcp":
        p.extend(gke_group_problems(cfg.teams))
    p.extend(_logs_problems(cfg))

    # Job.
    if cfg.job is not None:
        _check_job(cfg, cfg.job, p)

    # Image and MLflow.
    if cfg.image.prebuilt and not _IMAGE_DIGEST.match(cfg.image.prebuilt):
        p.append(f"{k}image.prebuilt must be pinned by digest, like repo/name@sha256:<64 hex> "
                 f"(got {cfg.image.prebuilt!r})")
    if cfg.mlflow.storage_gb < 1:
        p.append(f"{k}mlflow.storageGb must be >= 1")
    p.extend(_deploy_runner_problems(cfg))
    if cfg.deploy:
        p.extend(placeholder_problems(cfg))
    return p


# An IAM role or user ARN (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference-arns.html); an
# assumed-role session (arn:aws:sts::...:assumed-role/...) is temporary and cannot have an access entry.
_IAM_PRINCIPAL = re.compile(r"arn:aws(-cn|-us-gov)?:iam::[0-9]{12}:(role|user)/[A-Za-z0-9+=,.@_/-]{1,512}")


def _member_problems(cfg: StackConfig, team: TeamConfig, tk: str) -> list[str]:
    p = []
    for j, member in enumerate(team.members):
        mk = f"{tk}.members[{j}]"
        if cfg.cloud != "aws":
            p.append(f"{mk} is an AWS setting (EKS access entries); on GKE add people to the Google groups in "
                     f"{tk}.submitters / viewers")
            continue
        if not _IAM_PRINCIPAL.fullmatch(member.principal):
            p.append(f"{mk}.principal {member.principal!r} is not an IAM role or user ARN "
                     "(arn:aws:iam::<account>:role/<name>); an STS session ARN cannot have an access entry")
        groups = team.submitters if member.role == "submitter" else team.viewers
        if not groups:
            p.append(f"{mk}.role {member.role!r} needs {tk}.{member.role}s to name at least one group: the access "
                     "entry gives the principal those Kubernetes groups")
    return p


def _principal_problems(cfg: StackConfig) -> list[str]:
    """A principal can hold one EKS access entry, so it may appear once per team."""
    p = []
    for i, team in enumerate(cfg.teams):
        seen: set[str] = set()
        for j, member in enumerate(team.members):
            if member.principal in seen:
                p.append(f"{PROJECT}:teams[{i}].members[{j}].principal {member.principal!r} is listed twice in "
                         f"team {team.name!r}")
            seen.add(member.principal)
    return p


def team_access_entries(teams: tuple[TeamConfig, ...]) -> dict[str, tuple[str, ...]]:
    """IAM principal -> the Kubernetes groups of its EKS access entry: the submitters (or viewers) groups of
    every team that lists it. One principal may hold one access entry per cluster, so a member of several
    teams gets one entry with every team's groups."""
    out: dict[str, set[str]] = {}
    for team in teams:
        for member in team.members:
            groups = team.submitters if member.role == "submitter" else team.viewers
            out.setdefault(member.principal, set()).update(groups)
    return {principal: tuple(sorted(groups)) for principal, groups in sorted(out.items())}


def _gke_group_domains(teams: tuple[TeamConfig, ...]) -> tuple[dict[str, str], list[str]]:
    """Domain -> the first setting naming a group of it, and the settings whose group is not an e-mail address."""
    domains: dict[str, str] = {}
    bad: list[str] = []
    for t, team in enumerate(teams):
        for field_name, groups in (("submitters", team.submitters), ("viewers", team.viewers)):
            for g, group in enumerate(groups):
                key = f"{PROJECT}:teams[{t}].{field_name}[{g}]"
                if "@" not in group:
                    bad.append(f"{key} must be a Google group e-mail address on GKE (got {group!r})")
                else:
                    domains.setdefault(group.rsplit("@", 1)[1].lower(), key)
    return domains, bad


def gke_group_problems(teams: tuple[TeamConfig, ...]) -> list[str]:
    """GKE's Google Groups for RBAC reads one gke-security-groups@<domain> group per cluster: the team groups
    must be e-mail addresses of one domain."""
    domains, bad = _gke_group_domains(teams)
    if len(domains) > 1:
        listed = ", ".join(f"{d} ({k})" for d, k in sorted(domains.items()))
        bad.append(f"{PROJECT}:teams groups span several domains ({listed}); Google Groups for RBAC reads one "
                   "gke-security-groups@<domain> group per cluster")
    return bad


def gke_security_group(teams: tuple[TeamConfig, ...]) -> str | None:
    """The Google Groups for RBAC security group, gke-security-groups@<domain> of the teams' groups; None when
    no team names a group. Refuses what gke_group_problems reports."""
    problems = gke_group_problems(teams)
    if problems:
        raise ConfigError(problems)
    domains, _ = _gke_group_domains(teams)
    return f"gke-security-groups@{next(iter(domains))}" if domains else None


def _logs_problems(cfg: StackConfig) -> list[str]:
    days = cfg.logs.retention_days
    if days is None or isinstance(days, bool) or not isinstance(days, int):
        return []
    key = f"{PROJECT}:logs.retentionDays"
    if cfg.cloud != "aws":
        return [f"{key} applies to CloudWatch Logs on AWS; GKE keeps container logs in Cloud Logging, whose "
                "retention is the project's _Default log bucket setting"]
    if days not in LOG_RETENTION_DAYS:
        return [f"{key} {days} is not a retention CloudWatch Logs offers ({', '.join(map(str, LOG_RETENTION_DAYS))})"]
    return []


def log_retention_days(cfg: StackConfig) -> int:
    """Days the team namespaces' container logs are kept in CloudWatch Logs."""
    return cfg.logs.retention_days if cfg.logs.retention_days is not None else 30


def _health_problems(h: HealthConfig) -> list[str]:
    k = f"{PROJECT}:health"
    p = []
    seen: set[int] = set()
    for i, code in enumerate(h.xid_codes):
        if isinstance(code, bool) or not isinstance(code, int):
            continue  # reported by the reader
        if not 1 <= code <= 999:
            p.append(f"{k}.xidCodes[{i}] {code} is not an NVIDIA XID (1 to 999)")
        elif code in APPLICATION_XIDS:
            p.append(f"{k}.xidCodes[{i}] XID {code} is raised by an application fault, not a GPU fault "
                     f"(application XIDs: {sorted(APPLICATION_XIDS)}); quarantining on it would empty healthy nodes")
        elif code in seen:
            p.append(f"{k}.xidCodes[{i}] XID {code} is listed twice")
        seen.add(code)
    if h.max_concurrent_repairs < 1:
        p.append(f"{k}.maxConcurrentRepairs must be >= 1 (got {h.max_concurrent_repairs})")
    if h.dcgm_diag_level not in (1, 2):
        p.append(f"{k}.dcgmDiagLevel must be 1 or 2 (got {h.dcgm_diag_level}): level 3 and 4 run for 30 minutes "
                 "and more, longer than a node may wait before it takes work")
    return p


def _deploy_runner_problems(cfg: StackConfig) -> list[str]:
    k = f"{PROJECT}:deployRunner"
    r = cfg.deploy_runner
    p = []
    if r.kind == "codebuild":
        if cfg.cloud != "aws":
            p.append(f"{k}.kind 'codebuild' is an AWS runner; GKE's control plane is reached through its "
                     "DNS-based endpoint")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", r.repository):
            p.append(f"{k}.repository must be a GitHub <owner>/<name> (got {r.repository!r})")
        if not re.fullmatch(r"arn:aws[a-z-]*:(codeconnections|codestar-connections):[a-z0-9-]+:[0-9]{12}:"
                            r"connection/[A-Za-z0-9-]+", r.connection_arn):
            p.append(f"{k}.connectionArn must be a CodeConnections connection ARN "
                     f"(arn:aws:codeconnections:<region>:<account>:connection/<id>; got {r.connection_arn!r})")
    elif r.repository or r.connection_arn:
        p.append(f"{k}.repository and connectionArn only apply with kind 'codebuild'")
    if cfg.deploy and cfg.cloud == "aws" and r.kind != "codebuild":
        p.append(f"{k}.kind must be 'codebuild' in an AWS stack marked deploy: true: the workflows reach the "
                 "private EKS endpoint through that runner (docs/ci.md)")
    return p


# Trainer keys that have their own job setting: setting them again in job.overrides would be ambiguous.
MANAGED_OVERRIDES = {
    "train.steps": "steps",
    "train.global_batch_tokens": "globalBatchTokens",
    "checkpoint.every_steps": "checkpointEvery",
    "checkpoint.remote_uri": "checkpointUri",
    "data.uri": "datasetUri",
}


def override_text(key: str, value: Any) -> str:
    """One `section.key=value` argument of the trainer's command line."""
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    return f"{key}={value}"


def job_trainer_overrides(job: JobConfig) -> list[str]:
    """The overrides the trainer gets from the job's own settings, then job.overrides (the JobSet adds
    paths and URIs that depend on the cluster)."""
    values: dict[str, Any] = {
        "train.steps": job.steps,
        "train.global_batch_tokens": job.global_batch_tokens,
        "checkpoint.every_steps": job.checkpoint_every,
        **job.overrides,
    }
    return [override_text(k, v) for k, v in values.items()]


def parse_nodes(nodes: str) -> tuple[int, int] | None:
    """(MIN, MAX) of a `MIN:MAX` node range, or None when it is not one."""
    m = re.fullmatch(r"([0-9]{1,6}):([0-9]{1,6})", nodes)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        return None
    return int(m.group(1)), int(m.group(2))


def job_gpus_per_node(cfg: StackConfig, job: JobConfig) -> int:
    """GPUs each of the job's pods uses: the setting, or all of its pool's instance type (0 if unknown)."""
    pool = next((x for x in cfg.gpu_pools if x.name == job.pool), None)
    spec = _catalog(cfg.cloud).get(pool.instance_type) if pool is not None else None
    return job.gpus_per_node or (spec.gpus if spec is not None else 0)


def read_job(raw: Any, *, cfg: StackConfig, key: str = f"{PROJECT}:job") -> JobConfig:
    """A job's settings read and checked exactly as the stack's `job` setting is (types, unknown keys, then
    every plan-time job check against `cfg`'s teams and pools), with `key` naming the settings in messages.
    A team member's job spec file for `gpu-train submit` goes through here with key "job"."""
    reader = _Reader()
    job = reader.read_dataclass(JobConfig, raw, key)
    if reader.problems or job is None:
        raise ConfigError(reader.problems)
    problems: list[str] = []
    _check_job(cfg, job, problems, key)
    if problems:
        raise ConfigError(problems)
    return job


def _check_job(cfg: StackConfig, job: JobConfig, p: list[str], jk: str = f"{PROJECT}:job") -> None:
    if not _DNS_LABEL.match(job.name):
        p.append(f"{jk}.name {job.name!r} must be a lowercase DNS label of at most 32 characters")
    team = next((t for t in cfg.teams if t.name == job.team), None)
    if team is None:
        p.append(f"{jk}.team {job.team!r} is not one of teams[].name ({', '.join(t.name for t in cfg.teams)})")
    pool = next((x for x in cfg.gpu_pools if x.name == job.pool), None)
    if pool is None:
        p.append(f"{jk}.pool {job.pool!r} is not one of gpuPools[].name "
                 f"({', '.join(x.name for x in cfg.gpu_pools)})")
    spec = _catalog(cfg.cloud).get(pool.instance_type) if pool is not None else None
    nodes = parse_nodes(job.nodes)
    if nodes is None:
        p.append(f"{jk}.nodes must be MIN:MAX with 1 <= MIN <= MAX, like '2:4' (got {job.nodes!r})")
    elif pool is not None and nodes[1] > pool.max_nodes:
        p.append(f"{jk}.nodes MAX {nodes[1]} is more than pool {pool.name!r} maxNodes {pool.max_nodes}")
    if job.gpus_per_node < 0:
        p.append(f"{jk}.gpusPerNode must be >= 0 (got {job.gpus_per_node})")
    elif spec is not None and job.gpus_per_node > spec.gpus:
        p.append(f"{jk}.gpusPerNode {job.gpus_per_node} is more than {pool.instance_type} has ({spec.gpus})")
    for name in ("steps", "global_batch_tokens", "checkpoint_every"):
        if getattr(job, name) < 1:
            p.append(f"{jk}.{_camel(name)} must be >= 1 (got {getattr(job, name)})")
    if job.max_restarts < 0:
        p.append(f"{jk}.maxRestarts must be >= 0 (got {job.max_restarts})")
    if job.data_wait_minutes < 0:
        p.append(f"{jk}.dataWaitMinutes must be >= 0 (got {job.data_wait_minutes})")
    from infra.k8s.admission import timeout_problems

    p.extend(timeout_problems(rendezvous_s=job.rendezvous_timeout_minutes * 60,
                              key=f"{jk}.rendezvousTimeoutMinutes"))
    scheme = "s3://" if cfg.cloud == "aws" else "gs://"
    for name in ("dataset_uri", "checkpoint_uri"):
        uri = getattr(job, name)
        if uri and not re.fullmatch(re.escape(scheme) + r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?", uri):
            p.append(f"{jk}.{_camel(name)} must be {scheme}<bucket>/<path> on {cfg.cloud} (got {uri!r})")
    shape_ok = True
    for key, value in job.overrides.items():
        if not re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", key):
            p.append(f"{jk}.overrides.{key} must be a dotted trainer key like 'train.lr'")
            shape_ok = False
        elif key in MANAGED_OVERRIDES:
            p.append(f"{jk}.overrides.{key} is set by {jk}.{MANAGED_OVERRIDES[key]}; set that instead")
            shape_ok = False
        if isinstance(value, dict | list) or value is None:
            p.append(f"{jk}.overrides.{key} must be a number, string or true/false (got {value!r})")
            shape_ok = False
        elif isinstance(value, float) and not math.isfinite(value):
            p.append(f"{jk}.overrides.{key} must be a finite number (got {value!r})")
            shape_ok = False
    if shape_ok and job.steps >= 1 and job.global_batch_tokens >= 1 and job.checkpoint_every >= 1:
        _check_trainer_settings(cfg, job, nodes, p, jk)
    if team is not None and pool is not None and nodes is not None and spec is not None:
        nominal = cfg.team_quota(team).get(pool.name, 0)
        need = nodes[0] * job_gpus_per_node(cfg, job)
        if nominal < need:
            index = cfg.teams.index(team)
            p.append(f"{PROJECT}:teams[{index}].gpuQuota gives team {team.name!r} {nominal} GPUs of nominal quota "
                     f"on pool {pool.name!r}, below the {need} that {jk}.nodes MIN {nodes[0]} x "
                     f"{job_gpus_per_node(cfg, job)} GPUs need")


def _check_trainer_settings(cfg: StackConfig, job: JobConfig, nodes: tuple[int, int] | None,
                            p: list[str], jk: str = f"{PROJECT}:job") -> None:
    """The job's preset and overrides through the trainer's own loader, and its global batch at every
    world size from MIN to MAX nodes."""
    from gpu_train.spec.trainer_config import ConfigError as TrainerConfigError
    from gpu_train.spec.trainer_config import batch_layout, build_config

    try:
        tcfg = build_config(job.preset, overrides=job_trainer_overrides(job))
    except TrainerConfigError as exc:
        text = str(exc)
        if text.startswith("--preset"):
            p.append(f"{jk}.preset {job.preset!r}: {text.split(':', 1)[1].strip()}")
            return
        key = text.split(":", 1)[0].split(" ", 1)[0]
        setting = next((f"{jk}.{v}" for k, v in MANAGED_OVERRIDES.items() if k == key), None)
        where = setting or (f"{jk}.overrides.{key}" if key in job.overrides else f"{jk}.preset {job.preset!r}")
        p.append(f"{where}: the trainer refuses it: {text}")
        return
    gpus = job_gpus_per_node(cfg, job)
    if nodes is None or gpus < 1:
        return
    for n in range(nodes[0], nodes[1] + 1):
        try:
            batch_layout(tcfg, n * gpus)
        except TrainerConfigError as exc:
            per_step = tcfg.train.micro_batch_size * tcfg.model.context
            sizes = [m * gpus for m in range(nodes[0], nodes[1] + 1)]
            lcm = math.lcm(*sizes) * per_step
            hint = (f"A multiple of {lcm} tokens works at every world size from {sizes[0]} to {sizes[-1]}"
                    if lcm <= 1 << 32 else f"No global batch of practical size divides every world size from "
                    f"{sizes[0]} to {sizes[-1]}; narrow {jk}.nodes")
            p.append(f"{jk}.globalBatchTokens {job.global_batch_tokens} does not divide at world size "
                     f"{n * gpus} ({n} nodes x {gpus} GPUs, within {jk}.nodes {job.nodes}): {exc}. {hint}")
            return


def _gcp_address_plan_problems(cfg: StackConfig) -> list[str]:
    """The GCP layer's own address planning (fabric subnets in 192.168.0.0/16, the Private Service
    Access range in 10.0.0.0/8) must find room beside the stack's ranges."""
    try:
        ipaddress.IPv4Network(cfg.cluster.master_cidr)
    except ValueError:
        return []  # reported with the cluster settings
    from infra.gcp import network

    problems = []
    if any(p.fabric for p in cfg.gpu_pools):
        try:
            network.fabric_sets(cfg)
        except (ValueError, KeyError) as exc:
            problems.append(f"{PROJECT}:network ranges leave no room for the GPU fabric subnets: {exc}")
    if cfg.mlflow.enabled and cfg.mlflow.database == "managed":
        try:
            network.psa_range(cfg)
        except ValueError as exc:
            problems.append(f"{PROJECT}:network ranges leave no room for Cloud SQL's private range: {exc}")
    return problems


@functools.cache
def _regions(cloud: str) -> frozenset[str]:
    if cloud == "gcp":
        return GCP_REGIONS
    import botocore.session

    session = botocore.session.get_session()
    return frozenset(r for partition in ("aws", "aws-cn", "aws-us-gov")
                     for r in session.get_available_regions("eks", partition_name=partition))


def _kubernetes_version_problems(cfg: StackConfig) -> list[str]:
    key = f"{PROJECT}:cluster.kubernetesVersion"
    version = cfg.cluster.kubernetes_version
    if cfg.cloud == "aws":
        offered, where = KUBERNETES_VERSIONS["aws"][""], "EKS"
    else:
        channel = cfg.cluster.release_channel
        offered, where = KUBERNETES_VERSIONS["gcp"].get(channel, ()), f"GKE's {channel} channel"
    supported = [v for v in offered if tuple(int(x) for x in v.split(".")) >= PLATFORM_MIN_KUBERNETES]
    if version in supported:
        return []
    if version in offered:
        return [f"{key} {version!r} is older than this platform supports (Job successPolicy needs 1.31 or "
                f"later; {where} offers {', '.join(supported)})"]
    return [f"{key} {version!r} is not a Kubernetes minor {where} offers for new clusters "
            f"(supported: {', '.join(supported)})"]


def _team_quota_problems(cfg: StackConfig, team: TeamConfig, tk: str) -> list[str]:
    p = []
    pools = {pool.name: pool for pool in cfg.gpu_pools}
    if isinstance(team.gpu_quota, Mapping):
        for name, gpus in team.gpu_quota.items():
            if name not in pools:
                p.append(f"{tk}.gpuQuota.{name} is not one of gpuPools[].name ({', '.join(pools)})")
            elif not isinstance(gpus, int) or isinstance(gpus, bool):
                continue  # reported by the reader
            elif gpus < 0:
                p.append(f"{tk}.gpuQuota.{name} must be >= 0 (got {gpus})")
            elif gpus > cfg.pool_capacity(pools[name]) and cfg.pool_capacity(pools[name]):
                p.append(f"{tk}.gpuQuota.{name} {gpus} is more than pool {name!r} can ever hold "
                         f"({cfg.pool_capacity(pools[name])} GPUs: maxNodes x GPUs per node)")
    elif team.gpu_quota < 0:
        p.append(f"{tk}.gpuQuota must be >= 0 (got {team.gpu_quota})")
    if not p and pools and sum(v for v in cfg.team_quota(team).values() if isinstance(v, int)) == 0:
        p.append(f"{tk}.gpuQuota gives team {team.name!r} no GPUs on any pool: it could only run on what "
                 "other teams lend")
    return p


def _walk(value: Any, key: str):
    """(full key, value) for every scalar in a settings tree."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.name != "stack":
                yield from _walk(getattr(value, f.name), f"{key}.{_camel(f.name)}" if key else f"{PROJECT}:{_camel(f.name)}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, f"{key}.{k}")
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{key}[{i}]")
    else:
        yield key, value


def _placeholder(key: str, value: str) -> str | None:
    """Why a value looks like an example stack's placeholder rather than something real."""
    for token in re.split(r"[\s,;]+", value):
        try:
            net = ipaddress.ip_network(token, strict=False)
        except ValueError:
            continue
        for doc in DOCUMENTATION_RANGES:
            if net.version == doc.version and net.overlaps(doc):
                return f"{net} is in the documentation range {doc} (RFC {'3849' if doc.version == 6 else '5737'})"
    low = value.lower()
    if _EXAMPLE_DOMAIN.search(low):
        return "it names a reserved example domain (RFC 2606)"
    if any(acct in re.findall(r"(?<![0-9])[0-9]{12}(?![0-9])", value) for acct in _SAMPLE_ACCOUNTS):
        return "it holds an AWS documentation sample account id"
    if _ACME.search(value):
        return "'acme' is the example company of the example stacks"
    if _PLACEHOLDER_WORD.search(value) and ".overrides." not in key:  # trainer settings are not names
        return "it reads as a placeholder"
    if key.endswith(".reservationId") and _SEQUENCE.search(low):
        return "it is a made-up reservation id (a run of sequential or repeated characters)"
    return None


def placeholder_problems(cfg: StackConfig) -> list[str]:
    """Values of a stack marked for deployment that are an example's placeholders, by full key."""
    problems = []
    for key, value in _walk(cfg, ""):
        if isinstance(value, str) and value:
            why = _placeholder(key, value)
            if why:
                problems.append(f"{key} {value!r} is a placeholder in a stack marked deploy: true: {why}")
    return problems


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def parse(raw: Mapping[str, Any], stack: str) -> StackConfig:
    """Validate the `gpu-train:*` settings of one stack (other namespaces are ignored)."""
    prefix = f"{PROJECT}:"
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if isinstance(value, str) and value[:1] in "[{":
            # The Pulumi engine hands structured settings to programs as JSON strings.
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError([f"{key} is not valid JSON: {exc}"]) from None
        elif isinstance(value, str) and _top_level_type(name) is bool and value in ("true", "false"):
            # ... and top-level scalars as strings: `gpu-train:deploy: true` arrives as "true".
            value = value == "true"
        values[name] = value
    reader = _Reader()
    cfg = reader.read_dataclass(StackConfig, values, "", skip=("stack",))
    if reader.problems or cfg is None:
        raise ConfigError(reader.problems)
    cfg = dataclasses.replace(cfg, stack=stack) if cfg.stack != stack else cfg
    problems = _check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _top_level_type(camel: str) -> Any:
    hints = typing.get_type_hints(StackConfig)
    return next((hints[f.name] for f in dataclasses.fields(StackConfig) if _camel(f.name) == camel), None)


def load() -> StackConfig:
    """Read this stack's settings from the Pulumi engine (inside `pulumi up/preview` or under mocks)."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    raw = dict(runtime_config.get_config_env())
    raw.update(runtime_config.CONFIG.get())
    return parse(raw, stack=pulumi.get_stack())


def deploy_matrix(stack_dir: Path) -> dict[str, list[dict[str, str]]]:
    """The stacks the workflows deploy: every `Pulumi.<stack>.yaml` in `stack_dir` that sets
    `gpu-train:deploy: true`, as GitHub Actions matrix entries ({"stack", "cloud", "region"}) split into
    {"nonprod", "prod"}. The other files are examples: planned and tested, never deployed."""
    import yaml

    out: dict[str, list[dict[str, str]]] = {"nonprod": [], "prod": []}
    for path in sorted(stack_dir.glob("Pulumi.*.yaml")):
        stack = path.name[len("Pulumi."):-len(".yaml")]
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
        raw = doc.get("config") if isinstance(doc, dict) else None
        if not isinstance(raw, dict) or raw.get(f"{PROJECT}:deploy") is not True:
            continue
        cloud, environment = raw.get(f"{PROJECT}:cloud"), raw.get(f"{PROJECT}:environment")
        region = raw.get(f"{PROJECT}:region")
        if cloud not in ("aws", "gcp") or environment not in ("dev", "staging", "prod") or not isinstance(region, str):
            raise ConfigError([f"{path}: a stack marked deploy: true needs {PROJECT}:cloud aws|gcp, "
                               f"{PROJECT}:environment dev|staging|prod and {PROJECT}:region "
                               f"(got {cloud!r}, {environment!r}, {region!r})"])
        runner = raw.get(f"{PROJECT}:deployRunner")
        if cloud == "aws" and not (isinstance(runner, dict) and runner.get("kind") == "codebuild"):
            raise ConfigError([f"{path}: an AWS stack marked deploy: true needs {PROJECT}:deployRunner.kind "
                               "codebuild (the runner inside its VPC that the workflows run on)"])
        out["prod" if environment == "prod" else "nonprod"].append({"stack": stack, "cloud": cloud, "region": region})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m infra.config")
    sub = parser.add_subparsers(dest="command", required=True)
    matrix = sub.add_parser("deploy-matrix", help="print the stacks marked deploy: true as GitHub outputs "
                                                  "(nonprod=<json>, prod=<json>, all=<json>, aws=<true|false>)")
    matrix.add_argument("stack_dir", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "stacks")
    args = parser.parse_args(argv)
    try:
        found = deploy_matrix(args.stack_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"nonprod={json.dumps(found['nonprod'])}")
    print(f"prod={json.dumps(found['prod'])}")
    print(f"all={json.dumps(found['nonprod'] + found['prod'])}")
    uses_aws = any(e["cloud"] == "aws" for e in found["nonprod"] + found["prod"])
    print(f"aws={'true' if uses_aws else 'false'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
