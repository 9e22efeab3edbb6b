"""Monitoring: kube-prometheus-stack (Prometheus, Alertmanager, Grafana) on system nodes,
dcgm-exporter on GPU nodes with a custom counters CSV, GPU + training dashboards from JSON files,
ServiceMonitor/PodMonitors that the release's Prometheus selects, and alert rules from
infra/k8s/rules/*.yaml with the stack's thresholds rendered in.

Usage: `Monitoring("monitoring", MonitoringArgs(platform=..., settings=cfg.monitoring, ...))`;
`monitoring.grafana_url` is the internal load balancer URL or a `kubectl port-forward` command.
Everything computed is a pure function here (values, rules, dashboards, monitor specs).

Over 400 lines because the chart values, the monitors, the rules and the dashboards name the same release labels,
ports and thresholds; they are pure functions beside the one component that installs them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from gpu_train.spec import naming
from gpu_train.spec.settings import HealthSettings, MonitoringSettings
from infra.k8s import common, health
from infra.platform import ClusterPlatform, GpuPool

HERE = Path(__file__).resolve().parent
RULES_DIR = HERE / "rules"
DASHBOARDS_DIR = HERE / "dashboards"
COUNTERS_CSV = HERE / "dcgm-counters.csv"

# https://github.com/prometheus-community/helm-charts/tree/main/charts/kube-prometheus-stack
KPS_CHART = "kube-prometheus-stack"
KPS_REPO = "https://prometheus-community.github.io/helm-charts"
KPS_VERSION = "88.5.3"
# https://github.com/NVIDIA/dcgm-exporter/tree/main/deployment. The chart version is the exporter's own
# release (4.8.2, git tag 4.5.3-4.8.2: DCGM 4.5.3 inside exporter 4.8.2), not the DCGM version.
DCGM_CHART = "dcgm-exporter"
DCGM_REPO = "https://nvidia.github.io/dcgm-exporter/helm-charts"
DCGM_VERSION = "4.8.2"
DCGM_RELEASE = "dcgm-exporter"
DCGM_PORT = 9400
COUNTERS_MOUNT = "/etc/dcgm-exporter/custom"
COUNTERS_CONFIGMAP = "dcgm-counters"
# The node metrics agents' namespace, Pod Security `privileged`: node-exporter shares the host's network
# and PID namespaces and reads /proc, /sys and / through hostPath volumes on host port 9100; dcgm-exporter
# mounts the kubelet's pod-resources socket directory and adds SYS_ADMIN (profiling counters), and on GKE
# runs privileged. `baseline`, which the rest of the monitoring stack runs at, refuses every one of those
# pods (https://kubernetes.io/docs/concepts/security/pod-security-standards/#baseline). Nothing else runs
# here.
AGENTS_NAMESPACE = "node-metrics"

GRAFANA_PORT = 80  # the chart's Service port (container listens on 3000)
GRAFANA_SERVICE = f"{naming.MONITORING_RELEASE}-grafana"
TRAINER_MONITOR = "trainer"
# Prometheus' job label for a PodMonitor is "<namespace>/<name>".
TRAINER_JOB = f"{naming.MONITORING_NAMESPACE}/{TRAINER_MONITOR}"
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
# TrainingStraggler fires when one rank's own time per step (compute + input wait, 5-minute mean) stays above
# this multiple of the median rank's for 10 minutes: a quarter slower is well beyond run-to-run jitter of
# synchronous data-parallel steps and costs every other rank that quarter of each step.
STRAGGLER_RATIO = 1.25
# Namespaces whose DaemonSets, Deployments and StatefulSets PlatformWorkloadUnavailable watches
# (rules/workloads.yaml): every namespace the platform installs workloads into, team namespaces and
# kube-system (the clouds' own add-ons) aside. "logging" is the EKS log shipper's (infra/aws/log_shipping.py),
# "cnpg-system" the CloudNativePG operator's (infra/k8s/mlflow.py); tests/infra/k8s/test_rules.py holds this
# list against the namespaces of every stack's plan.
PLATFORM_NAMESPACES = (common.GPU_NAMESPACE, AGENTS_NAMESPACE, naming.MONITORING_NAMESPACE, health.NAMESPACE,
                       naming.CACHE_NAMESPACE, common.KUEUE_NAMESPACE, common.JOBSET_NAMESPACE,
                       naming.KUBERAY_NAMESPACE, naming.MLFLOW_NAMESPACE, "cnpg-system", "logging")
_PLACEHOLDER = re.compile(r"__([A-Z_]+)__")


def release_labels() -> dict[str, str]:
    """Labels a ServiceMonitor / PodMonitor / PrometheusRule needs for this Prometheus to load it."""
    return {"release": naming.MONITORING_RELEASE}


def _storage(storage_class: str, gb: int) -> dict[str, Any]:
    return {"volumeClaimTemplate": {"spec": {
        "storageClassName": storage_class, "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": f"{gb}Gi"}}}}}


def prometheus_stack_values(*, settings: MonitoringSettings, storage_class: str, system_selector: dict[str, str],
                            internal_lb_annotations: dict[str, str], is_prod: bool) -> dict[str, Any]:
    """Values for kube-prometheus-stack. Selectors for monitors and rules are explicit: the
    release label, in every namespace."""
    selector = {"matchLabels": release_labels()}
    grafana_service: dict[str, Any] = {"type": "ClusterIP", "port": GRAFANA_PORT}
    if settings.grafana_exposed:
        if not internal_lb_annotations:
            raise ValueError("gpu-train:monitoring.grafanaExposed is true but the platform gives no "
                             "internal load balancer annotations (platform.internal_lb_annotations)")
        grafana_service = {"type": "LoadBalancer", "port": GRAFANA_PORT,
                           "annotations": dict(internal_lb_annotations)}
    # Keep ~10% of the volume free so the TSDB compacts instead of filling the disk.
    retention_size = f"{max(1, int(settings.storage_gb * 0.9))}GB"
    return {
        "crds": {"enabled": True},
        "defaultRules": {"create": True},
        "prometheus": {"prometheusSpec": {
            "replicas": 2 if is_prod else 1,
            "retention": settings.retention,
            "retentionSize": retention_size,
            "storageSpec": _storage(storage_class, settings.storage_gb),
            "serviceMonitorSelectorNilUsesHelmValues": True,
            "podMonitorSelectorNilUsesHelmValues": True,
            "ruleSelectorNilUsesHelmValues": True,
            "serviceMonitorSelector": selector,
            "podMonitorSelector": selector,
            "ruleSelector": selector,
            "serviceMonitorNamespaceSelector": {},
            "podMonitorNamespaceSelector": {},
            "ruleNamespaceSelector": {},
            "nodeSelector": system_selector,
            "resources": common.resources("500m", "4Gi" if is_prod else "2Gi", "2", "8Gi" if is_prod else "4Gi"),
        }},
        "alertmanager": {"alertmanagerSpec": {
            "replicas": 2 if is_prod else 1,
            "nodeSelector": system_selector,
            "storage": _storage(storage_class, 2),
            "resources": common.resources("50m", "128Mi", "200m", "256Mi"),
        }},
        "prometheusOperator": {
            "nodeSelector": system_selector,
            "resources": common.resources("100m", "256Mi", "500m", "512Mi"),
            "admissionWebhooks": {"patch": {"nodeSelector": system_selector,
                                            "resources": common.resources("50m", "64Mi", "200m", "128Mi")}},
            "prometheusConfigReloader": {"resources": common.resources("10m", "32Mi", "100m", "64Mi")},
        },
        "kube-state-metrics": {"nodeSelector": system_selector,
                               "resources": common.resources("50m", "128Mi", "200m", "512Mi")},
        # node-exporter belongs on every node, GPU nodes included, in the agents' namespace (the subchart's
        # namespaceOverride): its pods use the host's namespaces, paths and port.
        "prometheus-node-exporter": {"namespaceOverride": AGENTS_NAMESPACE,
                                     "tolerations": [{"operator": "Exists"}],
                                     "resources": common.resources("20m", "32Mi", "200m", "128Mi")},
        "grafana": {
            "nodeSelector": system_selector,
            "resources": common.resources("100m", "256Mi", "500m", "512Mi"),
            "persistence": {"enabled": True, "type": "pvc", "storageClassName": storage_class,
                            "size": f"{settings.grafana_storage_gb}Gi", "accessModes": ["ReadWriteOnce"]},
            # A ReadWriteOnce volume cannot be attached to the old and the new pod at once.
            "deploymentStrategy": {"type": "Recreate"},
            "service": grafana_service,
            "sidecar": {
                "resources": common.resources("20m", "64Mi", "100m", "128Mi"),
                "dashboards": {"enabled": True, "label": "grafana_dashboard", "labelValue": "1",
                               "searchNamespace": naming.MONITORING_NAMESPACE, "folder": "/tmp/dashboards"},
                "datasources": {"enabled": True},
            },
        },
    }


def grafana_url(settings: MonitoringSettings) -> str | None:
    """The port-forward command when Grafana is not exposed; None when the LB hostname is needed."""
    if settings.grafana_exposed:
        return None
    return (f"kubectl -n {naming.MONITORING_NAMESPACE} port-forward svc/{GRAFANA_SERVICE} 3000:{GRAFANA_PORT}"
            f"  # then open http://localhost:3000")


def read_counters_csv(path: Path = COUNTERS_CSV) -> list[tuple[str, str, str]]:
    """Parse the dcgm-exporter counters CSV (field, Prometheus type, help); reject malformed rows."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3 or not parts[0].startswith("DCGM_FI_") or parts[1] not in ("gauge", "counter", "label"):
            raise ValueError(f"{path}:{n}: expected 'DCGM_FI_<field>, gauge|counter|label, help' (got {line!r})")
        rows.append((parts[0], parts[1], parts[2]))
    return rows


def dcgm_values(gpu_pools: list[GpuPool], driver_host_path: str = "") -> dict[str, Any]:
    """Values for dcgm-exporter: GPU nodes only, our counters CSV from a ConfigMap; the chart's
    own ServiceMonitor is off because we create one labelled for the release. The release is installed
    in AGENTS_NAMESPACE. `driver_host_path`: where the NVIDIA libraries live on the host, when the container
    runtime does not inject them."""
    if not gpu_pools:
        raise ValueError("dcgm_values needs at least one GPU pool")
    values: dict[str, Any] = {
        "arguments": ["-f", f"{COUNTERS_MOUNT}/dcgm-counters.csv"],
        "extraConfigMapVolumes": [{"name": COUNTERS_CONFIGMAP, "configMap": {"name": COUNTERS_CONFIGMAP}}],
        "extraVolumeMounts": [{"name": COUNTERS_CONFIGMAP, "mountPath": COUNTERS_MOUNT, "readOnly": True}],
        "serviceMonitor": {"enabled": False},
        "affinity": common.pool_affinity(gpu_pools),
        # Also on nodes in pre-flight or quarantine: their GPU metrics are what tells why.
        "tolerations": health.node_agent_tolerations(gpu_pools),
        "resources": common.resources("100m", "256Mi", "500m", "512Mi"),
        "service": {"port": DCGM_PORT},
    }
    if driver_host_path:
        # The cloud's driver installer keeps the NVIDIA libraries on the host (platform.node_addons).
        values["extraHostVolumes"] = [{"name": "nvidia-install-dir-host", "hostPath": driver_host_path}]
        values["extraVolumeMounts"].append({"name": "nvidia-install-dir-host", "mountPath": "/usr/local/nvidia",
                                            "readOnly": True})
        values["extraEnv"] = [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}]
        # GKE hands a container the GPU device nodes only when the device plugin allocates it GPUs
        # (there is no NVIDIA runtime hook honouring NVIDIA_VISIBLE_DEVICES=all as on EKS's NVIDIA AMI),
        # and dcgm-exporter requests none, so it runs privileged to see every GPU of the node; NVIDIA's
        # GKE values for this chart do the same (https://docs.nvidia.com/datacenter/cloud-native/
        # gpu-telemetry/latest/dcgm-exporter.html). Privileged implies privilege escalation: the chart's
        # default `allowPrivilegeEscalation: false` beside `privileged: true` is refused by the API server.
        values["securityContext"] = {"privileged": True, "allowPrivilegeEscalation": True}
    return values


def dcgm_service_monitor_spec() -> dict[str, Any]:
    return {
        "jobLabel": "app.kubernetes.io/name",
        "selector": {"matchLabels": {"app.kubernetes.io/name": DCGM_RELEASE}},
        "namespaceSelector": {"matchNames": [AGENTS_NAMESPACE]},
        "endpoints": [{"port": "metrics", "interval": "15s", "path": "/metrics"}],
    }


def trainer_port_names(max_local_ranks: int) -> list[str]:
    """Container port names the training job gives its metrics ports: metrics-<local rank>."""
    return [f"metrics-{r}" for r in range(max(1, max_local_ranks))]


def trainer_pod_monitor_spec(team_namespaces: list[str], max_local_ranks: int) -> dict[str, Any]:
    """PodMonitor for the trainer: every JobSet pod in the team namespaces, one endpoint per local
    rank's port; the JobSet name is copied into a `jobset` label and the pod's node into `node`, so an
    alert or a dashboard can name the rank's node (the operator adds `pod` and `namespace` itself)."""
    relabel = [{"sourceLabels": [f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9]', '_', common.JOBSET_NAME_LABEL)}"],
                "targetLabel": "jobset"},
               {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}]
    return {
        "selector": {"matchExpressions": [{"key": common.JOBSET_NAME_LABEL, "operator": "Exists"}]},
        "namespaceSelector": {"matchNames": sorted(team_namespaces)},
        "podMetricsEndpoints": [{"port": name, "interval": "15s", "path": "/metrics", "relabelings": relabel}
                                for name in trainer_port_names(max_local_ranks)],
    }


def rule_parameters(settings: MonitoringSettings, health_settings: HealthSettings | None = None,
                    extra_namespaces: tuple[str, ...] = ()) -> dict[str, str]:
    """The values substituted for __NAME__ placeholders in infra/k8s/rules/*.yaml; `extra_namespaces` are watched by
    PlatformWorkloadUnavailable besides PLATFORM_NAMESPACES (serving's, where the stack serves models)."""
    h = health_settings or HealthSettings()
    return {
        "MAX_CONCURRENT_REPAIRS": str(h.max_concurrent_repairs),
        "XID_CONDITION": health.XID_CONDITION,
        "CLOUD_GPU_CONDITION": health.CLOUD_GPU_CONDITION,
        "FAULT_TAINT_KEY": health.FAULT_TAINT["key"],
        # A PromQL regex written without backslashes, which YAML double-quoted strings would take as escapes.
        "PREFLIGHT_CONDITION_REGEX": health.preflight_condition("gpus")[:-len("Gpus")].replace(".", "[.]") + ".*",
        "STRAGGLER_RATIO": str(STRAGGLER_RATIO),
        "LOW_UTILIZATION_PERCENT": str(settings.low_utilization_percent),
        "CHECKPOINT_MAX_AGE_SECONDS": str(settings.checkpoint_max_age_minutes * 60),
        "CHECKPOINT_MAX_AGE_MINUTES": str(settings.checkpoint_max_age_minutes),
        "TRAINER_JOB": TRAINER_JOB,
        "DCGM_JOB": DCGM_RELEASE,
        "PLATFORM_NAMESPACES": "|".join(sorted({*PLATFORM_NAMESPACES, *extra_namespaces})),
    }


def render_rules_text(text: str, params: dict[str, str], source: str) -> str:
    """Substitute __NAME__ placeholders; an unknown placeholder is an error naming the file."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in params:
            raise ValueError(f"{source}: unknown placeholder {m.group(0)} (known: {sorted(params)})")
        return params[m.group(1)]
    return _PLACEHOLDER.sub(sub, text)


def load_rule_groups(settings: MonitoringSettings, rules_dir: Path = RULES_DIR,
                     health_settings: HealthSettings | None = None,
                     extra_namespaces: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """All rule groups from rules_dir/*.yaml, rendered for these settings."""
    groups: list[dict[str, Any]] = []
    files = sorted(rules_dir.glob("*.yaml"))
    if not files:
        raise ValueError(f"no alert rule files in {rules_dir}")
    for path in files:
        doc = yaml.safe_load(render_rules_text(path.read_text(), rule_parameters(settings, health_settings,
                                                                                 extra_namespaces), str(path)))
        if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
            raise ValueError(f"{path}: expected a Prometheus rule file with a top-level 'groups' list")
        groups.extend(doc["groups"])
    names = [g["name"] for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate rule group names across {rules_dir}/*.yaml: {names}")
    return groups


def load_dashboards(dashboards_dir: Path = DASHBOARDS_DIR) -> dict[str, str]:
    """Dashboard file name -> JSON text, each checked to parse and to carry a uid and title."""
    out = {}
    for path in sorted(dashboards_dir.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if not doc.get("uid") or not doc.get("title") or not doc.get("panels"):
            raise ValueError(f"{path}: a dashboard needs uid, title and panels")
        out[path.name] = json.dumps(doc, sort_keys=True)
    if not out:
        raise ValueError(f"no dashboards in {dashboards_dir}")
    return out


def monitoring_network_policies(platform: ClusterPlatform, grafana_exposed: bool) -> list[common.Policy]:
    """Prometheus must reach every scrape target (pods, kubelets, node exporters on the node
    network), so egress inside the cluster's own ranges is open; ingress is closed except
    in-namespace, the operator's webhook, and Grafana from the VPC when exposed."""
    cluster_ranges = [platform.vpc_cidr, platform.pod_cidr]
    scrape_egress = ("allow-scrape-egress", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": c}} for c in cluster_ranges], "ports": [{"protocol": "TCP"}]},
                   {"to": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP"}]}],
    })
    policies = [
        common.default_deny(),
        common.allow_dns(),
        common.allow_same_namespace(),
        common.allow_api_server(platform.api_server_cidrs),
        common.allow_webhooks_from_api_server(platform.api_server_cidrs, [10250, 443]),
        scrape_egress,
    ]
    if grafana_exposed:
        policies.append(("allow-grafana-from-vpc", {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "grafana"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"ipBlock": {"cidr": platform.vpc_cidr}}],
                         "ports": [{"protocol": "TCP", "port": 3000}]}],
        }))
    return policies


def agents_network_policies() -> list[common.Policy]:
    """The agents' namespace: default deny, DNS, and Prometheus scraping dcgm-exporter. node-exporter
    uses the host's network, which NetworkPolicy does not govern."""
    return [common.default_deny(), common.allow_dns(), common.allow_metrics_scrape([DCGM_PORT])]


@dataclass(frozen=True, kw_only=True)
class MonitoringArgs:
    platform: ClusterPlatform  # system nodes, GPU pools, LB annotations
    settings: MonitoringSettings  # cfg.monitoring
    storage_class: str  # encrypted StorageClass for Prometheus, Alertmanager and Grafana
    team_namespaces: tuple[str, ...]  # namespaces where training jobs run (for the trainer PodMonitor)
    is_prod: bool  # replicas
    depends_on: tuple[pulumi.Resource, ...] = ()
    health: HealthSettings = field(default_factory=HealthSettings)  # cfg.health: thresholds of the health alerts
    extra_namespaces: tuple[str, ...] = ()  # more namespaces PlatformWorkloadUnavailable watches (serving's)


class Monitoring(pulumi.ComponentResource):
    """kube-prometheus-stack + dcgm-exporter + dashboards + alert rules."""

    def __init__(self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:Monitoring", name, None, opts)
        p = args.platform
        s = args.settings
        ns = naming.MONITORING_NAMESPACE
        self.namespace = common.namespace(ns, p, self, depends_on=p.ready)
        ns_deps = [self.namespace]
        self.network_policies = common.network_policies(
            ns, monitoring_network_policies(p, s.grafana_exposed), p, self, ns_deps)
        agents = AGENTS_NAMESPACE
        self.agents_namespace = common.namespace(agents, p, self, enforce="privileged", depends_on=p.ready)
        agent_deps = [self.agents_namespace]
        self.agents_network_policies = common.network_policies(agents, agents_network_policies(), p, self,
                                                               agent_deps)

        self.release = common.helm_release(
            f"{name}-kube-prometheus-stack", naming.MONITORING_RELEASE, KPS_CHART, KPS_VERSION, KPS_REPO, ns,
            values=prometheus_stack_values(
                settings=s, storage_class=args.storage_class, system_selector=dict(p.system_node_selector),
                internal_lb_annotations=dict(p.internal_lb_annotations), is_prod=args.is_prod),
            opts=common.k8s_opts(p, self, [*ns_deps, *agent_deps, *args.depends_on]))
        crd_deps = [self.release]

        self._dcgm(name, p, agent_deps)
        self._monitors(name, args, crd_deps, ns_deps)

        port_forward = grafana_url(s)
        if port_forward is not None:
            self.grafana_url: pulumi.Output[str] = pulumi.Output.from_input(port_forward)
        else:
            svc = k8s.core.v1.Service.get(
                f"{name}-grafana-service", pulumi.Output.concat(ns, "/", GRAFANA_SERVICE),
                opts=pulumi.ResourceOptions(provider=p.provider, parent=self, depends_on=[self.release]))
            self.grafana_url = svc.status.apply(_lb_url)
        self.register_outputs({"grafana_url": self.grafana_url, "labels": self.labels})

    def _dcgm(self, name: str, p: ClusterPlatform, agent_deps: list[pulumi.Resource]) -> None:
        """dcgm-exporter on the GPU nodes, with the counters CSV the dashboards read."""
        agents = AGENTS_NAMESPACE
        self.counters = k8s.core.v1.ConfigMap(
            f"{name}-dcgm-counters",
            metadata={"name": COUNTERS_CONFIGMAP, "namespace": agents},
            data={"dcgm-counters.csv": COUNTERS_CSV.read_text()},
            opts=common.k8s_opts(p, self, agent_deps))
        self.counter_fields = [r[0] for r in read_counters_csv()]
        self.dcgm = common.helm_release(
            f"{name}-dcgm-exporter", DCGM_RELEASE, DCGM_CHART, DCGM_VERSION, DCGM_REPO, agents,
            values=dcgm_values(list(p.gpu_pools), p.node_addons.driver_host_path),
            # GPU pools may be scaled to zero; PlatformWorkloadUnavailable (rules/workloads.yaml) watches it.
            skip_await=True,
            opts=common.k8s_opts(p, self, [*agent_deps, self.counters]))

    def _monitors(self, name: str, args: MonitoringArgs, crd_deps: list[pulumi.Resource],
                  ns_deps: list[pulumi.Resource]) -> None:
        """What the release's Prometheus scrapes and alerts on, and the dashboards Grafana loads."""
        p, s, ns = args.platform, args.settings, naming.MONITORING_NAMESPACE
        self.labels = labels = release_labels()
        self.dcgm_monitor = k8s.apiextensions.CustomResource(
            f"{name}-dcgm-servicemonitor",
            api_version="monitoring.coreos.com/v1", kind="ServiceMonitor",
            metadata={"name": DCGM_RELEASE, "namespace": ns, "labels": labels},
            spec=dcgm_service_monitor_spec(),
            opts=common.k8s_opts(p, self, crd_deps))
        max_ranks = max(pool.gpus_per_node for pool in p.gpu_pools)
        self.trainer_monitor = k8s.apiextensions.CustomResource(
            f"{name}-trainer-podmonitor",
            api_version="monitoring.coreos.com/v1", kind="PodMonitor",
            metadata={"name": TRAINER_MONITOR, "namespace": ns, "labels": labels},
            spec=trainer_pod_monitor_spec(list(args.team_namespaces), max_ranks),
            opts=common.k8s_opts(p, self, crd_deps))
        self.rules = k8s.apiextensions.CustomResource(
            f"{name}-rules",
            api_version="monitoring.coreos.com/v1", kind="PrometheusRule",
            metadata={"name": "gpu-train", "namespace": ns, "labels": labels},
            spec={"groups": load_rule_groups(s, health_settings=args.health, extra_namespaces=args.extra_namespaces)},
            opts=common.k8s_opts(p, self, crd_deps))
        self.dashboards = [
            k8s.core.v1.ConfigMap(
                f"{name}-dashboard-{file.removesuffix('.json')}",
                metadata={"name": f"dashboard-{file.removesuffix('.json')}", "namespace": ns,
                          "labels": dict(DASHBOARD_LABEL)},
                data={file: text},
                opts=common.k8s_opts(p, self, ns_deps))
            for file, text in load_dashboards().items()
        ]


def _lb_url(status: Any) -> str:
    ingress = ((status or {}).get("load_balancer") or (status or {}).get("loadBalancer") or {}) if isinstance(
        status, dict) else getattr(getattr(status, "load_balancer", None), "ingress", None)
    if isinstance(ingress, dict):
        ingress = ingress.get("ingress")
    if not ingress:
        return f"http://{GRAFANA_SERVICE}.{naming.MONITORING_NAMESPACE} (internal load balancer pending)"
    first = ingress[0]
    host = (first.get("hostname") or first.get("ip")) if isinstance(first, dict) else (
        getattr(first, "hostname", None) or getattr(first, "ip", None))
    return f"http://{host}"
