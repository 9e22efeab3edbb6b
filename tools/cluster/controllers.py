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
  out-of-cluster process needs changed: ports, certificates, no leader election. Its visibility API server (queue
  positions) listens on loopback behind upstream's APIServices; their Service is an ExternalName `localhost` with
  the server's port, which the aggregation layer dials directly (a ClusterIP would need kube-proxy). As upstream's
  APIService does, the API server does not verify that server's certificate.
- kwok manages the nodes annotated `kwok.x-k8s.io/node: fake` with upstream's stages: nodes go Ready and keep
  their lease, bound pods go Running, a pod labelled `pod-container-running-failed.stage.kwok.x-k8s.io: "true"`
  fails with the exit code of its annotation, and deleted pods go away. Pods never complete by themselves. Pod and
  node addresses are loopback ones (127.128.0.0/16, 127.0.0.1), so nothing the API server dials leaves this
  machine, and it refuses to proxy to pods and services there ("address not allowed": the pod and service proxy
  only dial global unicast addresses). kwok's own server is every node's kubelet port, so a pod's log is served
  from the file its kwok `Logs` object names (`pod_log`).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import time
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
# Kueue's visibility server reads its serving pair here whenever its own certificate management is off
# (pkg/visibility/server.go).
KUEUE_VISIBILITY_CERTS = "/visibility"
VISIBILITY_SERVICE = "visibility-server"
KWOK_LOGS = ("kwok.x-k8s.io/v1alpha1", "Logs")
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


def kueue_components() -> Path:
    return module_dir("kueue", "sigs.k8s.io/kueue") / "config" / "components"


def kueue_crds(webhook_port: int | None = None, ca_bundle: str = "") -> list[dict]:
    """Kueue's CRDs as its module ships them; with `webhook_port`, the versions its kustomization patches convert
    through its webhook on loopback (without, the API server converts by renaming the version, as a plane without
    Kueue running needs)."""
    src = kueue_components()
    out = []
    for crd in sorted((src / "crd" / "bases").glob("*.yaml")):
        doc = _docs(crd)[0]
        plural = doc["spec"]["names"]["plural"]
        if webhook_port is not None and (src / "crd" / "patches" / f"webhook_in_{plural}.yaml").exists() and any(
                f"- path: patches/webhook_in_{plural}.yaml" == line.strip()
                for line in (src / "crd" / "kustomization.yaml").read_text().splitlines()):
            doc["spec"]["conversion"] = {"strategy": "Webhook", "webhook": _loopback(
                {"clientConfig": {"service": {"path": "/convert"}}, "conversionReviewVersions": ["v1"]},
                webhook_port, ca_bundle)}
        out.append(doc)
    return out


def jobset_crds() -> list[dict]:
    """JobSet's CRD as its module ships it."""
    return _docs(module_dir("jobset", "sigs.k8s.io/jobset") / "config" / "components" / "crd" / "bases" /
                 "jobset.x-k8s.io_jobsets.yaml")


def install_kueue(plane: Plane, ports: dict[str, int], ca: Authority, ca_bundle: str) -> None:
    """Kueue's CRDs (conversion webhooks on loopback), its webhooks for the enabled integrations, and its controller
    manager with the platform's Configuration."""
    from infra.k8s.tenancy import kueue_configuration

    src = kueue_components()
    plane.apply(kueue_crds(ports["kueue-webhook"], ca_bundle))
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
        "visibilityServer": {"bindAddress": "127.0.0.1", "bindPort": ports["kueue-visibility"]},
    })
    (plane.run / "kueue.yaml").write_text(yaml.safe_dump(config))
    _fixed_place_certs(certs, KUEUE_METRICS_CERTS, "its metrics server is off, but it opens them anyway")
    _fixed_place_certs(certs, KUEUE_VISIBILITY_CERTS, "its visibility API server serves them")
    plane.apply(visibility_objects(src, ports["kueue-visibility"]))
    plane.spawn("kueue", [f"--config={plane.run / 'kueue.yaml'}", "--zap-log-level=2",
                          f"--kubeconfig={plane.admin_kubeconfig}"])


def visibility_objects(components: Path, port: int) -> list[dict]:
    """Upstream's visibility APIServices (Kueue's config/components/visibility), pointed at an ExternalName Service
    `localhost` on the visibility server's port (module docstring)."""
    src = components / "visibility"
    out: list[dict] = [{"apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": VISIBILITY_SERVICE, "namespace": "kueue-system"},
                        "spec": {"type": "ExternalName", "externalName": "localhost",
                                 "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}}]
    for path in sorted(src.glob("apiservice_*.yaml")):
        doc = _docs(path)[0]
        doc["spec"]["service"] = {"name": VISIBILITY_SERVICE, "namespace": "kueue-system", "port": port}
        out.append(doc)
    return out


def wait_for_visibility(plane: Plane, timeout_s: float = 120) -> None:
    """Wait until the aggregation layer reports every visibility APIService Available (it has reached Kueue)."""

    dyn = plane.client()
    services = dyn.resources.get(api_version="apiregistration.k8s.io/v1", kind="APIService")
    deadline = time.monotonic() + timeout_s
    while True:
        found = [s.to_dict() for s in services.get().items
                 if s.metadata.name.endswith(".visibility.kueue.x-k8s.io")]
        waiting = [s["metadata"]["name"] for s in found if not any(
            c["type"] == "Available" and c["status"] == "True" for c in (s.get("status") or {}).get("conditions", []))]
        if found and not waiting:
            dyn.resources.invalidate_cache()
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Kueue's visibility API never became available ({waiting or 'no APIService'}):\n"
                               f"{plane.log_tail('kueue')}")
        time.sleep(0.25)


def _fixed_place_certs(certs: Path, where: str, why: str) -> None:
    """Kueue 0.19 reads some certificate pairs from fixed absolute paths when its own certificate management is off
    (cmd/kueue/main.go, pkg/visibility/server.go): put a throwaway pair there once, if none is readable."""
    target = Path(where)
    if (target / "tls.crt").exists() and (target / "tls.key").exists():
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copy(certs / name, target / name)
    except OSError as e:
        raise RuntimeError(f"Kueue needs a certificate pair in {target} ({why}) and the plane cannot write it: {e}; "
                           f"create that folder writable once") from e
    print(f"local control plane: wrote a throwaway certificate pair to {target}, where Kueue reads one at start-up "
          f"({why})", file=sys.stderr)


def install_jobset(plane: Plane, ports: dict[str, int], ca: Authority, ca_bundle: str) -> None:
    """JobSet's CRD and webhooks (on loopback) and its controller manager."""
    src = module_dir("jobset", "sigs.k8s.io/jobset") / "config" / "components"
    plane.apply(jobset_crds())
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


def start_kwok(plane: Plane, ports: dict[str, int], ca: Authority) -> None:
    """kwok with upstream's stages, and its server as every node's kubelet port (module docstring)."""
    src = module_dir("kwok", "sigs.k8s.io/kwok") / "kustomize"
    plane.apply(_docs(src / "crd" / "bases" / "kwok.x-k8s.io_logs.yaml"))
    docs = [d for rel in KWOK_STAGES for d in _docs(src / "stage" / rel)]
    (plane.run / "kwok.yaml").write_text(yaml.safe_dump_all(docs))
    crt, key = ca.serving("kwok")
    plane.spawn("kwok", [f"--kubeconfig={plane.admin_kubeconfig}", "--manage-all-nodes=false",
                         f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                         "--node-lease-duration-seconds=40", "--cidr=127.128.0.1/16", "--node-ip=127.0.0.1",
                         f"--node-port={ports['kwok-server']}", f"--server-address=127.0.0.1:{ports['kwok-server']}",
                         f"--tls-cert-file={crt}", f"--tls-private-key-file={key}", "--enable-crds=Logs",
                         f"--config={plane.run / 'kwok.yaml'}"])


def pod_log(namespace: str, pod: str, container: str, text: str, log_file: Path, *, follow: bool = False) -> dict:
    """Write `text` to `log_file` in the container runtime's log format (CRI: `<RFC 3339 time> stdout F <line>`, as
    the kubelet reads it), and return the kwok `Logs` object that makes it the API server's log of `pod`'s
    `container` (kwok's server answers the kubelet's /containerLogs from that file)."""
    import datetime as dt

    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")
    log_file.write_text("".join(f"{now} stdout F {line}\n" for line in text.splitlines()))
    return {"apiVersion": KWOK_LOGS[0], "kind": KWOK_LOGS[1], "metadata": {"name": pod, "namespace": namespace},
            "spec": {"logs": [{"containers": [container], "logsFile": str(log_file), "follow": follow}]}}


def _certs(plane: Plane, name: str, ca: Authority) -> Path:
    """A webhook server's certificate directory as controller-runtime reads it (tls.crt, tls.key)."""
    crt, key = ca.serving(f"{name}-webhook")
    out = plane.run / f"{name}-certs"
    out.mkdir()
    shutil.copy(crt, out / "tls.crt")
    shutil.copy(key, out / "tls.key")
    return out
