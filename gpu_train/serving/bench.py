"""A bounded load generator for a served model: a fixed number of completion requests, at most N in flight at once,
and the latency percentiles and throughput they saw.

Usage:
    gpu-train serve bench --url http://127.0.0.1:8000 --requests 200 --concurrency 4 --max-tokens 16
    result = asyncio.run(load(url, model="chat", requests=200, concurrency=4, max_tokens=16))
    result.summary()   # {"requests": 200, "errors": 0, "p50_ms": ..., "p95_ms": ..., "p99_ms": ..., "rps": ...}

Latency is each request's time from send to the last byte of its answer, measured here; throughput is the
completed requests (and generated tokens, from each answer's `usage`) over the wall time of the whole run.
Percentiles are `statistics.quantiles(..., n=100, method="inclusive")` cut points (linear interpolation between
the nearest ranks). The requests are the same greedy completion, so the model's answer length varies only with
where it stops.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)  # of successful requests
    errors: dict[str, int] = field(default_factory=dict)  # status code (or exception name) -> count
    tokens: int = 0
    wall_s: float = 0.0
    versions: dict[str, int] = field(default_factory=dict)  # which version answered (x-gpu-train-model-version)

    def summary(self) -> dict[str, Any]:
        done = len(self.latencies_s)
        cuts = statistics.quantiles(self.latencies_s, n=100, method="inclusive") if done >= 2 else \
            [self.latencies_s[0]] * 99 if done else [float("nan")] * 99
        return {"requests": done + sum(self.errors.values()), "ok": done, "errors": dict(self.errors),
                "p50_ms": round(cuts[49] * 1000, 1), "p95_ms": round(cuts[94] * 1000, 1),
                "p99_ms": round(cuts[98] * 1000, 1),
                "rps": round(done / self.wall_s, 2) if self.wall_s else 0.0,
                "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
                "wall_s": round(self.wall_s, 2), "versions": dict(self.versions)}


async def load(url: str, *, model: str, requests: int, concurrency: int, max_tokens: int = 16,
               prompt: str = "def ", timeout_s: float = 120.0) -> LoadResult:
    """Send `requests` completions to `url`, at most `concurrency` at once."""
    if requests < 1 or concurrency < 1:
        raise ValueError(f"requests ({requests}) and concurrency ({concurrency}) must be >= 1")
    result = LoadResult()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker(session: ClientSession) -> None:
        while True:
            try:
                queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            try:
                async with session.post(f"{url.rstrip('/')}/v1/completions", json=body) as resp:
                    answer = await resp.json(content_type=None)
                    version = resp.headers.get("x-gpu-train-model-version", "")
                    if resp.status == 200:
                        result.latencies_s.append(time.perf_counter() - start)
                        result.tokens += int((answer.get("usage") or {}).get("completion_tokens", 0))
                        result.versions[version] = result.versions.get(version, 0) + 1
                    else:
                        result.errors[str(resp.status)] = result.errors.get(str(resp.status), 0) + 1
            except (ClientError, TimeoutError, ValueError) as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1

    started = time.perf_counter()
    async with ClientSession(timeout=ClientTimeout(total=timeout_s)) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, requests))))
    result.wall_s = time.perf_counter() - started
    return result


def format_summary(s: dict[str, Any]) -> str:
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    return (f"{s['ok']}/{s['requests']} requests in {s['wall_s']} s: p50 {s['p50_ms']} ms, p95 {s['p95_ms']} ms, "
            f"p99 {s['p99_ms']} ms; {s['rps']} requests/s, {s['tokens_per_s']} tokens/s; errors: {errors}")
