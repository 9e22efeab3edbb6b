"""Serving, when the stack enables it: cert-manager, KServe in standard mode (no Knative), KServe's storage container
for the platform's object store, each team namespace's serving accounts, roles, promotion loop and network holes,
the routes' PodMonitor, the serving alerts and dashboard, and the stack's own services.

Usage (infra/__main__.py, with gpu-train:serving.enabled):
    serving = Serving("serving", ServingArgs(platform=platform, settings=cfg.serving, teams=cfg.teams, image=image.ref,
                                             tracking_uri=mlflow.tracking_uri, artifacts_root=mlflow.artifacts_destination,
                                             ...))
    serving.contract       # the platform contract's `serving` section (gpu_train.spec.contract.Serving)

Why cert-manager: KServe 0.20's `kserve-resources` chart always renders its webhooks' serving certificate as a
cert-manager Certificate, with the CA injected by cert-manager (charts/kserve-resources/files/kserve/resources.yaml
at v0.20.0), so KServe cannot run without it. Why standard mode: KServe's raw Deployments and Services, with no
Knative or Istio to install and keep; the weighted split between versions is the platform's route
(gpu_train/jobs/serving.py says why). Every manifest comes from a pure function here or from the one serving
renderer (gpu_train.jobs.serving, gpu_train.jobs.serving_platform); this component only turns them into resources.
docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from gpu_train.jobs.serving import (
    KSERVE_API,
    Backend,
    ServedVersion,
    ServingPlacement,
    inference_service,
    route_document,
    route_objects,
    storage_container,
)
from gpu_train.jobs.serving_platform import team_serving_objects
from gpu_train.spec import naming
from gpu_train.spec.contract import Serving as ServingContract
from gpu_train.spec.serving import KSERVE_VERSION, RUNTIME_IMAGES, STORAGE_INITIALIZER_IMAGE
from gpu_train.spec.settings import ServingSettings
from infra.k8s import common
from infra.k8s.monitoring import load_dashboards, release_labels, render_rules_text
from infra.platform import ClusterPlatform

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules" / "serving" / "serving.yaml"
DASHBOARDS = HERE / "dashboards" / "serving"
# https://cert-manager.io/docs/installation/helm/ (chart repository charts.jetstack.io; v1.21.1 is the newest
# release of github.com/cert-manager/cert-manager)
CERT_MANAGER_NAMESPACE = "cert-manager"
CERT_MANAGER_REPO = "https://charts.jetstack.io"
CERT_MANAGER_CHART = "cert-manager"
CERT_MANAGER_VERSION = "v1.21.1"
CERT_MANAGER_WEBHOOK_PORT = 10250  # the chart's webhook.securePort
# https://kserve.github.io/website/docs/admin-guide/kubernetes-deployment (Helm, OCI charts at ghcr.io)
KSERVE_NAMESPACE = naming.KSERVE_NAMESPACE
KSERVE_CRD_CHART = "oci://ghcr.io/kserve/charts/kserve-crd"
KSERVE_CHART = "oci://ghcr.io/kserve/charts/kserve-resources"
KSERVE_WEBHOOK_PORT = 9443
KSERVE_METRICS_PORT = 8443  # the controller's kube-rbac-proxy
ROUTES_MONITOR = "serving-routes"
ROUTES_JOB = f"{naming.MONITORING_NAMESPACE}/{ROUTES_MONITOR}"
PROMETHEUS_URL = (f"http://{naming.MONITORING_RELEASE}-prometheus.{naming.MONITORING_NAMESPACE}.svc.cluster.local"
                  ":9090")
# Namespaces this component installs workloads into (PlatformWorkloadUnavailable watches them too).
NAMESPACES = (CERT_MANAGER_NAMESPACE, KSERVE_NAMESPACE)


def cert_manager_values(system_selector: Mapping[str, str]) -> dict[str, Any]:
    """Values for cert-manager (deploy/charts/cert-manager/values.yaml at v1.21.1): its CRDs from the chart and
    kept on uninstall, every component on the system nodes; the chart's own security contexts (non-root, no
    capabilities, RuntimeDefault seccomp) meet Pod Security `restricted`."""
    sel = dict(system_selector)
    return {
        "crds": {"enabled": True, "keep": True},
        "nodeSelector": sel,
        "resources": common.resources("50m", "128Mi", "500m", "256Mi"),
        "webhook": {"nodeSelector": sel, "resources": common.resources("20m", "64Mi", "200m", "128Mi")},
        "cainjector": {"nodeSelector": sel, "resources": common.resources("20m", "128Mi", "200m", "256Mi")},
        "startupapicheck": {"nodeSelector": sel, "resources": common.resources("10m", "32Mi", "100m", "64Mi")},
    }


def kserve_values(system_selector: Mapping[str, str]) -> dict[str, Any]:
    """Values for kserve-resources (charts/kserve-resources/values.yaml at v0.20.0): standard mode, no ingress of
    its own (clients reach a service through its route), no API token in predictor pods, and the storage
    initializer pinned as gpu_train.spec.serving pins it."""
    image, tag = STORAGE_INITIALIZER_IMAGE.rsplit(":", 1)
    return {"kserve": {
        "controller": {
            "deploymentMode": "Standard",
            "nodeSelector": dict(system_selector),
            "gateway": {"disableIngressCreation": True},
            "resources": common.resources("100m", "300Mi", "500m", "512Mi"),
        },
        "storage": {"image": image, "tag": tag},
        "security": {"autoMountServiceAccountToken": False},
    }}


def controller_policies(platform: ClusterPlatform, webhook_port: int, metrics_ports: Sequence[int]) -> list[common.Policy]:
    """cert-manager's and KServe's namespaces: DNS, the API server, their webhooks from the control plane, metrics."""
    return [common.default_deny(), common.allow_dns(), common.allow_api_server(platform.api_server_cidrs),
            common.allow_webhooks_from_api_server(platform.api_server_cidrs, [webhook_port]),
            common.allow_metrics_scrape(list(metrics_ports))]


def _role(role: str) -> dict[str, Any]:
    return {"matchLabels": {naming.SERVING_ROLE_LABEL: role}}


def _port(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def team_policies(platform: ClusterPlatform) -> list[common.Policy]:
    """The holes serving needs in a team namespace's default deny: clients in the namespace reach the routes,
    Prometheus scrapes them; routes and the promotion loop reach the predictors and the API server; the control
    plane reaches the predictors (the quality check's service proxy); the loop reaches Prometheus."""
    api = [{"ipBlock": {"cidr": c}} for c in platform.api_server_cidrs]
    monitoring = {"namespaceSelector": {"matchLabels": {common.NS_NAME_LABEL: naming.MONITORING_NAMESPACE}}}
    server = int(naming.ROUTE_PORT)
    return [
        ("allow-serving-models", {
            "podSelector": _role("model"), "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": _role("router")}, {"podSelector": _role("promoter")}, *api],
                         "ports": _port(server)}]}),
        ("allow-serving-routes", {
            "podSelector": _role("router"), "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {}}, monitoring], "ports": _port(naming.ROUTE_PORT)}],
            "egress": [{"to": [{"podSelector": _role("model")}], "ports": _port(server)},
                       {"to": api, "ports": _port(443)}]}),
        ("allow-serving-promoter", {
            "podSelector": _role("promoter"), "policyTypes": ["Egress"],
            "egress": [{"to": api, "ports": _port(443)},
                       {"to": [{**monitoring, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
                        "ports": _port(9090)}]}),
    ]


def prometheus_from_promoters() -> common.Policy:
    """In the monitoring namespace: the team namespaces' promotion loops may query Prometheus."""
    return ("allow-prometheus-from-promoters", {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [
            {"key": naming.TEAM_LABEL, "operator": "Exists"}]}, "podSelector": _role("promoter")}],
            "ports": _port(9090)}]})


def routes_pod_monitor_spec(team_namespaces: Sequence[str], interval_s: int) -> dict[str, Any]:
    return {"selector": _role("router"), "namespaceSelector": {"matchNames": sorted(team_namespaces)},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": f"{interval_s}s"}]}


def rule_parameters(settings: ServingSettings) -> dict[str, str]:
    return {"LATENCY_ALERT_SECONDS": f"{settings.latency_alert_ms / 1000:g}",
            "LATENCY_ALERT_MS": str(settings.latency_alert_ms),
            "ERROR_RATE_ALERT": f"{settings.error_rate_alert:g}",
            "ERROR_RATE_PERCENT": f"{settings.error_rate_alert * 100:g}", "ROUTES_JOB": ROUTES_JOB}


def rule_groups(settings: ServingSettings, path: Path = RULES) -> list[dict[str, Any]]:
    return yaml.safe_load(render_rules_text(path.read_text(), rule_parameters(settings), str(path)))["groups"]


def contract_section(platform: ClusterPlatform, settings: ServingSettings, artifacts_root: str) -> dict[str, Any]:
    return ServingContract(
        kserve_version=KSERVE_VERSION, runtime_images=dict(RUNTIME_IMAGES), artifacts_root=artifacts_root,
        cpu_node_selector=dict(platform.system_node_selector), gpu_pools=list(settings.gpu_pools),
        prometheus=PROMETHEUS_URL, scrape_interval_seconds=settings.scrape_interval_seconds).document()


@dataclass(frozen=True, kw_only=True)
class ServingArgs:
    platform: ClusterPlatform  # provider, system nodes, pools, identities, CIDRs, pod env
    settings: ServingSettings  # cfg.serving
    teams: Sequence[str]  # every team namespace gets its serving accounts and promotion loop
    image: pulumi.Input[str]  # the platform image (digest-pinned): routes and promotion loops run it
    tracking_uri: pulumi.Input[str]  # MLflow, for the promotion loops' aliases
    artifacts_root: pulumi.Input[str]  # MLflow's artifacts destination: where versions' files are
    depends_on: Sequence[pulumi.Resource] = ()  # the team namespaces, monitoring (CRDs), MLflow


class Serving(pulumi.ComponentResource):
    contract: pulumi.Output[dict]

    def __init__(self, name: str, args: ServingArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:Serving", name, None, opts)
        p, s = args.platform, args.settings
        self._platform = p
        base = [*p.ready, *args.depends_on]
        system = dict(p.system_node_selector)
        releases = {}
        for ns_name, (chart, version, repo, values, webhook, metrics) in {
            CERT_MANAGER_NAMESPACE: (CERT_MANAGER_CHART, CERT_MANAGER_VERSION, CERT_MANAGER_REPO,
                                     cert_manager_values(system), CERT_MANAGER_WEBHOOK_PORT, (9402,)),
            KSERVE_NAMESPACE: (KSERVE_CHART, KSERVE_VERSION, None, kserve_values(system), KSERVE_WEBHOOK_PORT,
                               (KSERVE_METRICS_PORT,)),
        }.items():
            ns = common.namespace(ns_name, p, self, enforce="restricted", depends_on=base)
            common.network_policies(ns_name, controller_policies(p, webhook, metrics), p, self, [ns])
            after = [ns, *releases.values()]
            if ns_name == KSERVE_NAMESPACE:
                releases["kserve-crd"] = k8s.helm.v3.Release(
                    f"{name}-kserve-crd", name="kserve-crd", chart=KSERVE_CRD_CHART, version=KSERVE_VERSION,
                    namespace=ns_name, opts=common.k8s_opts(p, self, after))
                after.append(releases["kserve-crd"])
            short = "kserve" if ns_name == KSERVE_NAMESPACE else ns_name
            releases[short] = common.helm_release(f"{name}-{short}", short, chart, version, repo, ns_name,
                                                  values=values, opts=common.k8s_opts(p, self, after))
        self.releases = releases
        kserve = [releases["kserve-crd"], releases["kserve"]]

        self.storage_container = self._resource(name, storage_container(p.pod_env), kserve)

        labels = release_labels()
        team_namespaces = [naming.team_namespace(t) for t in args.teams]
        self._resource(name, {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": ROUTES_MONITOR, "namespace": naming.MONITORING_NAMESPACE, "labels": labels},
            "spec": routes_pod_monitor_spec(team_namespaces, s.scrape_interval_seconds)}, base)
        self._resource(name, {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "gpu-train-serving", "namespace": naming.MONITORING_NAMESPACE, "labels": labels},
            "spec": {"groups": rule_groups(s)}}, base)
        for file, text in load_dashboards(DASHBOARDS).items():
            k8s.core.v1.ConfigMap(
                f"{name}-dashboard-{file.removesuffix('.json')}",
                metadata={"name": f"dashboard-{file.removesuffix('.json')}", "namespace": naming.MONITORING_NAMESPACE,
                          "labels": {"grafana_dashboard": "1"}},
                data={file: text}, opts=common.k8s_opts(p, self, base))

        self.team_objects: dict[str, list[pulumi.Resource]] = {}
        for team, ns in zip(args.teams, team_namespaces, strict=True):
            identity = p.identities.get(f"serving/{team}")
            if identity is None or identity.name != naming.MODEL_SERVER_SERVICE_ACCOUNT or ns not in identity.namespaces:
                raise ValueError(f"platform.identities has no serving/{team} identity for {ns}/"
                                 f"{naming.MODEL_SERVER_SERVICE_ACCOUNT}: the cloud layer binds one per team when "
                                 "serving is enabled")
            common.network_policy_holes(ns, team_policies(p), p, self, base)
            objects = team_serving_objects(ns, image=args.image, cpu_node_selector=system, prometheus=PROMETHEUS_URL,
                                           tracking_uri=args.tracking_uri,
                                           identity_annotations=dict(identity.annotations))
            self.team_objects[team] = [self._resource(f"{name}-{ns}", obj, [*base, *kserve]) for obj in objects]
        common.network_policy_holes(naming.MONITORING_NAMESPACE, [prometheus_from_promoters()], p, self, base)

        artifacts = pulumi.Output.from_input(args.artifacts_root)
        self.services = [self._service(name, spec, args, artifacts, [*kserve, *self.team_objects[spec.team]])
                         for spec in s.services]
        self.contract = artifacts.apply(lambda root: contract_section(p, s, root))
        self.register_outputs({"contract": self.contract, "kserveVersion": KSERVE_VERSION})

    def _opts(self, after: Sequence[pulumi.Resource]) -> pulumi.ResourceOptions:
        return common.k8s_opts(self._platform, self, after)

    def _resource(self, prefix: str, obj: Mapping[str, Any], after: Sequence[pulumi.Resource]) -> pulumi.Resource:
        """One rendered object as its typed resource (custom resources as CustomResource)."""
        kind, meta, opts = obj["kind"], obj["metadata"], self._opts(after)
        name = f"{prefix}-{kind.lower()}-{meta['name']}"
        if kind == "ServiceAccount":
            return k8s.core.v1.ServiceAccount(name, metadata=meta, opts=opts,
                                              automount_service_account_token=obj["automountServiceAccountToken"])
        if kind == "Role":
            return k8s.rbac.v1.Role(name, metadata=meta, rules=obj["rules"], opts=opts)
        if kind == "RoleBinding":
            return k8s.rbac.v1.RoleBinding(name, metadata=meta, role_ref=obj["roleRef"], subjects=obj["subjects"],
                                           opts=opts)
        if kind == "Deployment":
            return k8s.apps.v1.Deployment(name, metadata=meta, spec=obj["spec"], opts=opts)
        if kind == "Service":
            return k8s.core.v1.Service(name, metadata=meta, spec=obj["spec"], opts=opts)
        if kind == "ConfigMap":
            return k8s.core.v1.ConfigMap(name, metadata=meta, data=obj["data"], opts=opts)
        return k8s.apiextensions.CustomResource(name, api_version=obj["apiVersion"], kind=kind, metadata=meta,
                                                spec=obj["spec"], opts=opts)

    def _service(self, prefix: str, spec: Any, args: ServingArgs, artifacts: pulumi.Output[str],
                 after: Sequence[pulumi.Resource]) -> list[pulumi.Resource]:
        """A service of the stack: its pinned version's InferenceService and its route, all traffic to it."""
        p = args.platform
        version = ServedVersion(spec.model.version, spec.run_id, spec.source)

        def where(root: str) -> ServingPlacement:
            return ServingPlacement(namespace=naming.team_namespace(spec.team), pool=p.pool(spec.pool) if spec.pool
                                    else None, cpu_node_selector=dict(p.system_node_selector), artifacts_root=root,
                                    image=args.image, prometheus=PROMETHEUS_URL, pod_env=dict(p.pod_env))

        isvc = artifacts.apply(lambda root: inference_service(spec, version, where(root)))
        ns = naming.team_namespace(spec.team)
        out = [k8s.apiextensions.CustomResource(
            f"{prefix}-{ns}-inferenceservice-{naming.version_name(spec.name, version.version)}",
            api_version=KSERVE_API, kind="InferenceService", metadata=isvc.apply(lambda o: o["metadata"]),
            spec=isvc.apply(lambda o: o["spec"]), opts=self._opts(after))]
        route = route_document(spec, [Backend(version.version, 100, "stable", version.run_id)], ns)
        out += [self._resource(f"{prefix}-{ns}", obj, after) for obj in route_objects(spec, route, where(""))]
        return out

