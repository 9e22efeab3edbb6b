"""Kueue and JobSet in the tenancy layer (infra/k8s/tenancy.py): the v1beta2 Configuration Kueue 0.19.2 reads
strictly, the namespace ResourceQuota, the roles and the NetworkPolicies. Pure functions, no mocks. The queue
objects themselves (ClusterQueues, flavors, LimitRange) are gpu_train/jobs/queues.py's:
tests/gpu_train/jobs/test_queues.py.

Usage: .venv/bin/pytest tests/infra/k8s/test_tenancy.py -q
"""

from __future__ import annotations

import re

import pytest
import yaml

from gpu_train.jobs import fit, queues
from gpu_train.spec import job, naming
from gpu_train.spec.contract import Fabric, GpuPool
from gpu_train.spec.settings import PrepareQuotaSettings, TeamSettings
from infra.k8s import tenancy

# Field names of Kueue's Configuration at v0.19.2, from the json tags of apis/config/v1beta2
# (configuration_types.go); Kueue decodes its configuration strictly (pkg/config/config.go,
# serializer.EnableStrict), so any other key stops the controller from starting.
CONFIG_FIELDS = {
    "": {"apiVersion", "kind", "namespace", "webhook", "leaderElection", "metrics", "health", "pprofBindAddress",
         "controller", "tls", "manageJobsWithoutQueueName", "managedJobsNamespaceSelector",
         "internalCertManagement", "waitForPodsReady", "clientConnection", "integrations", "multiKueue",
         "fairSharing", "admissionFairSharing", "resources", "featureGates", "objectRetentionPolicies",
         "visibilityServer"},
    "webhook": {"port", "host", "certDir"},
    "metrics": {"bindAddress", "enableClusterQueueResources", "customLabels", "localQueueMetrics"},
    "health": {"healthProbeBindAddress", "readinessEndpointName", "livenessEndpointName"},
    "controller": {"groupKindConcurrency", "cacheSyncTimeout"},
    # k8s.io/component-base LeaderElectionConfiguration
    "leaderElection": {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock",
                       "resourceName", "resourceNamespace"},
    "waitForPodsReady": {"timeout", "blockAdmission", "requeuingStrategy", "recoveryTimeout"},
    "waitForPodsReady.requeuingStrategy": {"timestamp", "backoffLimitCount", "backoffBaseSeconds",
                                           "backoffMaxSeconds"},
    "integrations": {"frameworks", "externalFrameworks", "labelKeysToCopy"},
    "resources": {"quotaCheckStrategy", "excludeResourcePrefixes", "transformations", "deviceClassMappings"},
}
# The integration names Kueue 0.19.2 knows (same file, Integrations.Frameworks).
FRAMEWORKS = {"batch/job", "kubeflow.org/mpijob", "ray.io/rayjob", "ray.io/rayservice", "ray.io/raycluster",
              "jobset.x-k8s.io/jobset", "kubeflow.org/paddlejob", "kubeflow.org/pytorchjob", "kubeflow.org/tfjob",
              "kubeflow.org/xgboostjob", "kubeflow.org/jaxjob", "trainer.kubeflow.org/trainjob",
              "workload.codeflare.dev/appwrapper", "sparkoperator.k8s.io/sparkapplication", "pod", "deployment",
              "statefulset", "leaderworkerset.x-k8s.io/leaderworkerset"}


def pool(name, gpus=8, max_nodes=4, capacity="spot"):
    return GpuPool(name=name, instance_type="p5.48xlarge", capacity=capacity, gpu_type="H100", gpus_per_node=gpus,
                   min_nodes=0, max_nodes=max_nodes, zone="", node_selector={naming.POOL_LABEL: name},
                   tolerations=naming.gpu_tolerations(), fabric=Fabric(kind="none"), provisioner="karpenter")


def _duration_s(text: str) -> int:
    m = re.fullmatch(r"([0-9]+)(s|m|h)", text)
    assert m, text
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def test_charts_and_api_versions_are_the_pinned_releases():
    assert (tenancy.KUEUE_VERSION, tenancy.JOBSET_VERSION) == ("0.19.2", "0.12.0")
    assert queues.KUEUE_API == "kueue.x-k8s.io/v1beta2"
    assert tenancy.kueue_configuration()["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"


def test_the_namespaces_quota_is_the_most_its_cluster_queue_can_admit():
    # research 32 + applied 16 on one pool: Kueue's potential capacity for research is
    # min(32 + 16, 0 + (32 + 16)) = 48, for applied min(16 + 32, 48) = 48.
    teams = (TeamSettings(name="research", gpu_quota={"p": 32}), TeamSettings(name="applied", gpu_quota={"p": 16}))
    cluster_queues = queues.cluster_queues(teams, [pool("p", max_nodes=6)])
    for q in cluster_queues:
        assert fit.potential_capacity(q, cluster_queues, "p", "nvidia.com/gpu") == 48
    # The namespace's ResourceQuota backstop is that ceiling, with the CPU and memory that come with the GPUs, the
    # most its CPU flavor can admit (every team's prepareQuota: 8 CPUs and 32 GiB each by default), and headroom.
    hard = tenancy.team_quota(teams[1], teams, [pool("p", max_nodes=6)])
    assert hard["requests.nvidia.com/gpu"] == "48"
    assert hard["requests.cpu"] == str(48 * queues.CPU_PER_GPU + 2 * 8 + 16)
    assert hard["requests.memory"] == hard["limits.memory"] == f"{48 * queues.MEMORY_GIB_PER_GPU + 2 * 32 + 64}Gi"
    bigger = (*teams, TeamSettings(name="data", gpu_quota=0, prepare_quota=PrepareQuotaSettings(cpus=64,
                                                                                                 memory_gi=256)))
    assert tenancy.team_quota(teams[1], bigger, [pool("p", max_nodes=6)])["requests.cpu"] == \
        str(48 * queues.CPU_PER_GPU + 2 * 8 + 64 + 16)
    assert hard["services.loadbalancers"] == "0" and hard["services.nodeports"] == "0"


def test_kueue_configuration_uses_only_fields_kueue_knows():
    config = tenancy.kueue_configuration()
    assert yaml.safe_load(tenancy.kueue_manager_config()) == config
    for path, allowed in CONFIG_FIELDS.items():
        node = config
        for part in filter(None, path.split(".")):
            node = node[part]
        assert set(node) <= allowed, (path, set(node) - allowed)
    assert set(config["integrations"]["frameworks"]) <= FRAMEWORKS
    assert "jobset.x-k8s.io/jobset" in config["integrations"]["frameworks"]
    assert config["managedJobsNamespaceSelector"] == {"matchLabels": {naming.KUEUE_MANAGED_LABEL: "true"}}
    # Kueue counts no fabric device: exactly the prefixes the job check leaves out.
    assert config["resources"]["excludeResourcePrefixes"] == list(queues.EXCLUDED_RESOURCE_PREFIXES)


def test_kueue_configuration_with_a_v1beta1_only_field_is_caught():
    broken = tenancy.kueue_configuration()
    broken["waitForPodsReady"]["enable"] = True  # v1beta1 had it; v1beta2 refuses it
    assert set(broken["waitForPodsReady"]) - CONFIG_FIELDS["waitForPodsReady"] == {"enable"}


def test_pods_ready_waits_for_a_node_start_and_a_running_job_is_not_evicted_for_a_lost_pod():
    ready = tenancy.kueue_configuration()["waitForPodsReady"]
    assert _duration_s(ready["timeout"]) == job.PODS_READY_TIMEOUT_S >= job.GPU_NODE_STARTUP_S
    # recoveryTimeout 0s: disabled (pkg/controller/core/core.go only applies a positive one), so a job
    # that lost a node keeps its remaining pods while the replacement waits for capacity.
    assert ready["recoveryTimeout"] == "0s"
    assert ready["requeuingStrategy"]["backoffLimitCount"] >= 1


def test_submitters_may_pause_their_workloads_but_not_edit_queues():
    rules = {(g, r): set(rule["verbs"]) for rule in tenancy.submitter_rules()
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert "patch" in rules[("kueue.x-k8s.io", "workloads")]  # spec.active
    assert rules[("kueue.x-k8s.io", "localqueues")] == {"get", "list", "watch"}


def test_team_members_read_exactly_what_gpu_train_needs():
    """The team roles grant `gpu-train` its reads (tests/gpu_train/cli checks each call against these rules):
    the platform contract by name only, Kueue's pending-workload positions, and the pod proxy for metrics."""
    for rules in (tenancy.submitter_rules(), tenancy.viewer_rules()):
        (cm,) = [r for r in rules if "configmaps" in r["resources"]]
        assert cm == {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [naming.PLATFORM_CONFIGMAP],
                      "verbs": ["get"]}
        assert {"apiGroups": [tenancy.VISIBILITY_GROUP], "resources": ["localqueues/pendingworkloads"],
                "verbs": ["get"]} in rules
        assert {"apiGroups": [""], "resources": ["pods/proxy"], "verbs": ["get"]} in rules
    viewer = {(g, r): set(rule["verbs"]) for rule in tenancy.viewer_rules()
              for g in rule["apiGroups"] for r in rule["resources"]}
    assert viewer[("kueue.x-k8s.io", "workloads")] == {"get", "list", "watch"}  # viewers cannot pause
    assert viewer[("jobset.x-k8s.io", "jobsets")] == {"get", "list", "watch"}
    # `gpu-train list / status` show the team's data preparations too: viewers read RayJobs, only submitters make them.
    assert viewer[("ray.io", "rayjobs")] == {"get", "list", "watch"}
    submitter = {(g, r): set(rule["verbs"]) for rule in tenancy.submitter_rules()
                 for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"get", "list", "create", "delete"} <= submitter[("ray.io", "rayjobs")]


def _platform(api_cidrs=("10.0.0.0/16",), gpus=8):
    from types import SimpleNamespace

    return SimpleNamespace(api_server_cidrs=list(api_cidrs), gpu_pools=[pool("a", gpus=gpus), pool("b", gpus=1)])


def test_the_api_server_may_reach_every_local_ranks_metrics_port_and_nothing_else():
    from types import SimpleNamespace

    from infra.platform import EgressTarget

    platform = SimpleNamespace(**vars(_platform()), object_store_cidrs=["52.216.0.0/15"],
                               workload_identity_egress=[EgressTarget("169.254.170.23/32", 80)])
    spec = dict(tenancy.team_network_policies(platform, cache_enabled=False))["allow-metrics-scrape"]
    prometheus, control_plane = spec["ingress"]
    port = {"protocol": "TCP", "port": naming.METRICS_PORT, "endPort": naming.METRICS_PORT + 7}
    assert control_plane == {"from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}], "ports": [port]}
    assert prometheus["ports"] == [port] and "ipBlock" not in prometheus["from"][0]
    assert tenancy.metrics_ports(_platform(gpus=1)) == {"protocol": "TCP", "port": naming.METRICS_PORT}
    with pytest.raises(ValueError, match="api_server_cidrs"):
        tenancy.metrics_from_api_server(_platform(api_cidrs=()))


def test_kueues_visibility_api_is_reachable_from_the_control_plane():
    from infra.k8s import common

    policies = dict(tenancy.controller_network_policies(_platform(), 9443, 8443, (tenancy.KUEUE_VISIBILITY_PORT,)))
    ports = [p["port"] for p in policies[common.allow_webhooks_from_api_server([], [])[0]]["ingress"][0]["ports"]]
    assert ports == [9443, tenancy.KUEUE_VISIBILITY_PORT]


def test_kueue_manages_rayjobs_and_kuberay_is_pinned():
    assert "ray.io/rayjob" in tenancy.kueue_configuration()["integrations"]["frameworks"]
    assert (tenancy.KUBERAY_CHART, tenancy.KUBERAY_VERSION) == ("kuberay-operator", "1.7.0")


def test_kuberay_watches_only_the_team_namespaces_with_roles_there():
    values = tenancy.kuberay_values({naming.SYSTEM_LABEL: "true"}, ["team-a", "team-b"])
    assert values["watchNamespace"] == ["team-a", "team-b"]
    # Namespaced Roles in the watched namespaces instead of a ClusterRole (the chart's multiple_namespaces_role.yaml).
    assert values["singleNamespaceInstall"] is True and values["crNamespacedRbacEnable"] is True
    assert values["nodeSelector"] == {naming.SYSTEM_LABEL: "true"}
    assert values["resources"]["limits"]["memory"] == values["resources"]["requests"]["memory"]


def test_ray_pods_reach_each_other_and_the_operator_reaches_only_heads_dashboards():
    from types import SimpleNamespace

    from infra.platform import EgressTarget

    platform = SimpleNamespace(**vars(_platform()), object_store_cidrs=["52.216.0.0/15"],
                               workload_identity_egress=[EgressTarget("169.254.170.23/32", 80)])
    team = dict(tenancy.team_network_policies(platform, cache_enabled=False))
    peers = team["allow-ray-peers"]
    ray_pods = {"matchExpressions": [{"key": naming.RAY_NODE_LABEL, "operator": "Exists"}]}
    assert peers["podSelector"] == ray_pods
    assert peers["ingress"][0]["from"] == [{"podSelector": ray_pods}]
    dashboard = team["allow-ray-dashboard-from-operator"]
    assert dashboard["podSelector"] == {"matchLabels": {"ray.io/node-type": "head"}}
    assert dashboard["ingress"][0]["ports"] == [{"protocol": "TCP", "port": tenancy.RAY_DASHBOARD_PORT}]
    assert dashboard["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": naming.KUBERAY_NAMESPACE}}}]
    operator = dict(tenancy.kuberay_network_policies(_platform(), ["team-a"]))
    assert list(operator)[0] == "default-deny-all"
    (egress,) = operator["allow-ray-dashboards"]["egress"]
    assert [t["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for t in egress["to"]] == ["team-a"]
    assert egress["ports"] == [{"protocol": "TCP", "port": tenancy.RAY_DASHBOARD_PORT}]
