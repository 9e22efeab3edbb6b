"""The local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the Kueue and JobSet
controller managers and kwok, built from upstream source at the versions tools/cluster/go/ pins and started on
127.0.0.1 the way controller-runtime's envtest starts its API server.

Usage:
    python -m tools.cluster up        # build what is missing (tools/cluster/build.sh), start, wait until ready
    python -m tools.cluster down      # stop every process and remove the run directory
    python -m tools.cluster status    # the running plane's kubeconfig and processes, exit 1 if none runs
    plane = Plane.start(); ...; plane.stop()                # the same from Python (tests/cluster/conftest.py)

What runs, and how it is wired:
- etcd with `--unsafe-no-fsync` (a test store), and the API server with its own CA, serving certificate, client
  certificates for the admin (`system:masters`) and each controller's own identity, a service-account key pair,
  `--authorization-mode=Node,RBAC`, and its default admission plugins (Pod Security, ValidatingAdmissionPolicy,
  the webhooks) and CEL;
- Kueue and JobSet run outside the cluster with their webhooks on loopback: their CRDs and webhook configurations
  are read from the pinned modules' own `config/components` directories, every `service` client config becomes
  `url: https://127.0.0.1:PORT/PATH` with the plane's CA, Kueue's conversion webhooks included; webhooks of
  integrations the platform's Kueue configuration does not enable are left out, as the chart leaves them inert;
- Kueue runs with the platform's own Configuration (infra.k8s.tenancy.kueue_configuration), with only what an
  out-of-cluster process needs changed (ports, certificates, no leader election, no visibility server);
- kwok manages the nodes annotated `kwok.x-k8s.io/node: fake` with upstream's stages: nodes go Ready and keep
  their lease, bound pods go Running, a pod labelled `pod-container-running-failed.stage.kwok.x-k8s.io: "true"`
  fails with the exit code of its annotation, and deleted pods go away. Pods never complete by themselves.

There is no kubelet, no container runtime, no kube-proxy and no cloud: see docs/testing.md for what that leaves out.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tools.cluster.pki import Authority

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tools" / "cluster"
BIN = ROOT / "build" / "cluster" / "bin"
RUN = ROOT / "build" / "cluster" / "run"
READY_TIMEOUT_S = 180
SERVICE_CIDR = "10.96.0.0/16"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
# Upstream's stages (kwok module, kustomize/stage/...): what a simulated kubelet does with nodes and pods.
KWOK_STAGES = ("node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "pod/fast/pod-ready.yaml", "pod/fast/pod-delete.yaml",
               "pod/chaos/pod-container-running-failed.yaml")
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
FAIL_EXIT_CODE = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def module_dir(module: str, path: str) -> Path:
    """Where the Go module cache holds `path` at the version tools/cluster/go/<module>/go.mod pins."""
    out = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", path], cwd=HERE / "go" / module,
                         capture_output=True, text=True, check=True).stdout.strip()
    if not out:  # not downloaded yet on this machine
        subprocess.run(["go", "mod", "download", path], cwd=HERE / "go" / module, check=True)
        return module_dir(module, path)
    return Path(out)


def build() -> None:
    """Build the binaries (cached under build/cluster/bin; rebuilt only when a pin changes)."""
    subprocess.run(["bash", str(HERE / "build.sh")], check=True)


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, user: str, namespace: str = "default") -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": user, "context": {"cluster": "local", "user": user, "namespace": namespace}}]}


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


@dataclass
class Plane:
    """A running plane: where its files are and which processes are its own (state.json in `run`)."""

    run: Path
    server: str
    pids: dict[str, int] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    # -- paths ---------------------------------------------------------------------------------------------
    @property
    def admin_kubeconfig(self) -> Path:
        return self.run / "admin.kubeconfig"

    @property
    def ca(self) -> Authority:
        return Authority(self.run / "pki")

    def user_kubeconfig(self, user: str, groups: tuple[str, ...] = (), namespace: str = "default") -> Path:
        """A kubeconfig for `user` in `groups`, authenticated by a client certificate of the plane's CA: the
        RBAC authorizer sees exactly that user and those groups (and system:authenticated)."""
        cert, key = self.ca.client(user, groups)
        path = self.run / f"user-{user.replace(':', '_')}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.ca.cert, cert, key, user, namespace)))
        return path

    # -- life cycle ----------------------------------------------------------------------------------------
    @classmethod
    def start(cls, run: Path = RUN, *, controllers: bool = True) -> Plane:
        """Start a plane in `run`. `controllers=False` starts only etcd and the API server, as envtest does: enough
        for admission, schemas and RBAC, with nothing acting on what is stored."""
        build()
        if run.exists():
            stale = cls.load(run)
            if stale is not None:
                stale.stop()
            shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        ports = {name: free_port() for name in
                 ("etcd", "etcd-peer", "apiserver", "kueue-webhook", "kueue-health", "jobset-webhook",
                  "jobset-health")}
        plane = cls(run=run, server=f"https://127.0.0.1:{ports['apiserver']}")
        try:
            plane._start(ports, controllers)
        except BaseException:
            plane.stop(keep=True)
            raise
        return plane

    def _start(self, ports: dict[str, int], controllers: bool) -> None:
        t0 = time.monotonic()
        ca = Authority.create(self.run / "pki")
        api_cert, api_key = ca.serving("apiserver")
        sa_pub, sa_key = ca.service_account_keys()
        admin = ca.client("admin", ("system:masters",))
        self.admin_kubeconfig.write_text(yaml.safe_dump(kubeconfig(self.server, ca.cert, *admin, "admin")))
        for ident in ("system:kube-controller-manager", "system:kube-scheduler"):
            cert, key = ca.client(ident)
            (self.run / f"{ident.split(':')[-1]}.kubeconfig").write_text(
                yaml.safe_dump(kubeconfig(self.server, ca.cert, cert, key, ident)))

        self._spawn("etcd", [
            "--name=local", f"--data-dir={self.run / 'etcd'}", "--unsafe-no-fsync",
            f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-cluster=local=http://127.0.0.1:{ports['etcd-peer']}", "--log-level=warn"])
        self._wait("etcd", f"http://127.0.0.1:{ports['etcd']}/health")

        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}", "--bind-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}", "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none", f"--cert-dir={self.run / 'apiserver'}",
            f"--tls-cert-file={api_cert}", f"--tls-private-key-file={api_key}", f"--client-ca-file={ca.cert}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--enable-priority-and-fairness=false", "--profiling=false"])
        self._wait("kube-apiserver", f"{self.server}/readyz")
        if controllers:
            self._start_controllers(ports, ca, sa_key)
        (self.run / "state.json").write_text(json.dumps(
            {"server": self.server, "pids": self.pids, "ports": ports,
             "ready_s": round(time.monotonic() - t0, 1)}, indent=1))

    def _start_controllers(self, ports: dict[str, int], ca: Authority, sa_key: Path) -> None:
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={self.run / 'kube-controller-manager.kubeconfig'}", "--leader-elect=false",
            "--secure-port=0", f"--service-account-private-key-file={sa_key}", f"--root-ca-file={ca.cert}",
            "--use-service-account-credentials=false", "--controllers=*,-nodeipam"])
        self._spawn("kube-scheduler", [
            f"--kubeconfig={self.run / 'kube-scheduler.kubeconfig'}", "--leader-elect=false",
            "--secure-port=0"])

        ca_bundle = base64.b64encode(ca.cert.read_bytes()).decode()
        self._install_kueue(ports, ca, ca_bundle)
        self._install_jobset(ports, ca, ca_bundle)
        self._start_kwok()
        self._wait("kueue", f"http://127.0.0.1:{ports['kueue-health']}/readyz")
        self._wait("jobset", f"http://127.0.0.1:{ports['jobset-health']}/readyz")
        self.wait_for_webhooks()

    def _install_kueue(self, ports: dict[str, int], ca: Authority, ca_bundle: str) -> None:
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
            self.apply([doc])
        config = kueue_configuration()
        frameworks = config["integrations"]["frameworks"]
        self.apply(kueue_webhooks(_docs(src / "webhook" / "manifests.yaml"), frameworks, ports["kueue-webhook"],
                                  ca_bundle))
        self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}}])
        certs = self._certs("kueue", ca)
        config.update({
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue-health']}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": ports["kueue-webhook"], "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "featureGates": {"VisibilityOnDemand": False},
        })
        (self.run / "kueue.yaml").write_text(yaml.safe_dump(config))
        self._spawn("kueue", [f"--config={self.run / 'kueue.yaml'}", "--zap-log-level=2"],
                    env={"KUBECONFIG": str(self.admin_kubeconfig)})

    def _install_jobset(self, ports: dict[str, int], ca: Authority, ca_bundle: str) -> None:
        src = module_dir("jobset", "sigs.k8s.io/jobset") / "config" / "components"
        self.apply(_docs(src / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml"))
        hooks = []
        for doc in _docs(src / "webhook" / "manifests.yaml"):
            doc["metadata"]["name"] = "jobset-" + doc["metadata"]["name"]
            doc["webhooks"] = [_loopback(h, ports["jobset-webhook"], ca_bundle) for h in doc["webhooks"]]
            hooks.append(doc)
        self.apply(hooks)
        certs = self._certs("jobset", ca)
        config = {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
                  "webhook": {"port": ports["jobset-webhook"], "host": "127.0.0.1", "certDir": str(certs)},
                  "metrics": {"bindAddress": "0"},
                  "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['jobset-health']}"},
                  "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False}}
        (self.run / "jobset.yaml").write_text(yaml.safe_dump(config))
        self._spawn("jobset", [f"--config={self.run / 'jobset.yaml'}"],
                    env={"KUBECONFIG": str(self.admin_kubeconfig)})

    def _start_kwok(self) -> None:
        stages = module_dir("kwok", "sigs.k8s.io/kwok") / "kustomize" / "stage"
        docs = [d for rel in KWOK_STAGES for d in _docs(stages / rel)]
        (self.run / "kwok.yaml").write_text(yaml.safe_dump_all(docs))
        self._spawn("kwok", [f"--kubeconfig={self.admin_kubeconfig}", "--manage-all-nodes=false",
                             f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                             "--node-lease-duration-seconds=40", "--cidr=10.244.0.1/16", "--node-ip=10.0.0.1",
                             f"--config={self.run / 'kwok.yaml'}"])

    def _certs(self, name: str, ca: Authority) -> Path:
        """A webhook server's certificate directory as controller-runtime reads it (tls.crt, tls.key)."""
        crt, key = ca.serving(f"{name}-webhook")
        out = self.run / f"{name}-certs"
        out.mkdir()
        shutil.copy(crt, out / "tls.crt")
        shutil.copy(key, out / "tls.key")
        return out

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.run / f"{name}.log").open("ab")
        proc = subprocess.Popen([str(BIN / ("etcd" if name == "etcd" else name)), *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})
        self.pids[name] = proc.pid
        self._procs[name] = proc

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca.cert))
        ctx.load_cert_chain(self.ca.dir / "client-admin.crt", self.ca.dir / "client-admin.key")
        return ctx

    def _wait(self, name: str, url: str) -> None:
        """Wait until `url` answers 200 (the component's own readiness endpoint), or fail with its log's tail."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        ctx = self._ssl() if url.startswith("https") else None
        while True:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while starting:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready at {url} after {READY_TIMEOUT_S} s:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def wait_for_webhooks(self) -> None:
        """Kueue's and JobSet's webhooks fail closed: wait until a server-side dry run through each one passes."""
        probes = [
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}},
            {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
             "metadata": {"name": "probe", "namespace": "default"},
             "spec": {"replicatedJobs": [{"name": "w", "replicas": 1, "template": {"spec": {"template": {"spec": {
                 "restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}}}}]}},
        ]
        deadline = time.monotonic() + READY_TIMEOUT_S
        for obj in probes:
            while True:
                try:
                    self.apply([obj], dry_run=True)
                    break
                except Exception as e:  # noqa: BLE001 - a webhook not yet serving answers with an API error
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the webhooks for {obj['kind']} never answered: {e}") from e
                    time.sleep(0.5)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.run / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # -- the API -------------------------------------------------------------------------------------------
    def client(self, kubeconfig_path: Path | None = None):
        """A kubernetes.dynamic.DynamicClient for the admin, or for the user of `kubeconfig_path` (one per
        kubeconfig: each keeps its discovery cache)."""
        from kubernetes import config as kconfig
        from kubernetes import dynamic

        path = str(kubeconfig_path or self.admin_kubeconfig)
        if path not in self._clients:
            self._clients[path] = dynamic.DynamicClient(kconfig.new_client_from_config(path))
        return self._clients[path]

    def apply(self, objects: list[dict], *, dry_run: bool = False, kubeconfig_path: Path | None = None,
              manager: str = "gpu-train-local") -> list[Any]:
        """Server-side apply each object (force: this manager owns what it applies)."""
        dyn = self.client(kubeconfig_path)
        out = []
        for obj in objects:
            res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            kwargs = {"field_manager": manager, "force_conflicts": True}
            if dry_run:
                kwargs["dry_run"] = "All"
            ns = obj["metadata"].get("namespace") if res.namespaced else None
            out.append(res.server_side_apply(body=obj, namespace=ns, **kwargs))
            if obj["kind"] == "CustomResourceDefinition" and not dry_run:
                self._wait_established(dyn, obj["metadata"]["name"])
        return out

    def add_nodes(self, nodes: list[dict]) -> None:
        """Create kwok nodes, then give each its capacity through the status subresource (which an apply of the
        object itself does not write); kwok keeps what is there when it marks the node Ready."""
        from kubernetes import client as kclient
        from kubernetes import config as kconfig

        core = kclient.CoreV1Api(kconfig.new_client_from_config(str(self.admin_kubeconfig)))
        for node in nodes:
            self.apply([{k: v for k, v in node.items() if k != "status"}])
            core.patch_node_status(node["metadata"]["name"], {"status": node["status"]})

    def _wait_established(self, dyn, name: str) -> None:
        crds = dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            conds = crds.get(name=name).to_dict().get("status", {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                dyn.resources.invalidate_cache()
                return
            time.sleep(0.1)
        raise RuntimeError(f"CRD {name} not Established after 60 s")

    # -- state ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, run: Path = RUN) -> Plane | None:
        state = run / "state.json"
        if not state.exists():
            return None
        doc = json.loads(state.read_text())
        return cls(run=run, server=doc["server"], pids=doc["pids"])

    def alive(self) -> dict[str, bool]:
        out = {}
        for name, pid in self.pids.items():
            try:
                os.kill(pid, 0)
                out[name] = True
            except ProcessLookupError:
                out[name] = False
        return out

    def stop(self, keep: bool = False) -> None:
        """Stop every process of the plane (its process group), then remove the run directory unless `keep`."""
        for name, pid in reversed(list(self.pids.items())):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 20
        for pid in self.pids.values():
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                time.sleep(0.05)
            else:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not keep:
            shutil.rmtree(self.run, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    cmd = (argv if argv is not None else sys.argv[1:]) or ["status"]
    if cmd[0] == "up":
        plane = Plane.start()
        state = json.loads((plane.run / "state.json").read_text())
        print(f"local control plane ready in {state['ready_s']} s at {plane.server}")
        print(f"export KUBECONFIG={plane.admin_kubeconfig}")
        return 0
    if cmd[0] == "down":
        plane = Plane.load()
        if plane is None:
            print("no local control plane runs")
            return 0
        plane.stop()
        print("local control plane stopped")
        return 0
    if cmd[0] == "status":
        plane = Plane.load()
        if plane is None:
            print("no local control plane runs")
            return 1
        print(f"{plane.server}  KUBECONFIG={plane.admin_kubeconfig}")
        for name, up in plane.alive().items():
            print(f"  {name:24} {'running' if up else 'EXITED'}")
        return 0 if all(plane.alive().values()) else 1
    print("usage: python -m tools.cluster up|down|status", file=sys.stderr)
    return 2
