"""A service's route: sends each inference request to one version of the model by weight, and meters what clients
see (requests by version and status code, latency by version) for Prometheus.

Run (the route's Deployment runs this; `gpu-train serve --local` runs the same Route in its own process):
    python -m gpu_train.serving.router --service chat --namespace team-research --config-map chat-route --port 8080

Routes: POST /v1/completions and /v1/chat/completions (and KServe's /openai/v1/... spellings) go to a version
picked by weight, at its /openai/v1/... path; other /v1/... and /openai/v1/... requests (the model list) go to the
stable version and are not metered; GET /health; GET /metrics (the series of gpu_train.serving.metrics, and each
version's weight). Answers carry `x-gpu-train-model-version`. A
version that cannot be reached answers 502 (504 after the timeout), metered against that version.

Weights: smooth weighted round robin (nginx's upstream algorithm), so every run of 100 requests splits exactly by
the percentages, without the streaks a random draw has. In the cluster the weights and versions come from the
service's route ConfigMap (`route.json`, written by `gpu-train serve` and the promotion loop), read through the
Kubernetes API every `--poll-seconds` (default 1): a rollback reaches every replica within that.

Hand-written on aiohttp (server and client in one library): the proxy is one handler, and its metering is the
point of it. A general proxy (Envoy, a Gateway implementation) would add a component the platform does not run
and metrics in another shape per implementation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from gpu_train.serving.metrics import CONTENT_TYPE, RouteMetrics
from gpu_train.serving.ports import PortError, bind

LOG = logging.getLogger("gpu_train.serving.router")
INFERENCE = ("completions", "chat/completions")
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length"})
VERSION_HEADER = "x-gpu-train-model-version"
SESSION = web.AppKey("session", ClientSession)


@dataclass
class RouteBackend:
    version: str
    url: str  # the version's server, without a path
    weight: int  # percent
    role: str = "stable"
    current: int = field(default=0, compare=False)  # smooth weighted round robin's running score


def backends_from(doc: Mapping[str, Any]) -> list[RouteBackend]:
    """The backends of a route document (gpu_train.jobs.serving.route_document)."""
    out = [RouteBackend(str(b["version"]), str(b["url"]).rstrip("/"), int(b["weight"]), str(b.get("role", "stable")))
           for b in doc.get("backends") or []]
    if not out or sum(b.weight for b in out) != 100 or any(b.weight < 0 for b in out):
        raise ValueError(f"a route needs backends whose weights add up to 100 (got {[b.weight for b in out]})")
    return out


class Route:
    """The versions behind one service and their weights; safe to change from another thread."""

    def __init__(self, service: str, backends: Sequence[RouteBackend]) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._backends = list(backends)

    def set(self, backends: Sequence[RouteBackend]) -> None:
        with self._lock:
            if [(b.version, b.url, b.weight) for b in backends] != [(b.version, b.url, b.weight) for b in self._backends]:
                LOG.info("route %s: %s", self.service, ", ".join(f"v{b.version} {b.weight}%" for b in backends))
                self._backends = list(backends)

    def backends(self) -> list[RouteBackend]:
        with self._lock:
            return list(self._backends)

    def weights(self) -> dict[str, int]:
        return {b.version: b.weight for b in self.backends()}

    def pick(self) -> RouteBackend:
        """The next backend by smooth weighted round robin (every backend gains its weight, the highest is chosen
        and pays back the total)."""
        with self._lock:
            live = [b for b in self._backends if b.weight > 0]
            total = sum(b.weight for b in live)
            for b in live:
                b.current += b.weight
            chosen = max(live, key=lambda b: b.current)
            chosen.current -= total
            return chosen

    def stable(self) -> RouteBackend:
        with self._lock:
            return max(self._backends, key=lambda b: (b.role == "stable", b.weight))


def create_app(route: Route, metrics: RouteMetrics, timeout_s: float = 300.0) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)

    async def session_ctx(app: web.Application):
        app[SESSION] = ClientSession(timeout=ClientTimeout(total=timeout_s), auto_decompress=False)
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_ctx)

    async def proxy(request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"]
        metered = tail in INFERENCE
        backend = route.pick() if metered else route.stable()
        start = time.perf_counter()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        code, response = 502, None
        try:
            async with request.app[SESSION].request(request.method, f"{backend.url}/openai/v1/{tail}",
                                                      data=body, headers=headers, params=request.query) as up:
                code = up.status
                response = web.StreamResponse(status=up.status, headers={
                    **{k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP},
                    VERSION_HEADER: backend.version})
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
        except TimeoutError:
            code = 504
        except ClientError as exc:
            LOG.warning("route %s: version %s at %s: %s", route.service, backend.version, backend.url, exc)
            code = 502
        finally:
            if metered:
                metrics.observe(service=route.service, version=backend.version, code=code,
                                seconds=time.perf_counter() - start)
        if response is not None:
            return response
        return web.json_response({"error": {"message": f"version {backend.version} of {route.service} did not answer",
                                            "type": "upstream_error"}}, status=code,
                                 headers={VERSION_HEADER: backend.version})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": route.service, "weights": route.weights()})

    async def prometheus(request: web.Request) -> web.Response:
        metrics.set_weights(route.service, route.weights())
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    for prefix in ("/v1/", "/openai/v1/"):
        app.router.add_route("*", prefix + "{tail:.*}", proxy)
    return app


class ConfigMapSource:
    """The route's ConfigMap, read through the Kubernetes API (the pod's service account may read ConfigMaps of its
    namespace and nothing else)."""

    def __init__(self, namespace: str, name: str) -> None:
        from kubernetes import client, config

        config.load_incluster_config()
        self.api = client.CoreV1Api()
        self.namespace, self.name = namespace, name

    def read(self) -> list[RouteBackend]:
        from gpu_train.jobs.serving import ROUTE_CONFIG_KEY

        cm = self.api.read_namespaced_config_map(self.name, self.namespace)
        return backends_from(json.loads((cm.data or {})[ROUTE_CONFIG_KEY]))


async def follow(route: Route, source: ConfigMapSource, every_s: float) -> None:
    """Keep the route's weights in step with its ConfigMap; a failed read keeps the last weights and logs once."""
    failing = False
    while True:
        try:
            route.set(await asyncio.to_thread(source.read))
            if failing:
                LOG.info("route %s: its ConfigMap reads again", route.service)
            failing = False
        except Exception as exc:  # the API server or the ConfigMap is briefly unavailable: keep serving
            if not failing:
                LOG.warning("route %s: cannot read ConfigMap %s/%s (%s); keeping the last weights", route.service,
                            source.namespace, source.name, exc)
            failing = True
        await asyncio.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_train.serving.router", description=__doc__.splitlines()[0])
    ap.add_argument("--service", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--config-map", required=True, help="the route ConfigMap (route.json)")
    ap.add_argument("--port", type=int, default=8080, help="bound first: in use or out of range, exit 2")
    ap.add_argument("--poll-seconds", type=float, default=1.0)
    args = ap.parse_args(argv)
    try:  # before the ConfigMap is read: a port the route cannot hold is one line, not a failure after start-up
        sock = bind("0.0.0.0", args.port)  # noqa: S104 - a pod's own address
    except PortError as exc:
        print(f"gpu-train: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    source = ConfigMapSource(args.namespace, args.config_map)
    route = Route(args.service, source.read())
    app = create_app(route, RouteMetrics())

    async def background(app: web.Application):
        task = asyncio.create_task(follow(route, source, args.poll_seconds))
        yield
        task.cancel()

    app.cleanup_ctx.append(background)
    web.run_app(app, sock=sock, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
