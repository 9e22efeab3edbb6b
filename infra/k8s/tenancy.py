"""Scheduling and tenancy: Kueue and JobSet, one ResourceFlavor per GPU pool and one for the CPU (system) nodes, one
ClusterQueue per team (nominal GPU quota per pool and CPU quota for data preparation from the settings, borrowing
inside one cohort), the WorkloadPriorityClasses
of production jobs and sweep trials, and per team a
namespace with a LocalQueue, ResourceQuota, LimitRange, RBAC for its groups, the `trainer`
ServiceAccount bound to the team's cloud identity, and default-deny NetworkPolicies with only the
needed holes.

Usage: `Tenancy("tenancy", TenancyArgs(platform=..., teams=cfg.teams, ...))`; `tenancy.local_queue`
maps team -> LocalQueue name. The Kueue queue objects come from gpu_train/jobs/queues.py, against which every
job is checked (gpu_train/jobs/check.py: the stack's job at plan time, a team's at `gpu-train submit`, through
the platform contract that carries them); Kueue's configuration and every other manifest here are pure
functions.
The team roles also grant what `gpu-train list / status / logs` read: the published contract's ConfigMap (by
name), Kueue's visibility API (queue positions) and the pod proxy (the trainer's metrics, which the
team NetworkPolicies let the control plane reach).

Kueue 0.19.2 stores kueue.x-k8s.io/v1beta2 and reads a config.kueue.x-k8s.io/v1beta2 Configuration
(strictly: unknown fields stop the controller). Field names follow apis/kueue/v1beta2 and
apis/config/v1beta2 at that tag (github.com/kubernetes-sigs/kueue): a ClusterQueue names its cohort
in `cohortName`, and waitForPodsReady has no `enable` switch (the section's presence turns it on).

Over 400 lines because the queues, quotas, Roles and accounts of the teams are one model of tenancy: each names the
same teams, pools and namespaces, and the Roles are what the team command and the sweep controller may do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from gpu_train.jobs.queues import (
    CPU_PER_GPU,
    EXCLUDED_RESOURCE_PREFIXES,
    MEMORY_GIB_PER_GPU,
    cluster_queues,
    cpu_flavor,
    limit_range,
    local_queue,
    resource_flavor,
    team_pool_quotas,
    workload_priority_classes,
)
from gpu_train.jobs.sweep_platform import team_sweep_objects
from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from gpu_train.spec.job import PODS_READY_TIMEOUT_S
from gpu_train.spec.settings import TeamSettings
from infra.k8s import common
from infra.platform import ClusterPlatform

# https://kueue.sigs.k8s.io/docs/installation/#install-a-released-version (Helm, OCI)
KUEUE_CHART = "oci://registry.k8s.io/kueue/charts/kueue"
KUEUE_VERSION = "0.19.2"
# https://jobset.sigs.k8s.io/docs/installation/ (Helm, OCI)
JOBSET_CHART = "oci://registry.k8s.io/jobset/charts/jobset"
JOBSET_VERSION = "0.12.0"
# https://docs.ray.io/en/latest/cluster/kubernetes/getting-started/kuberay-operator-installation.html (Helm); the
# chart's sources: github.com/ray-project/kuberay, helm-chart/kuberay-operator at tag v1.7.0.
KUBERAY_REPO = "https://ray-project.github.io/kuberay-helm"
KUBERAY_CHART = "kuberay-operator"
KUBERAY_VERSION = "1.7.0"
KUBERAY_METRICS_PORT = 8080  # the operator's http port (metrics, probes)
# The Ray head's dashboard, where the operator submits a RayJob's entrypoint (submissionMode HTTPMode) and polls it
# (ray-operator/controllers/ray/utils/constant.go: DefaultDashboardPort).
RAY_DASHBOARD_PORT = 8265
KUEUE_CONFIG_API = "config.kueue.x-k8s.io/v1beta2"
# Kueue's visibility API server (pending workloads and their queue positions), served by the controller on
# this port behind the APIService v1beta2.visibility.kueue.x-k8s.io (charts/kueue/templates/visibility at
# v0.19.2; on by default since the VisibilityOnDemand feature went beta in 0.9).
KUEUE_VISIBILITY_PORT = 8082
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"


def kueue_configuration() -> dict[str, Any]:
    """Kueue's controller configuration (Configuration v1beta2): JobSet and RayJob integrations; jobs without a
    queue name in team namespaces are held instead of bypassing quota; fabric devices excluded from
    quota; all-or-nothing start within PODS_READY_TIMEOUT_S, without a recovery timeout."""
    return {
        "apiVersion": KUEUE_CONFIG_API,
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"},
        "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        "controller": {"groupKindConcurrency": {"Job.batch": 5, "Pod": 5, "Workload.kueue.x-k8s.io": 5,
                                                "LocalQueue.kueue.x-k8s.io": 1,
                                                "ClusterQueue.kueue.x-k8s.io": 1,
                                                "ResourceFlavor.kueue.x-k8s.io": 1}},
        "manageJobsWithoutQueueName": True,
        "managedJobsNamespaceSelector": {"matchLabels": {naming.KUEUE_MANAGED_LABEL: "true"}},
        # All MAX pods must be ready within the timeout after admission, or the job is evicted and
        # requeued (at most backoffLimitCount times, then deactivated). recoveryTimeout 0s turns off
        # the same rule for a running job that lost a pod (pkg/controller/core/core.go applies it only
        # when > 0): the job keeps training on the nodes it has while the lost pod waits for a node.
        "waitForPodsReady": {"timeout": f"{PODS_READY_TIMEOUT_S}s", "recoveryTimeout": "0s",
                             "blockAdmission": False,
                             "requeuingStrategy": {"timestamp": "Eviction", "backoffLimitCount": 5,
                                                   "backoffBaseSeconds": 60, "backoffMaxSeconds": 3600}},
        # ray.io/rayjob: `gpu-train prepare --cluster` (gpu_train/jobs/prepare.py). When its CRD is installed after
        # Kueue starts, Kueue sets up the webhook at once and the controller once the API appears
        # (pkg/controller/jobframework/setup.go at v0.19.2: WaitForAPI, polling with backoff up to 2 minutes).
        "integrations": {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset", "ray.io/rayjob"]},
        "resources": {"excludeResourcePrefixes": list(EXCLUDED_RESOURCE_PREFIXES)},
    }


def kueue_manager_config() -> str:
    """kueue_configuration() as the chart's managerConfig.controllerManagerConfigYaml."""
    return yaml.safe_dump(kueue_configuration(), sort_keys=False)


def kueue_values(system_selector: dict[str, str]) -> dict[str, Any]:
    return {
        "controllerManager": {
            "replicas": 1,
            "nodeSelector": system_selector,
            "manager": {"resources": common.resources("500m", "512Mi", "2", "1Gi")},
        },
        "managerConfig": {"controllerManagerConfigYaml": kueue_manager_config()},
    }


def jobset_values(system_selector: dict[str, str]) -> dict[str, Any]:
    return {
        "controller": {
            "nodeSelector": system_selector,
            "resources": common.resources("250m", "256Mi", "1", "512Mi"),
        },
    }


def kuberay_values(system_selector: dict[str, str], team_namespaces: Sequence[str]) -> dict[str, Any]:
    """The KubeRay operator on the system nodes, watching only the team namespaces, with a Role in each (no
    ClusterRole); no leader election needed for one replica but kept on, as upstream ships it."""
    return {
        "nodeSelector": system_selector,
        "resources": common.resources("100m", "512Mi", "1", "512Mi"),
        "singleNamespaceInstall": True,
        "crNamespacedRbacEnable": True,
        "watchNamespace": list(team_namespaces),
    }


def ray_team_policies() -> list[common.Policy]:
    """A team namespace's holes for Ray: all TCP between the pods of its Ray clusters (GCS, raylets, object
    transfer: ports Ray picks at start), and the KubeRay operator to a head's dashboard."""
    ray_pods = {"matchExpressions": [{"key": naming.RAY_NODE_LABEL, "operator": "Exists"}]}
    operator = {"namespaceSelector": {"matchLabels": {common.NS_NAME_LABEL: naming.KUBERAY_NAMESPACE}}}
    return [
        ("allow-ray-peers", {
            "podSelector": ray_pods,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": ray_pods}], "ports": [{"protocol": "TCP"}]}],
            "egress": [{"to": [{"podSelector": ray_pods}], "ports": [{"protocol": "TCP"}]}],
        }),
        ("allow-ray-dashboard-from-operator", {
            "podSelector": {"matchLabels": {"ray.io/node-type": "head"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [operator], "ports": [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}]}],
        }),
    ]


def kuberay_network_policies(platform: ClusterPlatform, team_namespaces: Sequence[str]) -> list[common.Policy]:
    """The KubeRay operator: DNS, the API server, Ray heads' dashboards in the team namespaces, metrics."""
    heads = [{"namespaceSelector": {"matchLabels": {common.NS_NAME_LABEL: ns}},
              "podSelector": {"matchLabels": {"ray.io/node-type": "head"}}} for ns in team_namespaces]
    return [
        common.default_deny(),
        common.allow_dns(),
        common.allow_api_server(platform.api_server_cidrs),
        ("allow-ray-dashboards", {"podSelector": {}, "policyTypes": ["Egress"],
                                  "egress": [{"to": heads,
                                              "ports": [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}]}]}),
        common.allow_metrics_scrape([KUBERAY_METRICS_PORT]),
    ]


def team_identity(p: ClusterPlatform, key: str, ns: str, account: str, *, required: bool = False):
    """The cloud identity the platform gives `key` (`<role>/<team>`), checked to be bound to the ServiceAccount
    `account` in the team's namespace `ns`; None where the platform gives none and it is not `required`."""
    identity = p.identities.get(key)
    if identity is None:
        if required:
            raise ValueError(f"platform.identities has no {key!r} entry for team {key.split('/', 1)[1]!r}")
        return None
    if identity.name != account or ns not in identity.namespaces:
        raise ValueError(f"platform.identities[{key!r}] is bound to {list(identity.namespaces)}/"
                         f"{identity.name}, not {ns}/{account}")
    return identity


class TopLevelCustomResource(pulumi.CustomResource):
    """A custom resource whose fields sit beside `metadata` rather than under `spec` (Kueue's
    WorkloadPriorityClass has `value` and `description`), which k8s.apiextensions.CustomResource cannot carry.
    The same registration it makes: type `kubernetes:<apiVersion>:<kind>`, the object's fields as inputs."""

    def __init__(self, name: str, obj: dict[str, Any], opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"kubernetes:{obj['apiVersion']}:{obj['kind']}", name, dict(obj), opts)


def team_quota(team: TeamSettings, teams: Sequence[TeamSettings], pools: Sequence[GpuPool]) -> dict[str, str]:
    """ResourceQuota hard limits for a team namespace: the most its ClusterQueue can ever admit, its
    nominal GPUs plus what it may borrow on every pool and its CPU flavor (Kueue is the real arbiter; this is the
    backstop for pods that bypass it), and no Services that open the namespace to the network."""
    # On each pool a team may use its nominal GPUs plus every other team's (borrowingLimit): together,
    # every team's nominal GPUs on every pool. The team itself is one of `teams`.
    gpus = sum(q for t in teams for q in team_pool_quotas(t, pools).values())
    gpus = max(gpus, sum(team_pool_quotas(team, pools).values()))
    # Likewise on the CPU flavor (data preparation): every team's prepareQuota.
    prep_cpus = sum(t.prepare_quota.cpus for t in teams)
    prep_gib = sum(t.prepare_quota.memory_gi for t in teams)
    return {
        f"requests.{naming.GPU_RESOURCE}": str(gpus),
        "requests.cpu": str(gpus * CPU_PER_GPU + prep_cpus + 16),
        "requests.memory": f"{gpus * MEMORY_GIB_PER_GPU + prep_gib + 64}Gi",
        "limits.memory": f"{gpus * MEMORY_GIB_PER_GPU + prep_gib + 64}Gi",
        "pods": str(max(50, gpus * 4)),
        "persistentvolumeclaims": "20",
        "services.loadbalancers": "0",
        "services.nodeports": "0",
    }


def _team_read_rules() -> list[dict[str, Any]]:
    """What every team member may read, as `gpu-train list / status / logs` does: the platform contract
    (by name), queue positions from Kueue's visibility API, and the trainer's metrics through the API
    server's pod proxy (GET only; the trainer serves nothing else)."""
    return [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [naming.PLATFORM_CONFIGMAP], "verbs": ["get"]},
        {"apiGroups": [VISIBILITY_GROUP], "resources": ["localqueues/pendingworkloads"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods/proxy"], "verbs": ["get"]},
    ]


def submitter_rules() -> list[dict[str, Any]]:
    write = ["create", "get", "list", "watch", "delete", "patch", "update"]
    read = ["get", "list", "watch"]
    return [
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": write},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": write},
        # `gpu-train prepare --cluster` (gpu_train/jobs/prepare.py); KubeRay makes the RayClusters.
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": write},
        {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": read},
        {"apiGroups": [""], "resources": ["pods", "pods/log", "events", "services"], "verbs": read},
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": read},
        # patch: pause and resume a submitted job through its Workload's spec.active.
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": [*read, "patch"]},
        # `gpu-train sweep submit` and `sweep stop --cluster`: a sweep's controller (gpu_train/jobs/sweep_platform.py).
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": write},
        *_team_read_rules(),
    ]


def serving_submitter_rules() -> list[dict[str, Any]]:
    """What `gpu-train serve` does besides, where the stack serves models: a service's InferenceServices, its route
    (ConfigMap, Deployment, Service), its predictors through the service proxy (a quality check run in the
    terminal), and its Events."""
    write = ["create", "get", "list", "watch", "delete", "patch", "update"]
    return [
        {"apiGroups": ["serving.kserve.io"], "resources": ["inferenceservices"], "verbs": write},
        {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": write},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": write},
        {"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["create", "get"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    ]


def serving_viewer_rules() -> list[dict[str, Any]]:
    """What `gpu-train serve status` reads: InferenceServices and the routes' ConfigMaps."""
    read = ["get", "list", "watch"]
    return [{"apiGroups": ["serving.kserve.io"], "resources": ["inferenceservices"], "verbs": read},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": read}]


def viewer_rules() -> list[dict[str, Any]]:
    read = ["get", "list", "watch"]
    return [
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": read},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": read},
        {"apiGroups": ["ray.io"], "resources": ["rayjobs", "rayclusters"], "verbs": read},
        {"apiGroups": [""], "resources": ["pods", "pods/log", "events"], "verbs": read},
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads", "localqueues"], "verbs": read},
        *_team_read_rules(),
    ]


# Pod Security level enforced in team namespaces. Training pods mount the node's NVMe through a
# hostPath (the shard cache and local checkpoints must outlive a pod restart on the same node), which
# every level but "privileged" forbids, and GPUDirect-TCPX/TCPXO pods run a privileged
# receive-datapath sidecar. Warn and audit stay "restricted"; the policy pack holds training containers
# to its pod rules (policies/pods.py), and so do the team namespaces' ValidatingAdmissionPolicies for
# whatever a member applies (infra/k8s/pod_admission.py), with exactly the sidecar exemption.
TEAM_POD_SECURITY = "privileged"


def metrics_ports(platform: ClusterPlatform) -> dict[str, int]:
    """The trainer's metrics ports as a NetworkPolicy port: one per local rank of the largest node."""
    most = max(p.gpus_per_node for p in platform.gpu_pools)
    port = {"protocol": "TCP", "port": naming.METRICS_PORT}
    return {**port, "endPort": naming.METRICS_PORT + most - 1} if most > 1 else port


def metrics_from_api_server(platform: ClusterPlatform) -> dict[str, Any]:
    """An ingress rule from the control plane to the trainer's metrics ports: `gpu-train status` reads rank
    0's step, loss and throughput through the API server's pod proxy."""
    if not platform.api_server_cidrs:
        raise ValueError("platform.api_server_cidrs is empty: the pod proxy's NetworkPolicy needs its addresses")
    return {"from": [{"ipBlock": {"cidr": c}} for c in platform.api_server_cidrs], "ports": [metrics_ports(platform)]}


def team_network_policies(platform: ClusterPlatform, cache_enabled: bool) -> list[common.Policy]:
    # Who may read the trainer's metrics ports: Prometheus in the monitoring namespace, and the control plane
    # (the pod proxy `gpu-train status` reads through).
    scrape_name, scrape = common.allow_metrics_scrape(
        [naming.METRICS_PORT], end_port=naming.METRICS_PORT + max(p.gpus_per_node for p in platform.gpu_pools) - 1
        if max(p.gpus_per_node for p in platform.gpu_pools) > 1 else None)
    scrape = {**scrape, "ingress": [*scrape["ingress"], metrics_from_api_server(platform)]}
    policies = [
        common.default_deny(),
        common.allow_dns(),
        common.allow_object_store(platform.object_store_cidrs, platform.workload_identity_egress),
        common.allow_jobset_peers(),
        common.allow_mlflow(),
        (scrape_name, scrape),
        *ray_team_policies(),
    ]
    if cache_enabled:
        policies.append(common.allow_to_cache())
    return policies


def controller_network_policies(platform: ClusterPlatform, webhook_port: int, metrics_port: int,
                                api_ports: tuple[int, ...] = ()) -> list[common.Policy]:
    """Kueue / JobSet controllers: DNS, API server, webhooks (and Kueue's visibility API server,
    `api_ports`) from the control plane, metrics."""
    return [
        common.default_deny(),
        common.allow_dns(),
        common.allow_api_server(platform.api_server_cidrs),
        common.allow_webhooks_from_api_server(platform.api_server_cidrs, [webhook_port, *api_ports]),
        common.allow_metrics_scrape([metrics_port]),
    ]


@dataclass(frozen=True, kw_only=True)
class TenancyArgs:
    platform: ClusterPlatform  # pools, identities, provider, CIDRs
    teams: tuple[TeamSettings, ...]  # cfg.teams
    cache_enabled: bool  # open egress to the cache proxy from team namespaces
    depends_on: tuple[pulumi.Resource, ...] = ()
    serving: bool = False  # cfg.serving.enabled: the team roles may also serve models (gpu-train serve)


class Tenancy(pulumi.ComponentResource):
    """Kueue + JobSet and everything a team needs to submit jobs."""

    def __init__(self, name: str, args: TenancyArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:Tenancy", name, None, opts)
        p = args.platform
        if not args.teams:
            raise ValueError("gpu-train:teams must list at least one team")
        base = [*p.ready, *args.depends_on]
        self._controllers(name, p, base)
        self._queues(name, p, args.teams)
        self.team_namespaces: dict[str, k8s.core.v1.Namespace] = {}
        self.local_queue: dict[str, str] = {}
        self.service_accounts: dict[str, k8s.core.v1.ServiceAccount] = {}
        for team in args.teams:
            self._team(name, p, team, args, base)
        self._kuberay(name, p, base)
        self.register_outputs({"local_queue": self.local_queue,
                               "team_namespaces": {t: naming.team_namespace(t) for t in self.team_namespaces}})

    def _controllers(self, name: str, p: ClusterPlatform, base: list[pulumi.Resource]) -> None:
        """Kueue and JobSet, each in its own restricted, fenced namespace on the system nodes."""
        system = dict(p.system_node_selector)
        self.controller_namespaces = {}
        self.releases = {}
        for ns_name, chart, version, values, webhook, metrics, api_ports in (
            (common.KUEUE_NAMESPACE, KUEUE_CHART, KUEUE_VERSION, kueue_values(system), 9443, 8443,
             (KUEUE_VISIBILITY_PORT,)),
            (common.JOBSET_NAMESPACE, JOBSET_CHART, JOBSET_VERSION, jobset_values(system), 9443, 8443, ()),
        ):
            short = ns_name.removesuffix("-system")
            ns = common.namespace(ns_name, p, self, enforce="restricted", depends_on=base)
            common.network_policies(ns_name, controller_network_policies(p, webhook, metrics, api_ports), p, self,
                                    [ns])
            self.controller_namespaces[short] = ns
            # OCI charts: the registry is part of `chart`, so there is no repository_opts.
            self.releases[short] = k8s.helm.v3.Release(
                f"{name}-{short}", name=short, chart=chart, version=version, namespace=ns_name, values=values,
                opts=common.k8s_opts(p, self, [ns]))

    def _kuberay(self, name: str, p: ClusterPlatform, base: list[pulumi.Resource]) -> None:
        """The KubeRay operator (RayJob, RayCluster) in its restricted, fenced namespace on the system nodes: it makes
        the Ray clusters of `gpu-train prepare --cluster` once Kueue admits their RayJobs."""
        ns_name, team_namespaces = naming.KUBERAY_NAMESPACE, [naming.team_namespace(t) for t in self.team_namespaces]
        ns = common.namespace(ns_name, p, self, enforce="restricted", depends_on=base)
        common.network_policies(ns_name, kuberay_network_policies(p, team_namespaces), p, self, [ns])
        self.controller_namespaces["kuberay"] = ns
        self.releases["kuberay"] = k8s.helm.v3.Release(
            f"{name}-kuberay", name="kuberay-operator", chart=KUBERAY_CHART, version=KUBERAY_VERSION,
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=KUBERAY_REPO), namespace=ns_name,
            values=kuberay_values(dict(p.system_node_selector), team_namespaces),
            # Its Roles go into the team namespaces.
            opts=common.k8s_opts(p, self, [ns, *self.team_namespaces.values()]))

    def _queues(self, name: str, p: ClusterPlatform, teams: Sequence[TeamSettings]) -> None:
        """A ResourceFlavor for the CPU (system) nodes and one per pool, a ClusterQueue per team in one cohort, and
        the workload priority classes."""
        kueue = [self.releases["kueue"]]
        self.flavors = [
            k8s.apiextensions.CustomResource(
                f"{name}-flavor-{obj['metadata']['name']}", api_version=obj["apiVersion"], kind=obj["kind"],
                metadata=obj["metadata"], spec=obj["spec"], opts=common.k8s_opts(p, self, kueue))
            for obj in [cpu_flavor(dict(p.system_node_selector)), *(resource_flavor(pool) for pool in p.gpu_pools)]
        ]
        self.cluster_queues = [
            k8s.apiextensions.CustomResource(
                f"{name}-clusterqueue-{obj['metadata']['name']}", api_version=obj["apiVersion"], kind=obj["kind"],
                metadata=obj["metadata"], spec=obj["spec"], opts=common.k8s_opts(p, self, [*kueue, *self.flavors]))
            for obj in cluster_queues(teams, list(p.gpu_pools))
        ]
        # Production jobs and sweep trials: the class a JobSet's kueue.x-k8s.io/priority-class label names.
        self.priority_classes = [
            TopLevelCustomResource(f"{name}-priority-{obj['metadata']['name']}", obj,
                                   opts=common.k8s_opts(p, self, kueue))
            for obj in workload_priority_classes()
        ]

    def _team(self, name: str, p: ClusterPlatform, team: TeamSettings, args: TenancyArgs,
              base: list[pulumi.Resource]) -> None:
        """A team's namespace: its fence, quota, defaults, Roles, trainer account, sweep controller and LocalQueue."""
        ns_name = naming.team_namespace(team.name)
        ns = common.namespace(ns_name, p, self, enforce=TEAM_POD_SECURITY, depends_on=base,
                              labels=naming.namespace_labels(team.name))
        deps = [ns]
        self.team_namespaces[team.name] = ns
        common.network_policies(ns_name, team_network_policies(p, args.cache_enabled), p, self, deps)
        k8s.core.v1.ResourceQuota(
            f"{name}-{team.name}-quota", metadata={"name": "team-quota", "namespace": ns_name},
            spec={"hard": team_quota(team, args.teams, list(p.gpu_pools))}, opts=common.k8s_opts(p, self, deps))
        k8s.core.v1.LimitRange(
            f"{name}-{team.name}-limits", metadata={"name": "container-defaults", "namespace": ns_name},
            spec=limit_range(), opts=common.k8s_opts(p, self, deps))
        serving = args.serving
        for role, rules, groups in (
                ("job-submitter", submitter_rules() + (serving_submitter_rules() if serving else []),
                 team.submitters),
                ("viewer", viewer_rules() + (serving_viewer_rules() if serving else []), team.viewers)):
            k8s.rbac.v1.Role(f"{name}-{team.name}-{role}", metadata={"name": role, "namespace": ns_name},
                             rules=rules, opts=common.k8s_opts(p, self, deps))
            if groups:
                k8s.rbac.v1.RoleBinding(
                    f"{name}-{team.name}-{role}-binding",
                    metadata={"name": role, "namespace": ns_name},
                    role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                    subjects=[{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": g}
                              for g in groups],
                    opts=common.k8s_opts(p, self, deps))
        self._trainer_account(name, p, team.name, ns_name, deps)
        self._sweep_controllers(name, p, team.name, ns_name, deps)
        self._data_prep_account(name, p, team.name, ns_name, deps)
        lq = local_queue(team.name)
        k8s.apiextensions.CustomResource(
            f"{name}-{team.name}-localqueue", api_version=lq["apiVersion"], kind=lq["kind"],
            metadata=lq["metadata"], spec=lq["spec"], opts=common.k8s_opts(p, self, [*deps, *self.cluster_queues]))
        self.local_queue[team.name] = naming.local_queue_name(team.name)

    def _trainer_account(self, name: str, p: ClusterPlatform, team: str, ns_name: str,
                         deps: list[pulumi.Resource]) -> None:
        """The trainer's ServiceAccount, bound to the cloud identity the platform gives `trainer/<team>`."""
        identity = team_identity(p, f"trainer/{team}", ns_name, naming.TRAINER_SERVICE_ACCOUNT, required=True)
        self.service_accounts[team] = k8s.core.v1.ServiceAccount(
            f"{name}-{team}-trainer",
            metadata={"name": identity.name, "namespace": ns_name, "annotations": dict(identity.annotations)},
            automount_service_account_token=False,
            opts=common.k8s_opts(p, self, deps))

    def _sweep_controllers(self, name: str, p: ClusterPlatform, team: str, ns: str,
                           deps: list[pulumi.Resource]) -> None:
        """The account the namespace's in-cluster sweep controllers run as, and its Role, where the cloud layer gave
        it an identity (`gpu-train sweep submit`; gpu_train/jobs/sweep_platform.py)."""
        identity = team_identity(p, f"sweeps/{team}", ns, naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT)
        if identity is None:
            return
        opts = common.k8s_opts(p, self, deps)
        for obj in team_sweep_objects(ns, identity_annotations=dict(identity.annotations)):
            res, meta = f"{name}-{team}-{obj['kind'].lower()}-{obj['metadata']['name']}", obj["metadata"]
            if obj["kind"] == "ServiceAccount":
                k8s.core.v1.ServiceAccount(res, metadata=meta, opts=opts,
                                           automount_service_account_token=obj["automountServiceAccountToken"])
            elif obj["kind"] == "Role":
                k8s.rbac.v1.Role(res, metadata=meta, rules=obj["rules"], opts=opts)
            else:
                k8s.rbac.v1.RoleBinding(res, metadata=meta, role_ref=obj["roleRef"], subjects=obj["subjects"], opts=opts)

    def _data_prep_account(self, name: str, p: ClusterPlatform, team: str, ns: str,
                           deps: list[pulumi.Resource]) -> None:
        """The account a team's Ray pods run as (`gpu-train prepare --cluster`), bound to the cloud identity the
        platform gives `data-prep/<team>` (read the datasets bucket, write the team's prefix of it), where it gives
        one. No API token: Ray pods do not call the Kubernetes API."""
        identity = team_identity(p, f"data-prep/{team}", ns, naming.DATA_PREP_SERVICE_ACCOUNT)
        if identity is None:
            return
        k8s.core.v1.ServiceAccount(
            f"{name}-{team}-data-prep",
            metadata={"name": identity.name, "namespace": ns, "annotations": dict(identity.annotations)},
            automount_service_account_token=False, opts=common.k8s_opts(p, self, deps))
