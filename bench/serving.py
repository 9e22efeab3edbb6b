"""Serving on this machine: latency percentiles and throughput of a served model, straight from its model server and
through the weighted route, and at concurrency 4 against 1, measured side by side.

Usage: `python -m bench --only serving` (part of `make bench`). The model is `make train`'s export when there is
one (runs/make-train/export), else the tiny preset's architecture with random weights exported the same way.
Each measurement is one bounded load run (gpu_train.serving.bench: a fixed number of greedy completions of 16
tokens, at most N in flight) after a warm-up; the server answers one completion at a time (one torch thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.common import Figure
from bench.runs import ROOT
from gpu_train.serving import ports
from gpu_train.serving.bench import load
from gpu_train.serving.local import RouteThread
from gpu_train.serving.metrics import RouteMetrics
from gpu_train.serving.router import Route, RouteBackend, create_app
from trainer.distributed import free_port

EXPORT = ROOT / "runs" / "make-train" / "export"
MAX_TOKENS = 16


def tiny_export(out: Path) -> Path:
    """The tiny preset's model with random weights, exported as `make train` exports its own."""
    from gpu_train.spec.trainer_config import build_config
    from trainer.export import TokenizerSpec, write_model_dir
    from trainer.model import GPT

    cfg = build_config("tiny").model
    write_model_dir(GPT(cfg).state_dict(), cfg, TokenizerSpec(), out)
    return out


def wait_answering(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the model server exited ({proc.returncode}) or {url} never answered")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        time.sleep(0.2)


@contextlib.contextmanager
def serving(model: Path) -> Iterator[tuple[str, str]]:
    """(model server URL, route URL) on free ports of this machine, both answering."""
    server_port, route_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainer.model_server", "--model", str(model), "--name",
                             "bench", "--version", "1", "--port", str(server_port), "--threads", "1"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    direct, routed = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{route_port}"
    try:
        deadline = time.monotonic() + 300
        wait_answering(direct, proc, deadline)
        app = create_app(Route("bench", [RouteBackend("1", direct, 100)]), RouteMetrics())
        route = RouteThread(app, ports.bind("127.0.0.1", route_port), stop)
        route.start()
        if not route.started.wait(60):
            raise RuntimeError(f"the route did not start on port {route_port}: {route.error}")
        wait_answering(routed, proc, deadline)
        yield direct, routed
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)


def measure(url: str, requests: int, concurrency: int) -> dict:
    return asyncio.run(load(url, model="bench", requests=requests, concurrency=concurrency,
                            max_tokens=MAX_TOKENS)).summary()


def run(quick: bool = False) -> list[Figure]:
    requests = 40 if quick else 200
    with tempfile.TemporaryDirectory() as tmp:
        model = EXPORT if (EXPORT / "tokenizer.json").is_file() else tiny_export(Path(tmp) / "export")
        which = "make train's export" if model == EXPORT else "the tiny preset, random weights"
        with serving(model) as (direct, routed):
            measure(routed, 10, 1)  # warm-up: first requests pay for lazy initialisation
            runs = {(where, c): measure(url, requests, c) for c in (1, 4) for where, url in (("direct", direct),
                                                                                            ("route", routed))}
    d1, r1, r4 = runs[("direct", 1)], runs[("route", 1)], runs[("route", 4)]
    notes = f"{which}; {requests} greedy completions of {MAX_TOKENS} tokens"

    def pct(s: dict) -> str:
        return f"p50 {s['p50_ms']} / p95 {s['p95_ms']} / p99 {s['p99_ms']} ms"

    return [
        Figure("serving", "p50 latency through the route vs the model server alone, concurrency 1", r1["p50_ms"],
               "ms", d1["p50_ms"], "model server", r1["p50_ms"] / d1["p50_ms"], notes=notes,
               extra={"route": r1, "direct": d1}),
        Figure("serving", "throughput through the route vs the model server alone, concurrency 1", r1["rps"],
               "requests/s", d1["rps"], "model server", r1["rps"] / d1["rps"], notes=f"route {pct(r1)}"),
        Figure("serving", "throughput through the route, concurrency 4 vs 1", r4["rps"], "requests/s", r1["rps"],
               "concurrency 1", r4["rps"] / r1["rps"], notes=f"concurrency 4: {pct(r4)}; {r4['tokens_per_s']} tokens/s",
               extra={"route_c4": r4, "direct_c4": runs[("direct", 4)]}),
    ]
