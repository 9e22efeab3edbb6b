"""Stack settings, loaded once into frozen, validated dataclasses.

Usage:
    cfg = infra.config.load()                       # inside a Pulumi program (reads pulumi config)
    cfg = infra.config.parse(raw, stack="aws-dev")  # from a dict of "gpu-train:<key>" -> value

Every setting lives under the `gpu-train:` namespace of `stacks/Pulumi.<stack>.yaml`. Keys are
camelCase in YAML and snake_case here. Unknown keys are errors (a typo is never ignored), and every
invalid value fails here, before any resource exists, with the full key in the message, for example
`gpu-train:gpuPools[0].maxNodes must be >= minNodes (got 2 < 4)`. All problems are reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PROJECT = "gpu-train"

Cloud = Literal["aws", "gcp"]
Environment = Literal["dev", "staging", "prod"]
Capacity = Literal["spot", "on-demand", "reservation", "capacity-block"]

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
_IMAGE_DIGEST = re.compile(r"^[a-z0-9.\-/:_]+@sha256:[0-9a-f]{64}$")
_K8S_VERSION = re.compile(r"^1\.(2[89]|3[0-9])$")


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


@dataclass(frozen=True, kw_only=True)
class TeamConfig:
    name: str  # DNS label; namespace team-<name>
    gpu_quota: int  # nominal GPUs in the team's ClusterQueue
    submitters: tuple[str, ...] = ()  # identity-provider groups allowed to submit jobs
    viewers: tuple[str, ...] = ()  # groups allowed to read jobs and logs


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
    suspend: bool = False  # pause (true) and resume (false) through `pulumi up`
    max_restarts: int = 3  # JobSet failure policy and torchrun --max-restarts


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
class LimitsConfig:
    max_gpus: int = 64  # cap on the sum of maxNodes x GPUs over all pools (also a policy)


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    cloud: Cloud  # which cloud layer builds the platform
    environment: Environment  # prod turns on HA defaults; dev/staging require scale-to-zero GPU pools
    region: str  # AWS region or GCP region
    zones: tuple[str, ...]  # zones the network spans (3 recommended)
    stack: str = ""  # the Pulumi stack name (not a setting; filled in by the loader)
    project: str = ""  # GCP project id (GCP only)
    tags: Mapping[str, str] = field(default_factory=dict)  # extra tags / labels on every resource
    network: NetworkConfig = field(default_factory=NetworkConfig)  # address plan and NAT
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # control plane and system nodes
    gpu_pools: tuple[GpuPoolConfig, ...] = ()  # at least one GPU node pool
    cache: CacheConfig = field(default_factory=CacheConfig)  # Alluxio NVMe cache
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)  # Prometheus, Grafana, alerts
    teams: tuple[TeamConfig, ...] = ()  # tenants: namespace, queue and GPU quota each
    job: JobConfig | None = None  # the stack's training job (none: the platform only)
    image: ImageConfig = field(default_factory=ImageConfig)  # trainer image source
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # tracking server and registry
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # guard rails checked here and by policy

    @property
    def is_prod(self) -> bool:
        return self.environment == "prod"

    def pool(self, name: str) -> GpuPoolConfig:
        return next(p for p in self.gpu_pools if p.name == name)

    def team(self, name: str) -> TeamConfig:
        return next(t for t in self.teams if t.name == name)


# --------------------------------------------------------------------------------------------
# Generic typed reader: camelCase keys, unknown keys rejected, types checked.
# --------------------------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
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
            (inner,) = [a for a in args if a is not type(None)]
            return self.read(inner, value, key)
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
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                self.fail(key, f"must be a number (got {value!r})")
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
    if not cfg.zones:
        p.append(f"{k}zones must list at least one zone")
    for i, z in enumerate(cfg.zones):
        if not z.startswith(cfg.region + "-" if cfg.cloud == "gcp" else cfg.region):
            p.append(f"{k}zones[{i}] {z!r} is not in region {cfg.region!r}")
    if len(set(cfg.zones)) != len(cfg.zones):
        p.append(f"{k}zones lists a zone twice")
    if cfg.cloud == "gcp" and not cfg.project:
        p.append(f"{k}project is required when cloud is gcp")
    if cfg.cloud == "aws" and cfg.project:
        p.append(f"{k}project is a GCP setting; remove it for cloud aws")
    for tag, v in cfg.tags.items():
        if cfg.cloud == "gcp" and not re.match(r"^[a-z][a-z0-9_-]{0,62}$", tag):
            p.append(f"{k}tags.{tag} is not a valid GCP label key (lowercase letters, digits, _ and -)")
        if not isinstance(v, str) or len(v) > 63:
            p.append(f"{k}tags.{tag} must be a string of at most 63 characters")

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
    if cfg.cloud == "aws" and cfg.network.nat == "single" and cfg.is_prod:
        p.append(f"{k}network.nat must be 'per-zone' in a prod stack (one NAT per AZ survives an AZ outage)")

    # Cluster.
    c = cfg.cluster
    if not _K8S_VERSION.match(c.kubernetes_version):
        p.append(f"{k}cluster.kubernetesVersion must be a supported minor version like '1.33' "
                 f"(got {c.kubernetes_version!r})")
    if c.endpoint_public_access and not c.public_access_cidrs:
        p.append(f"{k}cluster.publicAccessCidrs must list the allowed CIDRs when endpointPublicAccess is true")
    for i, cidr in enumerate(c.public_access_cidrs):
        net = _network(cidr, f"{k}cluster.publicAccessCidrs[{i}]", p)
        if net is not None and net.prefixlen == 0:
            p.append(f"{k}cluster.publicAccessCidrs[{i}] must not be 0.0.0.0/0")
    if c.system_nodes_min < 1 or c.system_nodes_max < c.system_nodes_min:
        p.append(f"{k}cluster.systemNodesMax must be >= systemNodesMin >= 1 "
                 f"(got {c.system_nodes_min}..{c.system_nodes_max})")
    if cfg.cloud == "gcp":
        net = _network(c.master_cidr, f"{k}cluster.masterCidr", p)
        if net is not None and net.prefixlen != 28:
            p.append(f"{k}cluster.masterCidr must be a /28 (got /{net.prefixlen})")

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
        p.append(f"{k}monitoring.lowUtilizationPercent must be between 1 and 100")

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
        if team.gpu_quota < 0:
            p.append(f"{tk}.gpuQuota must be >= 0 (got {team.gpu_quota})")
        elif team.gpu_quota > total_gpus and total_gpus:
            p.append(f"{tk}.gpuQuota {team.gpu_quota} is more than the pools can ever provide ({total_gpus})")

    # Job.
    if cfg.job is not None:
        _check_job(cfg, cfg.job, p)

    # Image and MLflow.
    if cfg.image.prebuilt and not _IMAGE_DIGEST.match(cfg.image.prebuilt):
        p.append(f"{k}image.prebuilt must be pinned by digest, like repo/name@sha256:<64 hex> "
                 f"(got {cfg.image.prebuilt!r})")
    if cfg.mlflow.storage_gb < 1:
        p.append(f"{k}mlflow.storageGb must be >= 1")
    return p


def _check_job(cfg: StackConfig, job: JobConfig, p: list[str]) -> None:
    jk = f"{PROJECT}:job"
    if not _DNS_LABEL.match(job.name):
        p.append(f"{jk}.name {job.name!r} must be a lowercase DNS label")
    if job.team not in {t.name for t in cfg.teams}:
        p.append(f"{jk}.team {job.team!r} is not one of teams[].name")
    pool = next((x for x in cfg.gpu_pools if x.name == job.pool), None)
    if pool is None:
        p.append(f"{jk}.pool {job.pool!r} is not one of gpuPools[].name")
    m = re.fullmatch(r"([0-9]+):([0-9]+)", job.nodes)
    if not m:
        p.append(f"{jk}.nodes must be MIN:MAX, like '2:4' (got {job.nodes!r})")
    else:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo < 1 or hi < lo:
            p.append(f"{jk}.nodes must have 1 <= MIN <= MAX (got {job.nodes!r})")
        elif pool is not None and hi > pool.max_nodes:
            p.append(f"{jk}.nodes MAX {hi} is more than pool {pool.name!r} maxNodes {pool.max_nodes}")
    if pool is not None and job.gpus_per_node:
        from infra.aws.catalog import CATALOG as EC2
        from infra.gcp.catalog import CATALOG as GCE

        spec = (EC2 if cfg.cloud == "aws" else GCE).get(pool.instance_type)
        if spec is not None and job.gpus_per_node > spec.gpus:
            p.append(f"{jk}.gpusPerNode {job.gpus_per_node} is more than {pool.instance_type} has ({spec.gpus})")
    if job.gpus_per_node < 0:
        p.append(f"{jk}.gpusPerNode must be >= 0 (got {job.gpus_per_node})")
    for name in ("steps", "global_batch_tokens", "checkpoint_every"):
        if getattr(job, name) < 1:
            p.append(f"{jk}.{_camel(name)} must be >= 1 (got {getattr(job, name)})")
    if job.max_restarts < 0:
        p.append(f"{jk}.maxRestarts must be >= 0 (got {job.max_restarts})")
    scheme = "s3://" if cfg.cloud == "aws" else "gs://"
    for name in ("dataset_uri", "checkpoint_uri"):
        uri = getattr(job, name)
        if uri and not uri.startswith(scheme):
            p.append(f"{jk}.{_camel(name)} must start with {scheme} on {cfg.cloud} (got {uri!r})")
    for key, value in job.overrides.items():
        if not re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", key):
            p.append(f"{jk}.overrides.{key} must be a dotted trainer key like 'train.lr'")
        if isinstance(value, dict | list):
            p.append(f"{jk}.overrides.{key} must be a scalar (got {value!r})")


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


def load() -> StackConfig:
    """Read this stack's settings from the Pulumi engine (inside `pulumi up/preview` or under mocks)."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    raw = dict(runtime_config.get_config_env())
    raw.update(runtime_config.CONFIG.get())
    return parse(raw, stack=pulumi.get_stack())
