"""GPU node health: faults detected on the node, the node quarantined so its pods leave with their grace
period, a pre-flight check before a new node takes work, and the clouds' own repair behind them.

Usage (infra/k8s/__init__.py):
    health = Health("health", HealthArgs(platform=platform, settings=cfg.health, is_prod=cfg.is_prod,
                                         monitoring_labels=release_labels(), agent_namespace="gpu-system",
                                         depends_on=(monitoring.release, gpu.namespace)))
Pure builders, tested without mocks: `xid_monitor`, `npd_values`, `nrc_values`, `fault_rule`,
`preflight_rules`, `pool_expectations`, `preflight_daemonset`, `node_agent_tolerations`. The pre-flight
check itself is infra/k8s/gpu-preflight.sh, its results server infra/k8s/preflight_server.py. What happens on
each kind of failure, and how long it takes: docs/operations.md.

The pipeline, built from components made for each step (why these: docs/operations.md):
- detect: node-problem-detector (kubernetes/node-problem-detector, chart of deliveryhero/helm-charts) on every
  GPU node watches the kernel log for the configured NVIDIA XIDs (`gpu-train:health.xidCodes`) and sets the
  node condition `GpuXidFault`. On EKS the node monitoring agent (an EKS add-on, infra/aws/cluster.py) runs
  DCGM's health watches and sets `AcceleratedHardwareReady=False` on fatal GPU faults; the rule below reads
  it where it exists and ignores it where it does not (GKE).
- quarantine: node-readiness-controller (kubernetes-sigs, SIG Node) turns those conditions into the taint
  `readiness.k8s.io/gpu-train-gpu-fault:NoExecute`. Kubernetes' taint eviction deletes the node's training pods
  with their own terminationGracePeriodSeconds (the trainer checkpoints on SIGTERM) and marks them
  DisruptionTarget, which the job's pod failure policy does not count; nothing new is scheduled there.
  `gpu-train:health.remediation: false` puts the rule in dry-run: it reports, it does not taint.
- replace: the emptied node is removed by the cloud (Karpenter node repair or consolidation, GKE's cluster
  autoscaler) and the job's replacement pod brings up a new node (infra/aws/karpenter.py, infra/gcp/).
- pre-flight: node-readiness-controller also keeps every new GPU node tainted
  (`readiness.k8s.io/gpu-train-preflight-<check>:NoSchedule`, one taint per check) until the node's
  gpu-preflight pod (namespace gpu-system, with the platform's other GPU node agents) reports that check
  passed. A failing check leaves its taint, which names it.
  The taints are applied when the node registers (bootstrap-only rules), not by the provisioner: on GKE a
  node-pool taint the pending pods do not tolerate would stop the cluster autoscaler from adding nodes, and
  a GPU pod cannot be bound before the device plugin has advertised the GPUs, which takes longer than the
  controller takes to taint the new node.

Over 400 lines because node health is one chain: the pre-flight DaemonSet, the problem detector's XID monitor and
the readiness controller's rules name the same conditions and taints, and one module keeps them in step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from gpu_train.spec.settings import HealthSettings
from infra.k8s import common
from infra.platform import ClusterPlatform, FabricProbe

HERE = Path(__file__).resolve().parent
PREFLIGHT_SCRIPT = HERE / "gpu-preflight.sh"
PREFLIGHT_SERVER = HERE / "preflight_server.py"

NAMESPACE = "node-health"
# https://github.com/deliveryhero/helm-charts/tree/master/stable/node-problem-detector (index.yaml of that
# repository points every version at this OCI path); chart 2.4.1 runs node-problem-detector v1.35.1.
NPD_CHART = "oci://ghcr.io/deliveryhero/helm-charts/node-problem-detector"
NPD_VERSION = "2.4.1"
NPD_IMAGE_TAG = "v1.35.1"
NPD_RELEASE = "node-problem-detector"
NPD_PORT = 20257  # the chart's settings.prometheus_port, container port "exporter"
# https://github.com/kubernetes-sigs/node-readiness-controller: v0.5.0 publishes the chart (version 0.5.0),
# the controller and the reporter image.
NRC_CHART = "oci://registry.k8s.io/node-readiness-controller/charts/node-readiness-controller"
NRC_VERSION = "0.5.0"
NRC_IMAGE_TAG = "v0.5.0"
NRC_RELEASE = "node-readiness-controller"
NRC_METRICS_PORT = 8443  # the chart's metrics.bindAddress / service port (plain HTTP with metrics.secure false)
NRR_API = "readiness.node.x-k8s.io/v1alpha1"
REPORTER_IMAGE = "registry.k8s.io/node-readiness-controller/node-readiness-reporter:v0.5.0"
# NVIDIA's DCGM container (nv-hostengine, dcgmi and the diagnostic plugins on Ubuntu).
DCGM_IMAGE = "nvcr.io/nvidia/cloud-native/dcgm:4.5.2-1-ubuntu22.04"
PYTHON_IMAGE = "python:3.13.5-slim-bookworm"

# Node conditions the quarantine rule reads: ours from node-problem-detector (True = a fault), and the EKS
# node monitoring agent's GPU condition (False = a fault; absent on GKE, where it counts as healthy).
XID_CONDITION = "GpuXidFault"
CLOUD_GPU_CONDITION = "AcceleratedHardwareReady"
# node-readiness-controller only manages taints under readiness.k8s.io/ (a CEL rule of its CRD); Karpenter
# 1.14 knows that prefix (pkg/scheduling/taints.go KnownEphemeralTaintKeyPrefixes): it waits for such taints
# to go before it calls a new node initialized, and honours them on initialized nodes.
FAULT_TAINT = {"key": "readiness.k8s.io/gpu-train-gpu-fault", "value": "quarantined", "effect": "NoExecute"}
FAULT_RULE = "gpu-train-gpu-fault"
PREFLIGHT_NAME = "gpu-preflight"
PREFLIGHT_CHECKS = ("gpus", "ecc", "dcgm", "fabric")
PREFLIGHT_TAINT_PREFIX = "readiness.k8s.io/gpu-train-preflight-"
PREFLIGHT_SERVER_PORT = 8081
PREFLIGHT_LABELS = {"app.kubernetes.io/name": PREFLIGHT_NAME, "app.kubernetes.io/part-of": "gpu-train"}
SCRIPTS_MOUNT = "/etc/gpu-preflight"
RESULTS_MOUNT = "/results"
# node-problem-detector reads the whole kernel log since boot when it (re)starts, so a fault found before
# a restart of its pod is found again: lookback covers a node's life (Karpenter's expireAfter is 720h).
XID_LOOKBACK = "720h"


def preflight_condition(check: str) -> str:
    """The node condition a pre-flight check reports, e.g. gpu-train.io/PreflightGpus."""
    if check not in PREFLIGHT_CHECKS:
        raise ValueError(f"unknown pre-flight check {check!r} (known: {', '.join(PREFLIGHT_CHECKS)})")
    return f"gpu-train.io/Preflight{check.capitalize()}"


def preflight_taint(check: str) -> dict[str, str]:
    """The taint a new GPU node keeps until this check passes; its key names the check."""
    preflight_condition(check)
    return {"key": f"{PREFLIGHT_TAINT_PREFIX}{check}", "value": "pending", "effect": "NoSchedule"}


def node_agent_tolerations(pools: Sequence[GpuPool]) -> list[dict[str, str]]:
    """Tolerations for a per-node agent that must keep running on a node in pre-flight or quarantine
    (metrics exporters): the GPU taints plus the health taints."""
    out = common.gpu_tolerations(pools)
    for key, effect in [(FAULT_TAINT["key"], FAULT_TAINT["effect"]),
                        *((preflight_taint(c)["key"], "NoSchedule") for c in PREFLIGHT_CHECKS)]:
        tol = {"key": key, "operator": "Exists", "effect": effect}
        if tol not in out:
            out.append(tol)
    return out


def xid_pattern(code: int) -> str:
    """RE2 pattern of the driver's kernel-log line for one XID, e.g.
    `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.`
    (https://docs.nvidia.com/deploy/xid-errors/), or the code alone at the end of the line.
    node-problem-detector appends `\\z`: the pattern must run to the end of the line."""
    if isinstance(code, bool) or not isinstance(code, int) or code < 1:
        raise ValueError(f"XID {code!r} is not a positive whole number")
    return rf"NVRM: Xid \(PCI:[^)]*\): {code}(,.*)?"


def xid_monitor(codes: Sequence[int]) -> dict[str, Any]:
    """node-problem-detector system-log monitor (kmsg plugin) setting GpuXidFault=True, reason NvidiaXid<N>,
    on the first kernel-log line of any of the given XIDs. A permanent condition: it stays until the node
    is replaced (a node-problem-detector restart re-reads the log since boot)."""
    if not codes:
        raise ValueError("gpu-train:health.xidCodes is empty: the XID monitor needs at least one code")
    return {
        "plugin": "kmsg",
        "logPath": "/dev/kmsg",
        "lookback": XID_LOOKBACK,
        "bufferSize": 10,
        "source": "gpu-xid-monitor",
        "metricsReporting": True,
        "conditions": [{"type": XID_CONDITION, "reason": "NoGpuXidFault",
                        "message": "no GPU fault XID in the kernel log since boot"}],
        "rules": [{"type": "permanent", "condition": XID_CONDITION, "reason": f"NvidiaXid{code}",
                   "pattern": xid_pattern(code)} for code in sorted(set(codes))],
    }


def npd_values(pools: Sequence[GpuPool], codes: Sequence[int]) -> dict[str, Any]:
    """Values for the node-problem-detector chart: GPU nodes only (every taint tolerated, so it keeps
    watching a quarantined node), the stock kernel monitor plus the XID monitor."""
    if not pools:
        raise ValueError("npd_values needs at least one GPU pool")
    return {
        "image": {"tag": NPD_IMAGE_TAG},
        "settings": {
            "custom_monitor_definitions": {"gpu-xid-monitor.json": json.dumps(xid_monitor(codes), indent=2)},
            "log_monitors": ["/config/kernel-monitor.json", "/custom-config/gpu-xid-monitor.json"],
            "custom_plugin_monitors": [],
            "prometheus_address": "0.0.0.0",
            "prometheus_port": NPD_PORT,
        },
        "affinity": common.pool_affinity(pools),
        "tolerations": [{"operator": "Exists"}],
        "priorityClassName": "system-node-critical",
        "resources": common.resources("20m", "64Mi", "200m", "160Mi"),
        # The kmsg plugin reads the host's kernel ring buffer.
        "extraVolumes": [{"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}}],
        "extraVolumeMounts": [{"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}],
    }


def nrc_values(*, system_selector: Mapping[str, str], is_prod: bool) -> dict[str, Any]:
    """Values for the node-readiness-controller chart: on system nodes, metrics over plain HTTP inside the
    namespace (Prometheus scrapes it; the validating webhook and TLS would need cert-manager, and the rules
    here are generated with distinct taints, which is what the webhook checks)."""
    return {
        "image": {"tag": NRC_IMAGE_TAG},
        "replicaCount": 2 if is_prod else 1,
        "leaderElection": {"enabled": True},
        "nodeSelector": dict(system_selector),
        "resources": common.resources("20m", "64Mi", "500m", "256Mi"),
        "metrics": {"enabled": True, "secure": False, "bindAddress": f":{NRC_METRICS_PORT}"},
        "webhook": {"enabled": False},
        "validatingWebhook": {"enabled": False},
        "certManager": {"enabled": False},
    }


def _pool_selector(pools: Sequence[GpuPool]) -> dict[str, Any]:
    return {"matchExpressions": [{"key": naming.POOL_LABEL, "operator": "In",
                                  "values": sorted({p.name for p in pools})}]}


def fault_rule(pools: Sequence[GpuPool], *, remediation: bool) -> dict[str, Any]:
    """The NodeReadinessRule that quarantines a GPU node with a fault (continuous enforcement, NoExecute).
    Both conditions default to healthy when absent, so a node without a detector is left alone."""
    if not pools:
        raise ValueError("fault_rule needs at least one GPU pool")
    return {
        "apiVersion": NRR_API, "kind": "NodeReadinessRule",
        "metadata": {"name": FAULT_RULE, "labels": {"app.kubernetes.io/part-of": "gpu-train"}},
        "spec": {
            "conditions": [
                {"type": XID_CONDITION, "requiredStatus": "False", "defaultStatus": "False"},
                {"type": CLOUD_GPU_CONDITION, "requiredStatus": "True", "defaultStatus": "True"},
            ],
            "taint": dict(FAULT_TAINT),
            "enforcementMode": "continuous",
            "nodeSelector": _pool_selector(pools),
            "dryRun": not remediation,
        },
    }


def has_fabric(pool: GpuPool) -> bool:
    return pool.fabric.kind != "none"


def preflight_rules(pools: Sequence[GpuPool]) -> list[dict[str, Any]]:
    """One bootstrap-only NodeReadinessRule per pre-flight check: the node keeps the check's NoSchedule taint
    until the check's condition is True. The fabric check applies to fabric pools only."""
    if not pools:
        raise ValueError("preflight_rules needs at least one GPU pool")
    out = []
    for check in PREFLIGHT_CHECKS:
        targets = [p for p in pools if has_fabric(p)] if check == "fabric" else list(pools)
        if not targets:
            continue
        out.append({
            "apiVersion": NRR_API, "kind": "NodeReadinessRule",
            "metadata": {"name": f"gpu-train-preflight-{check}", "labels": {"app.kubernetes.io/part-of": "gpu-train"}},
            "spec": {
                "conditions": [{"type": preflight_condition(check), "requiredStatus": "True"}],
                "taint": preflight_taint(check),
                "enforcementMode": "bootstrap-only",
                "nodeSelector": _pool_selector(targets),
            },
        })
    return out


def pool_expectations(pools: Sequence[GpuPool], probes: Mapping[str, FabricProbe]) -> dict[str, dict[str, Any]]:
    """pool -> what its nodes should have (the server hands the node's entry to the check script): its GPUs and
    the fabric devices the cloud layer says a healthy node has (platform.node_addons.fabric_probes)."""
    out = {}
    for pool in pools:
        probe = probes.get(pool.name, FabricProbe(probe="none", devices=0))
        if probe.probe != "none" and probe.devices < 1:
            raise ValueError(f"pool {pool.name!r}: a {probe.probe} fabric probe expects no devices")
        out[pool.name] = {"gpus": pool.gpus_per_node, "fabricProbe": probe.probe, "fabricDevices": probe.devices}
    return out


def _reporter(check: str) -> dict[str, Any]:
    return {
        "name": f"report-{check}",
        "image": REPORTER_IMAGE,
        "imagePullPolicy": "Always",
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "CONDITION_TYPE", "value": preflight_condition(check)},
            {"name": "CHECK_ENDPOINT", "value": f"http://127.0.0.1:{PREFLIGHT_SERVER_PORT}/{check}"},
            {"name": "CHECK_INTERVAL", "value": "15s"},
        ],
        "resources": common.resources("5m", "24Mi", "50m", "48Mi"),
        "securityContext": common.restricted_container_security(),
    }


def _check_container(diag_level: int, driver_host_path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The DCGM check's container and the pod's volumes (the driver's host folder mounted where the cloud has one)."""
    check_env = [
        {"name": "RESULTS_DIR", "value": RESULTS_MOUNT},
        {"name": "DCGM_DIAG_LEVEL", "value": str(diag_level)},
        # With the NVIDIA container runtime (EKS GPU AMIs) these make it mount the driver's tools.
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
    ]
    # Read-only root filesystem: the DCGM host engine and diagnostics write their logs, sockets and pid files
    # to these.
    scratch = {"tmp": "/tmp", "logs": "/var/log", "run": "/run"}
    check_mounts = [{"name": "results", "mountPath": RESULTS_MOUNT},
                    {"name": "scripts", "mountPath": SCRIPTS_MOUNT, "readOnly": True},
                    *({"name": v, "mountPath": path} for v, path in scratch.items())]
    volumes: list[dict[str, Any]] = [
        {"name": "results", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "scripts", "configMap": {"name": PREFLIGHT_NAME, "defaultMode": 0o555}},
        *({"name": v, "emptyDir": {"sizeLimit": "256Mi"}} for v in scratch),
    ]
    if driver_host_path:
        volumes.append({"name": "nvidia", "hostPath": {"path": driver_host_path, "type": "Directory"}})
        check_mounts.append({"name": "nvidia", "mountPath": "/usr/local/nvidia", "readOnly": True})
        check_env += [{"name": "PATH", "value": "/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                                                  "/usr/bin:/sbin:/bin"},
                      {"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}]
    return {
        "name": "check",
        "image": DCGM_IMAGE,
        "imagePullPolicy": "Always",
        "command": ["sh", f"{SCRIPTS_MOUNT}/gpu-preflight.sh"],
        "env": check_env,
        "volumeMounts": check_mounts,
        "resources": common.resources("100m", "256Mi", "2", "1Gi"),
        "securityContext": {"privileged": True, "readOnlyRootFilesystem": True},
    }, volumes


def _results_container() -> dict[str, Any]:
    """The results server: it serves the checks' outcome to the reporters (on 127.0.0.1 only)."""
    return {
        "name": "results",
        "image": PYTHON_IMAGE,
        "imagePullPolicy": "Always",
        "command": ["python", f"{SCRIPTS_MOUNT}/preflight_server.py"],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "RESULTS_DIR", "value": RESULTS_MOUNT},
            {"name": "POOLS_FILE", "value": f"{SCRIPTS_MOUNT}/pools.json"},
            {"name": "PORT", "value": str(PREFLIGHT_SERVER_PORT)},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        ],
        "volumeMounts": [{"name": "results", "mountPath": RESULTS_MOUNT},
                         {"name": "scripts", "mountPath": SCRIPTS_MOUNT, "readOnly": True}],
        "resources": common.resources("10m", "32Mi", "100m", "64Mi"),
        "securityContext": common.restricted_container_security(),
        # It listens on 127.0.0.1 only (the reporters share the pod's network), so the probe runs inside.
        "livenessProbe": {"exec": {"command": [
            "python", "-c",
            f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{PREFLIGHT_SERVER_PORT}/healthz', "
            "timeout=3)"]},
            "periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 3},
    }


def preflight_daemonset(pools: Sequence[GpuPool], namespace: str, *, diag_level: int, driver_host_path: str = "",
                        service_account: str = PREFLIGHT_NAME) -> dict[str, Any]:
    """The gpu-preflight DaemonSet (metadata + spec): the check (privileged: it needs every GPU and the
    host's devices without holding them through the device plugin), the results server, one reporter per
    check. Where the cloud keeps the driver's binaries on the host (`driver_host_path`, platform.node_addons),
    the check mounts them read-only."""
    if not pools:
        raise ValueError("preflight_daemonset needs at least one GPU pool")
    if diag_level not in (1, 2):
        raise ValueError(f"DCGM diagnostics level {diag_level} is not 1 or 2")
    check, volumes = _check_container(diag_level, driver_host_path)
    containers = [check, _results_container(), *(_reporter(c) for c in PREFLIGHT_CHECKS)]
    return {
        "metadata": {"name": PREFLIGHT_NAME, "namespace": namespace, "labels": dict(PREFLIGHT_LABELS),
                     "annotations": common.checkov_skip_annotations(PREFLIGHT_NAME)},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": PREFLIGHT_NAME}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": dict(PREFLIGHT_LABELS)},
                "spec": {
                    "serviceAccountName": service_account,
                    # The reporters and the server read and update their own Node object.
                    "automountServiceAccountToken": True,
                    "priorityClassName": "system-node-critical",
                    "affinity": common.pool_affinity(pools),
                    # Runs on a node in pre-flight (it is what lifts those taints) and in quarantine.
                    "tolerations": [{"operator": "Exists"}],
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 5,
                    "volumes": volumes,
                    "containers": containers,
                },
            },
        },
    }


def preflight_cluster_role() -> dict[str, Any]:
    """What the reporters and the results server need: read a node, update its status (conditions)."""
    return {"rules": [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["get", "update", "patch"]},
    ]}


def health_network_policies(platform: ClusterPlatform) -> list[common.Policy]:
    """The namespace talks to the API server and DNS only; Prometheus may scrape the detector and the
    controller. (gpu-preflight lives in the GPU agents' namespace, whose policies allow the same egress.)"""
    return [
        common.default_deny(),
        common.allow_dns(),
        common.allow_api_server(platform.api_server_cidrs),
        common.allow_same_namespace(),
        common.allow_metrics_scrape([NPD_PORT, NRC_METRICS_PORT]),
    ]


def npd_pod_monitor_spec() -> dict[str, Any]:
    """PodMonitor for node-problem-detector's exporter, with the node's name as `node`."""
    return {
        "selector": {"matchLabels": {"app.kubernetes.io/name": NPD_RELEASE, "app.kubernetes.io/instance": NPD_RELEASE}},
        "namespaceSelector": {"matchNames": [NAMESPACE]},
        "podMetricsEndpoints": [{"port": "exporter", "interval": "30s", "path": "/metrics",
                                 "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                                  "targetLabel": "node"}]}],
    }


def nrc_service_monitor_spec() -> dict[str, Any]:
    """ServiceMonitor for node-readiness-controller's metrics service (port `http` with metrics.secure false)."""
    return {
        "selector": {"matchLabels": {"app.kubernetes.io/name": NRC_RELEASE, "app.kubernetes.io/instance": NRC_RELEASE}},
        "namespaceSelector": {"matchNames": [NAMESPACE]},
        "endpoints": [{"port": "http", "interval": "30s", "path": "/metrics"}],
    }


@dataclass(frozen=True, kw_only=True)
class HealthArgs:
    platform: ClusterPlatform  # GPU pools, system nodes, provider
    settings: HealthSettings  # cfg.health
    is_prod: bool  # controller replicas
    monitoring_labels: Mapping[str, str] = field(default_factory=dict)  # labels the Prometheus selects monitors by
    # Where the gpu-preflight DaemonSet runs: the GPU node agents' namespace (privileged, API-server egress).
    agent_namespace: str = common.GPU_NAMESPACE
    depends_on: tuple[pulumi.Resource, ...] = ()  # the monitoring release (PodMonitor CRDs), the agents' namespace


class Health(pulumi.ComponentResource):
    """node-problem-detector, node-readiness-controller, the quarantine and pre-flight rules, gpu-preflight."""

    def __init__(self, name: str, args: HealthArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:Health", name, None, opts)
        p, s = args.platform, args.settings
        pools = list(p.gpu_pools)
        self.releases: list[k8s.helm.v3.Release] = []
        self.rules: list[k8s.apiextensions.CustomResource] = []
        self.preflight: k8s.apps.v1.DaemonSet | None = None
        if not s.enabled:
            self.register_outputs({"enabled": False})
            return
        # Privileged: node-problem-detector reads the host's kernel log (/dev/kmsg).
        self.namespace = common.namespace(NAMESPACE, p, self, enforce="privileged", depends_on=p.ready)
        ns_deps = [self.namespace]
        self.network_policies = common.network_policies(NAMESPACE, health_network_policies(p), p, self, ns_deps)

        self.npd = k8s.helm.v3.Release(
            f"{name}-node-problem-detector", name=NPD_RELEASE, chart=NPD_CHART, version=NPD_VERSION,
            namespace=NAMESPACE, values=npd_values(pools, s.xid_codes),
            # GPU pools may be scaled to zero; PlatformWorkloadUnavailable (rules/workloads.yaml) watches it.
            skip_await=True,
            opts=common.k8s_opts(p, self, ns_deps))
        self.nrc = k8s.helm.v3.Release(
            f"{name}-node-readiness-controller", name=NRC_RELEASE, chart=NRC_CHART, version=NRC_VERSION,
            namespace=NAMESPACE, values=nrc_values(system_selector=p.system_node_selector, is_prod=args.is_prod),
            opts=common.k8s_opts(p, self, ns_deps))
        self.releases = [self.npd, self.nrc]

        objects = [fault_rule(pools, remediation=s.remediation)] + (preflight_rules(pools) if s.preflight else [])
        for obj in objects:
            # Conditions, taint, mode and node selector are immutable (CEL rules of the CRD): a change
            # replaces the rule.
            self.rules.append(k8s.apiextensions.CustomResource(
                f"{name}-rule-{obj['metadata']['name']}", api_version=obj["apiVersion"], kind=obj["kind"],
                metadata=obj["metadata"], spec=obj["spec"],
                opts=pulumi.ResourceOptions.merge(common.k8s_opts(p, self, [self.nrc]), pulumi.ResourceOptions(
                    replace_on_changes=["spec.conditions", "spec.taint", "spec.enforcementMode", "spec.nodeSelector"],
                    delete_before_replace=True))))

        if s.preflight:
            agents_ns = args.agent_namespace
            agent_deps = [*p.ready, *args.depends_on]
            sa = k8s.core.v1.ServiceAccount(
                f"{name}-preflight-sa", metadata={"name": PREFLIGHT_NAME, "namespace": agents_ns},
                automount_service_account_token=False, opts=common.k8s_opts(p, self, agent_deps))
            role = k8s.rbac.v1.ClusterRole(
                f"{name}-preflight-role", metadata={"name": f"gpu-train-{PREFLIGHT_NAME}"},
                rules=preflight_cluster_role()["rules"], opts=common.k8s_opts(p, self, agent_deps))
            binding = k8s.rbac.v1.ClusterRoleBinding(
                f"{name}-preflight-binding", metadata={"name": f"gpu-train-{PREFLIGHT_NAME}"},
                role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role.metadata.name},
                subjects=[{"kind": "ServiceAccount", "name": PREFLIGHT_NAME, "namespace": agents_ns}],
                opts=common.k8s_opts(p, self, [sa, role]))
            scripts = k8s.core.v1.ConfigMap(
                f"{name}-preflight-scripts", metadata={"name": PREFLIGHT_NAME, "namespace": agents_ns},
                data={"gpu-preflight.sh": PREFLIGHT_SCRIPT.read_text(),
                      "preflight_server.py": PREFLIGHT_SERVER.read_text(),
                      "pools.json": json.dumps(pool_expectations(pools, p.node_addons.fabric_probes), indent=2,
                                            sort_keys=True)},
                opts=common.k8s_opts(p, self, agent_deps))
            manifest = preflight_daemonset(pools, agents_ns, diag_level=s.dcgm_diag_level,
                                           driver_host_path=p.node_addons.driver_host_path)
            self.preflight = k8s.apps.v1.DaemonSet(
                f"{name}-preflight", metadata=manifest["metadata"], spec=manifest["spec"],
                opts=common.k8s_opts(p, self, [binding, scripts, *self.rules]))

        labels = dict(args.monitoring_labels)
        self.monitors = [
            k8s.apiextensions.CustomResource(
                f"{name}-npd-podmonitor", api_version="monitoring.coreos.com/v1", kind="PodMonitor",
                metadata={"name": NPD_RELEASE, "namespace": NAMESPACE, "labels": labels},
                spec=npd_pod_monitor_spec(), opts=common.k8s_opts(p, self, [*ns_deps, *args.depends_on])),
            k8s.apiextensions.CustomResource(
                f"{name}-nrc-servicemonitor", api_version="monitoring.coreos.com/v1", kind="ServiceMonitor",
                metadata={"name": NRC_RELEASE, "namespace": NAMESPACE, "labels": labels},
                spec=nrc_service_monitor_spec(), opts=common.k8s_opts(p, self, [*ns_deps, *args.depends_on])),
        ]
        self.register_outputs({"enabled": True, "releases": [r.name for r in self.releases],
                               "rules": [r.metadata for r in self.rules]})
