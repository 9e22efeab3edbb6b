"""The pre-flight results server of a GPU node: what the node should have, and whether each check passed.

Usage (the `results` container of the gpu-preflight DaemonSet, infra/k8s/health.py; standard library only,
so it runs in a plain Python image):
    NODE_NAME=<node> POOLS_FILE=/etc/gpu-preflight/pools.json RESULTS_DIR=/results PORT=8081 \
        python preflight_server.py

On start it reads its node from the Kubernetes API (with the pod's service account), looks up the node's
pool (label gpu-train.io/pool) in POOLS_FILE (pool -> expected GPUs and fabric devices, from the
platform's pools) and writes RESULTS_DIR/expected.env, which gpu-preflight.sh waits for. Then it serves, on
127.0.0.1 only, `GET /<check>`: 200 when RESULTS_DIR/<check>.ok exists, 503 with the failure detail when
<check>.fail exists, 503 "pending" before the check has run. The node readiness reporter next to it turns
each answer into a node condition (2xx: True, anything else: False with the body in the message).

Why hand-written: the reporter (kubernetes-sigs/node-readiness-controller) only polls an HTTP endpoint, and
the image that holds DCGM and the NVIDIA tools has no HTTP server; this file is that endpoint, nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import ssl
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

POOL_LABEL = "gpu-train.io/pool"  # gpu_train.spec.naming.POOL_LABEL (this file runs without the project installed)
CHECKS = ("gpus", "ecc", "dcgm", "fabric")
# How gpu-preflight.sh counts a fabric's devices (infra.platform.FabricProbe.probe).
PROBES = ("none", "efa", "mlx", "gvnic")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain


def expectations_env(pools: dict[str, Any], pool: str | None, node: str) -> str:
    """The shell-sourceable expectations of a node of `pool` (EXPECTATION_ERROR when there are none)."""
    if not pool:
        return f"EXPECTATION_ERROR={shlex.quote(f'node {node} has no {POOL_LABEL} label')}\n"
    spec = pools.get(pool)
    if not isinstance(spec, dict):
        return f"EXPECTATION_ERROR={shlex.quote(f'pool {pool} of node {node} is not in the pre-flight table')}\n"
    gpus, probe, fabric = spec.get("gpus"), spec.get("fabricProbe", "none"), spec.get("fabricDevices", 0)
    if not isinstance(gpus, int) or gpus < 1 or not isinstance(fabric, int) or fabric < 0 or \
            probe not in PROBES:
        return f"EXPECTATION_ERROR={shlex.quote(f'pool {pool} has a malformed pre-flight entry: {spec!r}')}\n"
    return f"EXPECTED_GPUS={gpus}\nFABRIC_PROBE={probe}\nEXPECTED_FABRIC={fabric}\n"


def answer(results: Path, check: str) -> tuple[int, str]:
    """(HTTP status, body) for GET /<check>."""
    if check not in CHECKS:
        return 404, f"unknown check {check!r} (known: {', '.join(CHECKS)})\n"
    ok, failed = results / f"{check}.ok", results / f"{check}.fail"
    if ok.is_file():
        return 200, ok.read_text()
    if failed.is_file():
        return 503, failed.read_text()
    return 503, f"{check}: pending (the check has not finished)\n"


def node_pool(api: str, node: str, token: str, context: ssl.SSLContext | None) -> str | None:
    """The node's pool label, read from the API server."""
    if not _NODE_NAME.fullmatch(node):
        raise ValueError(f"NODE_NAME {node!r} is not a node name")
    request = urllib.request.Request(f"{api.rstrip('/')}/api/v1/nodes/{node}",
                                     headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=10, context=context) as resp:  # noqa: S310 - the API server
        doc = json.load(resp)
    return ((doc.get("metadata") or {}).get("labels") or {}).get(POOL_LABEL)


def write_expectations(results: Path, text: str) -> None:
    tmp = results / ".expected.env.tmp"
    tmp.write_text(text)
    tmp.replace(results / "expected.env")


def make_handler(results: Path) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            status, body = (200, "ok\n") if self.path == "/healthz" else answer(results, self.path.strip("/"))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: Any) -> None:
            pass  # the reporters poll every few seconds; the check script logs the results

    return Handler


def main() -> int:
    node = os.environ.get("NODE_NAME", "")
    results = Path(os.environ.get("RESULTS_DIR", "/results"))
    pools_file = Path(os.environ.get("POOLS_FILE", "/etc/gpu-preflight/pools.json"))
    api = os.environ.get("KUBERNETES_API", "https://kubernetes.default.svc")
    port = int(os.environ.get("PORT", "8081"))
    if not node:
        print("error: NODE_NAME is not set", file=sys.stderr)
        return 2
    try:
        pools = json.loads(pools_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {pools_file}: {exc}", file=sys.stderr)
        return 2
    # Serve at once (every check answers "pending" until the script has run), then find the expectations.
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(results))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ca = SA_DIR / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else None
    text = ""
    for attempt in range(30):
        try:
            token = (SA_DIR / "token").read_text().strip() if (SA_DIR / "token").is_file() else ""
            pool = node_pool(api, node, token, context)
            text = expectations_env(pools, pool, node)
            break
        except (OSError, ValueError) as exc:
            print(f"reading node {node} (attempt {attempt + 1}): {exc}", file=sys.stderr)
            text = f"EXPECTATION_ERROR={shlex.quote(f'could not read node {node} from the API server: {exc}')}\n"
            time.sleep(2)
    write_expectations(results, text)
    print(f"node {node}: {text.strip()}", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
