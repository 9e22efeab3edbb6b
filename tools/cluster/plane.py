"""The local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the Kueue and JobSet
controller managers and kwok, built from upstream source at the versions tools/cluster/go/ pins and started on
127.0.0.1 the way controller-runtime's envtest starts its API server.

Usage:
    python -m tools.cluster up        # build what is missing (tools/cluster/build.sh), start, wait until ready
    python -m tools.cluster down      # stop every process and remove the run directory
    python -m tools.cluster status    # the running plane's kubeconfig and processes, exit 1 if none runs
    plane = Plane.start(); ...; plane.stop()                # the same from Python (tests/cluster/conftest.py)

What runs: etcd with `--unsafe-no-fsync` (a test store), and the API server with its own CA, serving certificate,
client certificates for the admin (`system:masters`) and each controller's own identity, a service-account key
pair, `--authorization-mode=Node,RBAC`, and its default admission plugins (Pod Security, ValidatingAdmissionPolicy,
the webhooks) and CEL; then the controller manager, the scheduler, and what tools/cluster/controllers.py starts
(Kueue, JobSet, kwok). A user is a client certificate of the plane's CA: the RBAC authorizer sees its name and
groups exactly as they would come from a cloud's authenticator.

There is no kubelet, no container runtime, no kube-proxy and no cloud: see docs/testing.md for what that leaves out.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
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

from tools.cluster import controllers
from tools.cluster.pki import Authority

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tools" / "cluster"
BIN = ROOT / "build" / "cluster" / "bin"
RUN = ROOT / "build" / "cluster" / "run"
READY_TIMEOUT_S = 180
START_ATTEMPTS = 3
SERVICE_CIDR = "10.96.0.0/16"
FRONT_PROXY_CLIENT = "front-proxy-client"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port from that range, once released, can be taken by
    any outgoing connection (the API server's own to etcd) before the component that was to listen on it starts."""
    low = _ephemeral_range()[0]
    for _ in range(200):
        port = random.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 below {low}")


def build() -> None:
    """Build the binaries (cached under build/cluster/bin; rebuilt only when a pin changes)."""
    subprocess.run(["bash", str(HERE / "build.sh")], check=True)


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, user: str, namespace: str = "default") -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": user, "context": {"cluster": "local", "user": user, "namespace": namespace}}]}


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
    def start(cls, run: Path = RUN, *, controllers: bool = True, attempt: int = 1) -> Plane:
        """Start a plane in `run`. `controllers=False` starts only etcd and the API server, as envtest does: enough
        for admission, schemas and RBAC, with nothing acting on what is stored."""
        build()
        run = run.resolve()
        if run.exists():
            stale = cls.load(run)
            if stale is not None:
                stale.stop()
            shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        ports = {name: free_port() for name in
                 ("etcd", "etcd-peer", "apiserver", "kueue-webhook", "kueue-health", "kueue-visibility",
                  "jobset-webhook", "jobset-health", "kwok-server")}
        plane = cls(run=run, server=f"https://127.0.0.1:{ports['apiserver']}")
        try:
            plane._start(ports, controllers)
        except RuntimeError as exc:
            plane.stop(keep=True)
            if "address already in use" not in str(exc) or attempt >= START_ATTEMPTS:
                raise
            print(f"local control plane: a port was taken while starting ({str(exc).splitlines()[0]}); "
                  f"starting again on other ports (attempt {attempt + 1} of {START_ATTEMPTS})", file=sys.stderr)
            return cls.start(run, controllers=controllers, attempt=attempt + 1)
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
        front_proxy = ca.client(FRONT_PROXY_CLIENT)
        self.admin_kubeconfig.write_text(yaml.safe_dump(kubeconfig(self.server, ca.cert, *admin, "admin")))
        for ident in ("system:kube-controller-manager", "system:kube-scheduler"):
            cert, key = ca.client(ident)
            (self.run / f"{ident.split(':')[-1]}.kubeconfig").write_text(
                yaml.safe_dump(kubeconfig(self.server, ca.cert, cert, key, ident)))

        self.spawn("etcd", [
            "--name=local", f"--data-dir={self.run / 'etcd'}", "--unsafe-no-fsync",
            f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-cluster=local=http://127.0.0.1:{ports['etcd-peer']}", "--log-level=warn"])
        self._wait("etcd", f"http://127.0.0.1:{ports['etcd']}/health")

        self.spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}", "--bind-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}", "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none", f"--cert-dir={self.run / 'apiserver'}",
            f"--tls-cert-file={api_cert}", f"--tls-private-key-file={api_key}", f"--client-ca-file={ca.cert}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--enable-priority-and-fairness=false", "--profiling=false",
            # The aggregation layer (Kueue's visibility API): the API server proxies as FRONT_PROXY_CLIENT and
            # the extension server trusts the user it names in these headers.
            f"--requestheader-client-ca-file={ca.cert}", f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={front_proxy[0]}", f"--proxy-client-key-file={front_proxy[1]}",
            # Pod logs: the kubelet port of a kwok node is kwok's own server, at the node's InternalIP (loopback).
            "--kubelet-preferred-address-types=InternalIP"])
        self._wait("kube-apiserver", f"{self.server}/readyz")
        if controllers:
            self._start_controllers(ports, ca, sa_key)
        (self.run / "state.json").write_text(json.dumps(
            {"server": self.server, "pids": self.pids, "ports": ports,
             "ready_s": round(time.monotonic() - t0, 1)}, indent=1))

    def _start_controllers(self, ports: dict[str, int], ca: Authority, sa_key: Path) -> None:
        self.spawn("kube-controller-manager", [
            f"--kubeconfig={self.run / 'kube-controller-manager.kubeconfig'}", "--leader-elect=false",
            "--secure-port=0", f"--service-account-private-key-file={sa_key}", f"--root-ca-file={ca.cert}",
            "--use-service-account-credentials=true", "--controllers=*,-nodeipam"])
        self.spawn("kube-scheduler", [
            f"--kubeconfig={self.run / 'kube-scheduler.kubeconfig'}", "--leader-elect=false",
            "--secure-port=0"])

        ca_bundle = base64.b64encode(ca.cert.read_bytes()).decode()
        controllers.install_kueue(self, ports, ca, ca_bundle)
        controllers.install_jobset(self, ports, ca, ca_bundle)
        controllers.start_kwok(self, ports, ca)
        self._wait("kueue", f"http://127.0.0.1:{ports['kueue-health']}/readyz")
        self._wait("jobset", f"http://127.0.0.1:{ports['jobset-health']}/readyz")
        self.wait_for_webhooks()
        controllers.wait_for_visibility(self)

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
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
              manager: str = "gpu-train-local", field_validation: str | None = None) -> list[Any]:
        """Server-side apply each object (force: this manager owns what it applies). `field_validation` is the
        request's `fieldValidation` (Strict: a field the schema does not declare is refused, not dropped)."""
        dyn = self.client(kubeconfig_path)
        out = []
        for obj in objects:
            res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            kwargs: dict[str, Any] = {"field_manager": manager, "force_conflicts": True}
            if dry_run:
                kwargs["dry_run"] = "All"
            if field_validation:
                kwargs["query_params"] = [("fieldValidation", field_validation)]
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
        for pid in reversed(list(self.pids.values())):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for pid in self.pids.values():
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                time.sleep(0.05)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        if not keep:
            shutil.rmtree(self.run, ignore_errors=True)
