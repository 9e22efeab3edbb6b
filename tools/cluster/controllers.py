"""What runs beside the API server in the local control plane: the Kueue and JobSet controller managers with their
CRDs and webhooks, and kwok, each read from its pinned Go module (tools/cluster/go) in the module cache.

Usage (tools/cluster/plane.py calls these once the API server is ready):
    install_kueue(plane, ports, ca, ca_bundle); install_jobset(plane, ports, ca, ca_bundle); start_kwok(plane)

- Kueue and JobSet run outside the cluster with their webhooks on loopback: their CRDs and webhook configurations
  are read from the modules' own `config/components` directories, every `service` client config becomes
  `url: https://127.0.0.1:PORT/PATH` with the plane's CA, Kueue's conversion webhooks included (the CRDs its
  kustomization patches); webhooks of integrations the platform's Kueue configuration does not enable are left
  out, as the chart leaves them inert.
- Kueue runs with the platform's own Configuration (infra.k8s.tenancy.kueue_configuration), with only what an
  out-of-cluster process needs changed: ports, certificates, no leader election, no visibility API server (an
  APIService needs a Service the API server can reach, and without kube-proxy it cannot).
- kwok manages the nodes annotated `kwok.x-k8s.io/node: fake` with upstream's stages: nodes go Ready and keep
  their lease, bound pods go Running, a pod labelled `pod-container-running-failed.stage.kwok.x-k8s.io: "true"`
  fails with the exit code of its annotation, and deleted pods go away. Pods never complete by themselves. Pod and
  node addresses are loopback ones (127.128.0.0/16, 127.0.0.1), so nothing the API server dials leaves this
  machine: it refuses to proxy to them ("address not allowed"), and a kubelet port it asks for logs has no server.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tools.cluster.pki import Authority

if TYPE_CHECKING:
    from tools.cluster.plane import Plane

HERE = Path(__file__).resolve().parent

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
# Upstream's stages (kwok module, kustomize/stage/...): what a simulated kubelet does with nodes and pods.
KWOK_STAGES = ("node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "pod/fast/pod-ready.yaml", "pod/fast/pod-delete.yaml",
               "pod/chaos/pod-container-running-failed.yaml")
KUEUE_METRICS_CERTS = "/etc/kueue/metrics/certs"
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
FAIL_EXIT_CODE = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"


def module_dir(module: str, path: str) -> Path:
    """Where the Go module cache holds `path` at the version tools/cluster/go/<module>/go.mod pins."""
    out = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", path], cwd=HERE / "go" / module,
                         capture_output=True, text=True, check=True).stdout.strip()
    if not out:  # not downloaded yet on this machine
        subprocess.run(["go", "mod", "download", path], cwd=HERE / "go" / module, check=True)
        return module_dir(module, path)
    return Path(out)


def _loopback(webhook_config: dict, port: int, ca_bundle: str) -> dict:
    """A webhook configuration or CRD conversion whose Service reference becomes a loopback URL."""
    client = webhook_config["clientConfig"]
    service = client.pop("service")
    client["url"] = f"https://127.0.0.1:{port}{service.get('path', '/')}"
    client["caBundle"] = ca_bundle
    return webhook_config


def _framework_rules(frameworks: list[str]) -> set[tuple[str, str]]:
    """Kueue's integration names ("batch/job", "jobset.x-k8s.io/jobset", "pod") as (API group, resource)."""
    rules = set()
    for name in frameworks:
        group, _, kind = name.rpartition("/")
        rules.add((group, kind.lower() + "s"))
    return rules


def kueue_webhooks(manifests: list[dict], frameworks: list[str], port: int, ca_bundle: str) -> list[dict]:
    """Kueue's webhook configurations for the plane: its own kinds and the enabled integrations, on loopback,
    with the namespace selector its kustomization gives the integration webhooks."""
    enabled = _framework_rules(frameworks)
    skip_system = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                         "values": ["kube-system", "kueue-system"]}]}
    out = []
    for doc in manifests:
        doc = copy.deepcopy(doc)
        kept = []
        for hook in doc.get("webhooks", []):
            pairs = {(g, r) for rule in hook["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
            own = all(g == "kueue.x-k8s.io" for g, _ in pairs)
            if not own and not pairs <= enabled:
                continue
            if not own:
                hook["namespaceSelector"] = skip_system
            kept.append(_loopback(hook, port, ca_bundle))
        doc["webhooks"] = kept
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        out.append(doc)
    return out


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def install_kueue(plane: Plane, ports: dict[str, int], ca: Authority, ca_bundle: str) -> None:
    """Kueue's CRDs (conversion webhooks on loopback), its webhooks for the enabled integrations, and its controller
    manager with the platform's Configuration."""
    from infra.k8s.tenancy import kueue_configuration

    src = module_dir("kueue", "sigs.k8s.io/kueue") / "config" / "components"
    for crd in sorted((src / "crd" / "bases").glob("*.yaml")):
        doc = _docs(crd)[0]
        plural = doc["spec"]["names"]["plural"]
        if (src / "crd" / "patches" / f"webhook_in_{plural}.yaml").exists() and any(
                f"- path: patches/webhook_in_{plural}.yaml" == line.strip()
                for line in (src / "crd" / "kustomization.yaml").read_text().splitlines()):
            doc["spec"]["conversion"] = {"strategy": "Webhook", "webhook": _loopback(
                {"clientConfig": {"service": {"path": "/convert"}}, "conversionReviewVersions": ["v1"]},
                ports["kueue-webhook"], ca_bundle)}
        plane.apply([doc])
    config = kueue_configuration()
    frameworks = config["integrations"]["frameworks"]
    plane.apply(kueue_webhooks(_docs(src / "webhook" / "manifests.yaml"), frameworks, ports["kueue-webhook"],
                              ca_bundle))
    plane.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}}])
    certs = _certs(plane, "kueue", ca)
    config.update({
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue-health']}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": ports["kueue-webhook"], "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "featureGates": {"VisibilityOnDemand": False},
    })
    (plane.run / "kueue.yaml").write_text(yaml.safe_dump(config))
    _kueue_metrics_certs(certs)
    plane.spawn("kueue", [f"--config={plane.run / 'kueue.yaml'}", "--zap-log-level=2"],
                env={"KUBECONFIG": str(plane.admin_kubeconfig)})


def _kueue_metrics_certs(certs: Path) -> None:
    """Kueue 0.19 opens KUEUE_METRICS_CERTS whenever its own certificate management is off (cmd/kueue/main.go), even
    with its metrics server off, as it is here: it needs a readable pair there, which is never served."""
    target = Path(KUEUE_METRICS_CERTS)
    if (target / "tls.crt").exists() and (target / "tls.key").exists():
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copy(certs / name, target / name)
    except OSError as e:
        raise RuntimeError(f"Kueue needs a certificate pair in {target} (its metrics server is off, but it opens them "
                           f"anyway) and the plane cannot write it: {e}; create that folder writable once") from e
    print(f"local control plane: wrote a throwaway certificate pair to {target}, where Kueue reads one at start-up",
          file=sys.stderr)


def install_jobset(plane: Plane, ports: dict[str, int], ca: Authority, ca_bundle: str) -> None:
    """JobSet's CRD and webhooks (on loopback) and its controller manager."""
    src = module_dir("jobset", "sigs.k8s.io/jobset") / "config" / "components"
    plane.apply(_docs(src / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml"))
    hooks = []
    for doc in _docs(src / "webhook" / "manifests.yaml"):
        doc["metadata"]["name"] = "jobset-" + doc["metadata"]["name"]
        doc["webhooks"] = [_loopback(h, ports["jobset-webhook"], ca_bundle) for h in doc["webhooks"]]
        hooks.append(doc)
    plane.apply(hooks)
    certs = _certs(plane, "jobset", ca)
    config = {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
              "webhook": {"port": ports["jobset-webhook"], "host": "127.0.0.1", "certDir": str(certs)},
              "metrics": {"bindAddress": "0"},
              "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['jobset-health']}"},
              "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False}}
    (plane.run / "jobset.yaml").write_text(yaml.safe_dump(config))
    plane.spawn("jobset", [f"--config={plane.run / 'jobset.yaml'}"],
                env={"KUBECONFIG": str(plane.admin_kubeconfig)})


def start_kwok(plane: Plane) -> None:
    """kwok with upstream's stages (module docstring)."""
    stages = module_dir("kwok", "sigs.k8s.io/kwok") / "kustomize" / "stage"
    docs = [d for rel in KWOK_STAGES for d in _docs(stages / rel)]
    (plane.run / "kwok.yaml").write_text(yaml.safe_dump_all(docs))
    plane.spawn("kwok", [f"--kubeconfig={plane.admin_kubeconfig}", "--manage-all-nodes=false",
                         f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                         "--node-lease-duration-seconds=40", "--cidr=127.128.0.1/16", "--node-ip=127.0.0.1",
                         f"--config={plane.run / 'kwok.yaml'}"])


def _certs(plane: Plane, name: str, ca: Authority) -> Path:
    """A webhook server's certificate directory as controller-runtime reads it (tls.crt, tls.key)."""
    crt, key = ca.serving(f"{name}-webhook")
    out = plane.run / f"{name}-certs"
    out.mkdir()
    shutil.copy(crt, out / "tls.crt")
    shutil.copy(key, out / "tls.key")
    return out
