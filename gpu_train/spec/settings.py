"""Stack settings: the typed model of `stacks/Pulumi.<stack>.yaml`, read once into frozen pydantic models.

Usage:
    settings = read(raw)                      # raw: {"gpu-train:<key>": value}; raises SettingsError
    # or gpu_train.spec.settings_checks.parse(raw, stack="aws-dev"): read, then the checks across settings
    settings.gpu_pools[0].max_nodes           # snake_case here, camelCase in the YAML
    StackSettings.model_json_schema(by_alias=True)   # JSON Schema of the `gpu-train:` block (docs/configuration.md)

Every setting lives under the `gpu-train:` namespace. Keys are camelCase in YAML and snake_case here. An unknown
key is an error naming it (with "did you mean"), and a value of the wrong type or out of range fails with its
full key, for example `gpu-train:gpuPools[0].maxNodes must be >= minNodes (got 2 < 4)`. Values are read
strictly: a boolean is true or false, a whole number is not a string, a list is a list.

Two rounds: first every value's type and range (all problems in the file at once; `read`, here), then, on a file
whose values all have their type, the checks across settings (`gpu_train.spec.settings_checks`, whose `parse`
runs both: disjoint networks, pools against the GPU catalog, quotas, the job against its pool and team). The
checks import these models, never the other way round. Checks that only make sense on one cloud
(regions, zone names, IAM principals, GKE groups, address plans) belong to that cloud's layer
(infra/aws/settings_checks.py, infra/gcp/settings_checks.py) and run before it creates anything.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from gpu_train.spec.errors import Int, SettingsError, SpecModel, validation_problems
from gpu_train.spec.job import JobSpec
from gpu_train.spec.naming import PROJECT
from gpu_train.spec.serving import ServiceSpec
from gpu_train.spec.values import ValueTextError, parse_bool, parse_float, parse_int

# Namespaces of the stack file that belong to Pulumi and to the providers the program configures.
OTHER_NAMESPACES = ("pulumi", "aws", "gcp", "kubernetes", "docker-build")

Cloud = Literal["aws", "gcp"]
Environment = Literal["dev", "staging", "prod"]
Capacity = Literal["spot", "on-demand", "reservation", "capacity-block"]
# An NVIDIA XID error code.
Xid = Annotated[Int, Field(ge=1, le=999)]
# GPUs of nominal quota.
Gpus = Annotated[Int, Field(ge=0)]


class Settings(SpecModel):
    """Base of every settings model (SpecModel: frozen, camelCase keys, unknown keys refused, strict types)."""


class NetworkSettings(Settings):
    vpc_cidr: str = Field("10.0.0.0/16", description="node network (AWS VPC / GCP primary subnet range)")
    pod_cidr: str = Field("100.64.0.0/16", description="pods: AWS secondary VPC CIDR (custom networking) / GCP "
                                                       "secondary range")
    service_cidr: str = Field("172.20.0.0/16", description="Kubernetes services")
    nat: Literal["single", "per-zone"] = Field("per-zone", description="NAT gateways: one in dev saves money, "
                                                                       "one per AZ in prod")
    flow_logs: bool = Field(True, description="VPC flow logs (AWS: KMS-encrypted log group; GCP: subnet flow "
                                              "logs)")


class ClusterSettings(Settings):
    kubernetes_version: str = Field("1.33", description="control-plane minor version")
    endpoint_public_access: bool = Field(False, description="public API endpoint; when on, limited to "
                                                            "publicAccessCidrs")
    public_access_cidrs: tuple[str, ...] = Field((), description="CIDRs allowed to reach a public endpoint")
    system_node_type: str = Field("", description="small on-demand pool for controllers (\"\" = cloud default)")
    system_nodes_min: Int = Field(2, ge=1, description="system nodes always running")
    system_nodes_max: Int = Field(4, ge=1, description="system nodes the group may grow to (>= systemNodesMin)")
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = Field("REGULAR", description="GKE only")
    regional: bool = Field(True, description="GKE only: regional control plane (else zonal, in zones[0])")
    master_cidr: str = Field("172.16.0.0/28", description="GKE only: private control-plane range")


class GpuPoolSettings(Settings):
    name: str = Field(description="DNS label, unique per stack; becomes the node label gpu-train.io/pool")
    instance_type: str = Field(description="EC2 instance type or GCE machine type (the catalogs in "
                                                    "gpu_train/spec/catalog/)")
    capacity: Capacity = Field(description="capacity-block is AWS only")
    min_nodes: Int = Field(0, ge=0, description="nodes always running (0 in dev and staging: scale to zero)")
    max_nodes: Int = Field(ge=1, description="nodes the pool may scale to (>= minNodes)")
    fabric: bool = Field(False, description="EFA (AWS) or GPUDirect TCPX/TCPXO/RDMA (GCP), with compact "
                                            "placement")
    zone: str = Field("", description="required for fabric pools: compact placement lives in exactly one zone")
    reservation_id: str = Field("", description="required for reservation / capacity-block capacity")
    placement_group: bool = Field(True, description="AWS: cluster placement group for fabric pools")
    gpu_driver_version: Literal["DEFAULT", "LATEST"] = Field("LATEST", description="GKE pinned driver channel")
    labels: dict[str, str] = Field(default_factory=dict, description="extra node labels")


class CacheSettings(Settings):
    enabled: bool = Field(True, description="Alluxio on the GPU nodes' NVMe in front of the datasets bucket")
    page_store_gb: Int = Field(500, ge=1, description="per-worker page store quota on the NVMe path")
    masters: Int = Field(1, ge=1, description="1 in dev, 3 (embedded journal quorum) in prod")
    journal_gb: Int = Field(20, ge=1, description="per-master persistent journal (encrypted volume)")


class MonitoringSettings(Settings):
    retention: str = Field("15d", description="Prometheus TSDB retention")
    storage_gb: Int = Field(50, ge=1, description="Prometheus volume (encrypted StorageClass)")
    grafana_storage_gb: Int = Field(10, ge=1, description="Grafana volume (encrypted StorageClass)")
    grafana_exposed: bool = Field(False, description="internal load balancer for Grafana; otherwise "
                                                     "port-forward only")
    checkpoint_max_age_minutes: Int = Field(90, ge=1, description="alert when the newest checkpoint is older than this")
    low_utilization_percent: Int = Field(20, ge=1, le=100, description="alert when mean GPU utilization stays below this for "
                                                         "30 min")


class HealthSettings(Settings):
    enabled: bool = Field(True, description="node-problem-detector and node-readiness-controller (namespace "
                                            "`node-health`), the quarantine and pre-flight rules, and the "
                                            "gpu-preflight DaemonSet (namespace `gpu-system`)")
    remediation: bool = Field(True, description="quarantine a faulty GPU node: taint "
                                                "`readiness.k8s.io/gpu-train-gpu-fault:NoExecute`, so its pods leave "
                                                "with their grace period and the cloud replaces the empty node; "
                                                "`false` runs the rule in dry-run (faults are still detected and "
                                                "alerted on)")
    preflight: bool = Field(True, description="a new GPU node keeps one "
                                              "`readiness.k8s.io/gpu-train-preflight-<check>:NoSchedule` taint per "
                                              "check until that check passed (GPU count, ECC state, DCGM "
                                              "diagnostics, fabric devices)")
    node_repair: bool = Field(True, description="the clouds' node repair: Karpenter's `nodeRepair` feature gate and "
                                                "the EKS system node group's node repair (AWS), node auto-repair of "
                                                "every node pool (GKE)")
    xid_codes: tuple[Xid, ...] = Field((48, 63, 64, 74, 79, 94, 95),
                                       description="NVIDIA XID errors that quarantine a node: double-bit ECC (48), "
                                                   "row remapping event and failure (63, 64), NVLink (74), GPU "
                                                   "fallen off the bus (79), contained and uncontained ECC (94, 95)")
    max_concurrent_repairs: Int = Field(1, ge=1, description="how many nodes may be repaired at once: the Karpenter "
                                                       "NodePools' disruption budget (emptied or drifted nodes removed "
                                                       "at once), the EKS system node group's "
                                                       "`maxParallelNodesRepairedCount`, and the threshold of the "
                                                       "`GpuQuarantineStorm` alert")
    dcgm_diag_level: Int = Field(1, ge=1, le=2, description="`dcgmi diag -r` level of the pre-flight check: 1 "
                                                            "(seconds) or 2 (a few minutes)")


class TeamMemberSettings(Settings):
    principal: str = Field(description="the ARN of an IAM role or user (`arn:aws:iam::<account>:role/<name>`, a "
                                       "path allowed)")
    role: Literal["submitter", "viewer"] = Field("submitter", description="which of the team's group lists the "
                                                                          "principal's access entry carries")


class PrepareQuotaSettings(Settings):
    cpus: Int = Field(8, ge=0, le=1024, description="CPUs the team's data preparation (`gpu-train prepare "
                                                    "--cluster`) may hold on the system nodes at once: its "
                                                    "nominal quota in Kueue's `cpu` flavor")
    memory_gi: Int = Field(32, ge=0, le=8192, description="GiB of memory that comes with it (0 only with `cpus: "
                                                          "0`)")


class TeamSettings(Settings):
    name: str = Field(description="DNS label; namespace team-<name>")
    gpu_quota: Gpus | dict[str, Gpus] = Field(description="nominal GPUs in the team's ClusterQueue per pool, "
                                                        "`{pool: GPUs}` (pools left out: 0), or one number for "
                                                        "every pool; never more than a pool holds (maxNodes x "
                                                        "GPUs)")
    submitters: tuple[str, ...] = Field((), description="Kubernetes groups allowed to submit jobs (GKE: Google "
                                                        "group e-mail addresses); the team's RoleBindings name "
                                                        "exactly these")
    viewers: tuple[str, ...] = Field((), description="groups allowed to read jobs, their status and logs")
    members: tuple[TeamMemberSettings, ...] = Field((), description="AWS: IAM principals given EKS access entries "
                                                                    "that carry these groups (below)")
    prepare_quota: PrepareQuotaSettings = Field(default_factory=PrepareQuotaSettings,
                                                description="the team's quota for data preparation on the CPU "
                                                            "(system) nodes, where its Ray pods run; borrowing "
                                                            "what other teams leave idle ([data.md](data.md))")


class LogsSettings(Settings):
    retention_days: Int | None = Field(None, ge=1, description="AWS: days the team namespaces' container logs stay in "
                                                         "CloudWatch Logs (unset: 30); GKE keeps them in Cloud "
                                                         "Logging, whose retention is the project's `_Default` "
                                                         "log bucket setting")


class ImageSettings(Settings):
    prebuilt: str = Field("", description="digest-pinned image (repo@sha256:...) to use instead of building one")
    allowed_registries: tuple[str, ...] = Field((), description="registries besides the platform's own whose "
                                                               "digest-pinned images jobs may run (team jobs and "
                                                               "the stack's `job.image`), as image prefixes ending "
                                                               "in `/`, like `ghcr.io/acme/`; the team namespaces' "
                                                               "admission policies admit them too")


class MlflowSettings(Settings):
    enabled: bool = True
    database: Literal["in-cluster", "managed"] = Field("in-cluster", description="PostgreSQL in the cluster or "
                                                                                 "the cloud's managed one")
    storage_gb: Int = Field(20, ge=1, description="GB of the tracking database's storage (in the cluster or managed)")
    register_name: str = Field("", description="model registry name for the job's final model (\"\" = job name)")


class ServingSettings(Settings):
    enabled: bool = Field(False, description="model serving: cert-manager, KServe in standard mode (no Knative), "
                                             "the serving runtimes, each team's model-server identity, and the "
                                             "routes' metrics, dashboard and alerts ([serving.md](serving.md))")
    gpu_pools: tuple[str, ...] = Field((), description="GPU pools services may run on; no team may have GPU quota "
                                                       "there, since Kueue does not see serving pods")
    scrape_interval_seconds: Int = Field(15, ge=1, le=300, description="how often Prometheus scrapes the routes "
                                                                       "(part of every canary's reaction bound)")
    latency_alert_ms: Int = Field(500, ge=1, description="ServingLatencyHigh fires when a version's p99 latency "
                                                         "stays above this")
    error_rate_alert: float = Field(0.01, ge=0, le=1, description="ServingErrorRateHigh fires when a version's "
                                                                  "share of 5xx answers stays above this")
    services: tuple[ServiceSpec, ...] = Field((), description="services the stack deploys itself, each pinned to "
                                                              "a version (teams deploy theirs with "
                                                              "`gpu-train serve`)")


class DeployRunnerSettings(Settings):
    kind: Literal["none", "codebuild"] = Field("none", description="codebuild: a GitHub Actions runner in the VPC "
                                                                   "(AWS only)")
    repository: str = Field("", description="GitHub <owner>/<name> whose workflow jobs run on it")
    connection_arn: str = Field("", description="AWS CodeConnections connection to GitHub "
                                                "(arn:aws:codeconnections:...)")


class CarbonSettings(Settings):
    allowed_regions: tuple[str, ...] = Field((), description="where this stack's work may run, for the plan's carbon "
                                                             "advisory: country codes, groups (EU, EEA) and region "
                                                             "names; empty = the region's own "
                                                             "country, or the EU for an EU region "
                                                             "([carbon.md](carbon.md))")


class LimitsSettings(Settings):
    max_gpus: Int = Field(64, ge=1, description="cap on the sum of maxNodes x GPUs over all pools (also a policy)")


class StackSettings(Settings):
    """Everything under `gpu-train:` in one stack file."""

    cloud: Cloud = Field(description="which cloud layer builds the platform")
    environment: Environment = Field(description="prod turns on HA defaults; dev/staging require scale-to-zero "
                                                 "GPU pools")
    region: str = Field(description="AWS region or GCP region")
    zones: tuple[str, ...] = Field(description="zones the network spans (3 recommended)")
    stack: str = Field("", exclude=True, description="the Pulumi stack name (not a setting; filled in by the "
                                                     "loader)")
    deploy: bool = Field(False, description="deployed by the workflows: placeholder values (example CIDRs, "
                                            "domains, ids) are refused")
    project: str = Field("", description="GCP project id (GCP only)")
    tags: dict[str, str] = Field(default_factory=dict, description="extra tags / labels on every resource")
    network: NetworkSettings = Field(default_factory=NetworkSettings, description="address plan and NAT")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings, description="control plane and system "
                                                                                  "nodes")
    gpu_pools: tuple[GpuPoolSettings, ...] = Field((), description="at least one GPU node pool")
    cache: CacheSettings = Field(default_factory=CacheSettings, description="Alluxio NVMe cache")
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings, description="Prometheus, "
                                                                                           "Grafana, alerts")
    health: HealthSettings = Field(default_factory=HealthSettings, description="GPU node health, pre-flight, "
                                                                               "quarantine and repair ([operations.md](operations.md))")
    teams: tuple[TeamSettings, ...] = Field((), description="tenants: namespace, queue and GPU quota each")
    job: JobSpec | None = Field(None, description="the stack's training job (none: the platform only; teams "
                                                  "submit theirs with `gpu-train submit`, [teams.md](teams.md))")
    logs: LogsSettings = Field(default_factory=LogsSettings, description="container logs that outlive their "
                                                                         "pods")
    image: ImageSettings = Field(default_factory=ImageSettings, description="trainer image source")
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings, description="tracking server and registry")
    limits: LimitsSettings = Field(default_factory=LimitsSettings, description="guard rails checked here and by "
                                                                               "policy")
    serving: ServingSettings = Field(default_factory=ServingSettings, description="serving registered models "
                                                                                  "(off by default)")
    carbon: CarbonSettings = Field(default_factory=CarbonSettings, description="the plan's carbon estimate and "
                                                                               "region advisory")
    deploy_runner: DeployRunnerSettings = Field(default_factory=DeployRunnerSettings,
                                                description="how the workflows reach the private EKS endpoint "
                                                            "(docs/aws.md, docs/ci.md)")

    @property
    def is_prod(self) -> bool:
        return self.environment == "prod"

    def pool(self, name: str) -> GpuPoolSettings:
        return next(p for p in self.gpu_pools if p.name == name)

    def team(self, name: str) -> TeamSettings:
        return next(t for t in self.teams if t.name == name)

    def pool_capacity(self, pool: GpuPoolSettings) -> int:
        """GPUs the pool can ever hold: maxNodes x GPUs per node (0 for a type not in the catalog)."""
        from gpu_train.spec import catalog

        shape = catalog.shape(self.cloud, pool.instance_type)
        return pool.max_nodes * shape.gpus if shape is not None else 0

    def team_quota(self, team: TeamSettings) -> dict[str, int]:
        """The team's nominal GPU quota on every pool, by pool name."""
        return pool_quotas(team.gpu_quota, [p.name for p in self.gpu_pools])


def pool_quotas(gpu_quota: int | Mapping[str, int], pools: Iterable[str]) -> dict[str, int]:
    """A team's `gpuQuota` setting as nominal GPUs per pool: the mapping's entry (0 when absent), or the one number
    on every pool. Both forms are checked against each pool's capacity the same way (settings_checks)."""
    if isinstance(gpu_quota, Mapping):
        return {name: int(gpu_quota.get(name, 0)) for name in pools}
    return dict.fromkeys(pools, int(gpu_quota))


def _engine_value(key: str, value: Any) -> Any:
    """A value as the Pulumi engine hands it over: structured values as JSON text, top-level booleans as text."""
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise SettingsError([f"{key} is not valid JSON: {exc}"]) from None
    field = StackSettings.model_fields.get(_snake(key[len(PROJECT) + 1:]))
    parse = _TEXT_PARSERS.get(field.annotation) if field is not None else None
    if isinstance(value, str) and parse is not None:
        try:
            return parse(value)
        except ValueTextError:
            return value  # the model's own check names the setting and the type it expects
    return value


# Top-level scalars arrive from the engine as text; they are read by the same rules as every other value text.
_TEXT_PARSERS = {bool: parse_bool, int: parse_int, float: parse_float}


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)


def namespace_problems(raw: Mapping[str, Any]) -> list[str]:
    """Keys of a stack file that belong to no one: no namespace (`job:`), or a namespace that is neither this
    project's nor one of the providers the program configures (`gpu_train:job`); Pulumi would pass them by."""
    problems = []
    for key in raw:
        namespace, _, name = str(key).rpartition(":")
        if namespace in (PROJECT, *OTHER_NAMESPACES):
            continue
        close = difflib.get_close_matches(namespace or name, [PROJECT], n=1, cutoff=0.6)
        where = f"{PROJECT}:{name}" if close or not namespace else None
        hint = f" (did you mean {where!r}?)" if where else f" (namespaces: {', '.join((PROJECT, *OTHER_NAMESPACES))})"
        what = "has no namespace" if not namespace else f"is in namespace {namespace!r}, which nothing reads"
        problems.append(f"{key} {what}{hint}")
    return problems


def read(raw: Mapping[str, Any]) -> StackSettings:
    """The `gpu-train:` settings of one stack file, types and ranges only; keys of the providers' namespaces are
    theirs, any other key is refused."""
    stray = namespace_problems(raw)
    if stray:
        raise SettingsError(stray)
    prefix = f"{PROJECT}:"
    values = {key[len(prefix):]: _engine_value(key, value) for key, value in raw.items() if key.startswith(prefix)}
    try:
        # Through JSON, so that strict mode reads YAML lists as tuples and mappings as models.
        return StackSettings.model_validate_json(json.dumps(values))
    except ValidationError as exc:
        raise SettingsError(validation_problems(exc, prefix=prefix, root=StackSettings, raw=values)) from None
