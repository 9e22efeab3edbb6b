"""`gpu-train serve --local`: one or two model versions on this machine behind the same weighted route as in the
cluster, and optionally the promotion loop against a Prometheus that scrapes the route.

Usage (gpu_train/cli/serve.py calls `serve_local`; needs `pip install ".[serve-local]"`):
    gpu-train serve --local runs/make-train/export --port 8000
    gpu-train serve --local models:/tiny@champion --canary models:/tiny/2 --canary-weight 10 \\
        --auto --prometheus http://127.0.0.1:9090 --steps 10,50 --step-seconds 60

A model is an exported directory (python -m trainer.export) or a registered version (`models:/NAME/VERSION`,
`models:/NAME@ALIAS`, or NAME[:VERSION|@ALIAS]), downloaded from MLflow into a cache directory. --port is bound
first: a port in use or out of range is one error before anything starts or is written. Each version runs in its
own model server process (trainer.model_server: python -m, so this command never imports torch
itself) on a port this process binds and hands it (gpu_train.serving.ports); the route runs in this process on
--port, with the same metrics as in the cluster, and is announced once it accepts requests. Two directories are
labelled versions 1 (stable) and 2 (canary). With --auto the promotion loop (gpu_train.serving.canary) reads
the route's metrics from --prometheus and moves the weights here; when the models are registered versions, the
`champion` and `challenger` aliases move in MLflow as in the cluster. Every decision is one log line and one line
of `decisions.jsonl` in the working directory (--workdir). Stop with Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from aiohttp import web

from gpu_train.jobs.serving import ServedVersion
from gpu_train.serving.canary import CanaryState, Decision, PromotionLoop
from gpu_train.serving.metrics import RouteMetrics
from gpu_train.serving.ports import PortError, bind
from gpu_train.serving.prometheus import Prometheus
from gpu_train.serving.router import Route, RouteBackend, create_app
from gpu_train.spec.serving import ModelRef, ServiceSpec

LOG = logging.getLogger("gpu_train.serving.local")
READY_TIMEOUT_S = 300.0


class LocalError(RuntimeError):
    """A model or server that cannot be used here; the message names it. `code` is the command's exit status: 2 for
    what the user gave (a model the registry does not have, a port in use), 1 for what failed."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class LocalModel:
    label: str  # as the user gave it
    path: Path  # the exported directory
    version: int
    registered: ModelRef | None = None  # the registry's model, when it is a registered version
    run_id: str = ""


def parse_model(text: str) -> ModelRef | Path:
    """An exported directory, or a registered model (models:/NAME/VERSION, models:/NAME@ALIAS, NAME[:V|@A])."""
    if Path(text).is_dir():
        return Path(text)
    if text.startswith("models:/"):
        rest = text[len("models:/"):]
        name, _, version = rest.partition("/")
        text = f"{name}:{version}" if version else name
    try:
        return ModelRef.parse(text)
    except ValueError:  # pydantic_core's PydanticCustomError, naming the form
        raise LocalError(f"{text!r} is neither a directory nor a registered model (models:/NAME/VERSION, "
                         "models:/NAME@ALIAS)") from None


def resolve(text: str, fallback_version: int, registry_factory: Callable[[], Any], cache: Path) -> LocalModel:
    found = parse_model(text)
    if isinstance(found, Path):
        return LocalModel(text, found, fallback_version)
    from gpu_train.serving.registry import RegistryError

    registry = registry_factory()
    try:
        served: ServedVersion = registry.resolve(found)
    except RegistryError as exc:
        raise LocalError(str(exc), code=2) from None
    dest = cache / found.name / str(served.version)
    path = dest / served.source.rstrip("/").rsplit("/", 1)[-1]
    if not (path / "config.json").is_file():
        LOG.info("downloading %s version %s from %s to %s", found.name, served.version, registry.uri, dest)
        dest.mkdir(parents=True, exist_ok=True)
        try:
            path = registry.download(served, dest)
        except RegistryError as exc:
            raise LocalError(str(exc)) from None
    return LocalModel(text, path, served.version, registered=found, run_id=served.run_id)


class ServerProcess:
    """One model server (python -m trainer.model_server) on a port of this machine that this process
    binds first and hands over (--fd): no other server can hold it, so /health answering is this server's."""

    def __init__(self, model: LocalModel, *, name: str, threads: int = 0,
                 inject_errors: float = 0.0, inject_delay_ms: int = 0) -> None:
        self.model = model
        try:
            sock = bind("127.0.0.1", 0, "model server port", any_port=True)
        except PortError as exc:
            raise LocalError(str(exc)) from None
        self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "trainer.model_server", "--model", str(model.path), "--name", name,
               "--version", str(model.version), "--fd", str(sock.fileno()), "--threads", str(threads)]
        if inject_errors:
            cmd += ["--inject-errors", str(inject_errors)]
        if inject_delay_ms:
            cmd += ["--inject-delay-ms", str(inject_delay_ms)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=[sock.fileno()])
        finally:
            sock.close()  # the server's copy is the one that listens
        self.http = urllib3.PoolManager(timeout=urllib3.Timeout(total=600), retries=False)

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers; a server that exits first is an error naming its model."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LocalError(f"the model server for {self.model.label} exited with status {self.proc.returncode}")
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                if self.http.request("GET", f"{self.url}/health", timeout=2).status == 200:
                    return
            time.sleep(0.2)
        raise LocalError(f"the model server for {self.model.label} did not answer on port {self.port} within "
                         f"{READY_TIMEOUT_S:.0f} s")

    def complete(self, name: str, prompt: str, max_tokens: int) -> str:
        resp = self.http.request("POST", f"{self.url}/v1/completions", json={
            "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        if resp.status != 200:
            raise LocalError(f"version {self.model.version} answered HTTP {resp.status} to the quality check")
        return resp.json()["choices"][0]["text"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LocalActions:
    """The promotion loop's actions on this machine: the in-process route's weights and the server processes."""

    def __init__(self, name: str, route: Route, servers: dict[int, ServerProcess], decisions: Path) -> None:
        self.name, self.route, self.servers, self.decisions = name, route, servers, decisions
        self.lock = threading.Lock()

    def live(self) -> list[ServerProcess]:
        with self.lock:
            return list(self.servers.values())

    def _retire(self, version: int) -> None:
        with self.lock:
            server = self.servers.pop(version)
        server.stop()

    def _backend(self, version: int, weight: int, role: str) -> RouteBackend:
        return RouteBackend(str(version), self.servers[version].url, weight, role)

    def set_canary_weight(self, state: CanaryState, percent: int) -> None:
        self.route.set([self._backend(state.stable, 100 - percent, "stable"),
                        self._backend(state.canary, percent, "canary")])

    def promote(self, state: CanaryState) -> None:
        self.route.set([self._backend(state.canary, 100, "stable")])
        self._retire(state.stable)

    def rollback(self, state: CanaryState) -> None:
        self.route.set([self._backend(state.stable, 100, "stable")])
        self._retire(state.canary)

    def record(self, state: CanaryState, decision: Decision) -> None:
        with self.decisions.open("a") as out:
            out.write(json.dumps({"service": state.service, "model": state.model, "stable": state.stable,
                                  "canary": state.canary, "action": decision.action, "reason": decision.reason,
                                  "weight": decision.weight, "at": decision.at, "metrics": decision.metrics},
                                 sort_keys=True) + "\n")

    def complete(self, version: int, prompt: str, max_tokens: int) -> str:
        return self.servers[version].complete(self.name, prompt, max_tokens)


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    port: int = 8000
    canary_weight: int = 10
    threads: int = 0
    workdir: Path = Path("runs/serve")
    canary_inject_errors: float = 0.0
    canary_inject_delay_ms: int = 0
    prometheus: str = ""  # with it, the promotion loop runs


class RouteThread(threading.Thread):
    """The route on an already bound socket, in a thread of its own, until `stop` is set. `started` is set once
    it accepts requests; a failure sets `stop` and is kept in `error`, so the command ends instead of serving
    nothing."""

    def __init__(self, app: web.Application, sock: socket.socket, stop: threading.Event) -> None:
        super().__init__(name="route", daemon=True)
        self.app, self.sock, self.stop = app, sock, stop
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        async def serve() -> None:
            runner = web.AppRunner(self.app)
            await runner.setup()
            try:
                await web.SockSite(runner, self.sock).start()
                self.started.set()
                while not self.stop.is_set():
                    await asyncio.sleep(0.2)
            finally:
                await runner.cleanup()

        try:
            asyncio.run(serve())
        except Exception as exc:  # reported by serve_local, which stops the servers
            self.error = exc
            LOG.error("the route stopped: %s", exc)
            self.stop.set()


def serve_local(spec: ServiceSpec, stable: str, canary: str | None, opts: LocalOptions,
                registry_factory: Callable[[], Any]) -> int:
    """Serve until interrupted; returns the exit status. The route's port is bound first (in use or out of range:
    LocalError, code 2, before any model is fetched or server started), and nothing is written (--workdir
    included) before the models are found."""
    try:
        route_sock = bind("127.0.0.1", opts.port, "--port")
    except PortError as exc:
        raise LocalError(str(exc), code=2) from None
    try:
        return _serve(spec, stable, canary, opts, registry_factory, route_sock)
    finally:
        route_sock.close()


def _serve(spec: ServiceSpec, stable: str, canary: str | None, opts: LocalOptions,
           registry_factory: Callable[[], Any], route_sock: socket.socket) -> int:
    cache = opts.workdir / "models"
    models = [resolve(stable, 1, registry_factory, cache)]
    if canary:
        models.append(resolve(canary, 2, registry_factory, cache))
        if models[0].version == models[1].version:
            raise LocalError(f"{stable} and {canary} are the same version ({models[0].version})", code=2)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    registered = all(m.registered is not None for m in models)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    servers: dict[int, ServerProcess] = {}
    try:
        for i, model in enumerate(models):
            servers[model.version] = ServerProcess(
                model, name=spec.name, threads=opts.threads,
                inject_errors=opts.canary_inject_errors if i else 0.0,
                inject_delay_ms=opts.canary_inject_delay_ms if i else 0)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for server in servers.values():
            server.wait_ready(deadline)
        route = Route(spec.name, [RouteBackend(str(models[0].version), servers[models[0].version].url, 100)])
        actions = LocalActions(spec.name, route, servers, opts.workdir / "decisions.jsonl")
        state = None
        if canary:
            state = CanaryState.new(spec, stable=models[0].version, canary=models[1].version,
                                    canary_run_id=models[1].run_id, now=time.time())
            actions.set_canary_weight(state, opts.canary_weight)
        thread = RouteThread(create_app(route, RouteMetrics()), route_sock, stop)
        thread.start()
        while not thread.started.wait(0.2):
            if stop.is_set() or not thread.is_alive():
                raise LocalError(f"the route did not start on port {opts.port}: {thread.error or 'interrupted'}")
        print(f"gpu-train: serving {spec.name} at http://127.0.0.1:{opts.port}/v1/completions ("
              + ", ".join(f"version {v} {w}%" for v, w in route.weights().items()) + ")", file=sys.stderr, flush=True)
        if state is not None and opts.prometheus:
            _start_loop(spec, state, actions, opts, registry_factory() if registered else None, stop)
        while not stop.is_set() and all(s.proc.poll() is None for s in actions.live()):
            stop.wait(0.5)
        if thread.error is not None:
            raise LocalError(f"the route on port {opts.port} stopped: {thread.error}")
        dead = [s for s in actions.live() if s.proc.poll() is not None]
        if dead and not stop.is_set():
            raise LocalError(f"the model server for {dead[0].model.label} exited with status {dead[0].proc.returncode}")
        return 0
    finally:
        stop.set()
        for server in list(servers.values()):
            server.stop()


def _start_loop(spec: ServiceSpec, state: CanaryState, actions: LocalActions, opts: LocalOptions, registry: Any,
                stop: threading.Event) -> None:
    if registry is None:
        LOG.info("the models are directories, not registered versions: no MLflow alias moves")
    loop = PromotionLoop(prometheus=Prometheus(opts.prometheus), selector=f'service="{spec.name}"', actions=actions,
                         registry=registry, sleep=lambda s: stop.wait(s))

    def run() -> None:
        try:
            loop.run(state)
        except Exception as exc:  # the loop's failure must not leave the servers running unobserved
            LOG.error("the promotion loop stopped: %s", exc)
            stop.set()

    threading.Thread(target=run, daemon=True).start()
    LOG.info("promotion loop started against %s; decisions in %s", opts.prometheus, actions.decisions)
