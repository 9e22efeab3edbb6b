"""Reading the route's metrics from Prometheus: its HTTP query API and the PromQL the promotion loop asks.

Usage:
    prom = Prometheus("http://kube-prometheus-stack-prometheus.monitoring:9090")
    prom.query('sum by (version) (increase(gpu_train_route_requests_total{service="chat"}[60s]))')
    window = versions(prom, selector='service="chat",namespace="team-research"', window_s=60, percentile=99)
    prom.scrape_interval_s({"service": "chat"})      # of the targets whose series carry these labels

The queries, per version over a trailing window (https://prometheus.io/docs/prometheus/latest/querying/functions/):
- requests: `sum by (version) (increase(gpu_train_route_requests_total{S}[W]))`;
- errors: the same over `code=~"5.."`;
- latency: `histogram_quantile(q, sum by (version, le) (rate(gpu_train_route_request_duration_seconds_bucket{S}[W])))`.

Hand-written over urllib3 (already a dependency of the command): the Prometheus API clients on PyPI bring pandas
and plotting libraries for what is one GET and a JSON document here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import urllib3

from gpu_train.serving.metrics import LATENCY, REQUESTS


class PrometheusError(RuntimeError):
    """Prometheus did not answer a query; the message names the server and the query."""


@dataclass(frozen=True)
class Measurement:
    """One version's requests, 5xx answers and latency percentile (seconds; None without requests) in a window."""

    requests: float = 0.0
    errors: float = 0.0
    latency_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def document(self) -> dict[str, Any]:
        return {"requests": round(self.requests, 1), "errors": round(self.errors, 1),
                "errorRate": round(self.error_rate, 4),
                "latencyMs": None if self.latency_s is None else round(self.latency_s * 1000, 1)}


class Prometheus:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.http = urllib3.PoolManager(timeout=urllib3.Timeout(total=timeout_s), retries=urllib3.Retry(2))

    def _get(self, path: str, fields: Mapping[str, str] | None = None) -> Any:
        try:
            resp = self.http.request("GET", f"{self.url}{path}", fields=fields)
        except urllib3.exceptions.HTTPError as exc:
            raise PrometheusError(f"Prometheus at {self.url} did not answer {path} ({exc})") from None
        try:
            doc = json.loads(resp.data)
        except ValueError:
            raise PrometheusError(f"Prometheus at {self.url}: {path} answered HTTP {resp.status}, not JSON") from None
        if doc.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.url}: {doc.get('errorType', 'error')}: {doc.get('error')} "
                                  f"({(fields or {}).get('query', path)})")
        return doc["data"]

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant vector: (labels, value) per series; NaN values (no data in a ratio) are left out."""
        data = self._get("/api/v1/query", {"query": promql})
        out = []
        for item in data.get("result", []):
            value = float(item["value"][1])
            if not math.isnan(value):
                out.append((item["metric"], value))
        return out

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets", {"state": "active"}).get("activeTargets", []))

    def scrape_interval_s(self, labels: Mapping[str, str]) -> int | None:
        """The longest scrape interval among healthy targets whose labels include these, None when there is none."""
        found = [t for t in self.targets() if t.get("health") == "up"
                 and all((t.get("labels") or {}).get(k) == v for k, v in labels.items())]
        return max((duration_s(t["scrapeInterval"]) for t in found), default=None)


def duration_s(text: str) -> int:
    """A Prometheus duration ("15s", "1m", "1m30s") in whole seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total, number = 0.0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit():
            number += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        total += int(number) * units[unit]
        number, i = "", i + len(unit)
    return math.ceil(total)


def queries(selector: str, window_s: int, percentile: float) -> dict[str, str]:
    """The three PromQL queries of one evaluation, per version."""
    window = f"[{window_s}s]"
    return {
        "requests": f"sum by (version) (increase({REQUESTS}_total{{{selector}}}{window}))",
        "errors": f'sum by (version) (increase({REQUESTS}_total{{{selector},code=~"5.."}}{window}))',
        "latency": f"histogram_quantile({percentile / 100:g}, sum by (version, le) "
                   f"(rate({LATENCY}_bucket{{{selector}}}{window})))",
    }


def versions(prom: Prometheus, *, selector: str, window_s: int, percentile: float) -> dict[str, Measurement]:
    """Each version's measurement over the trailing window."""
    q = queries(selector, window_s, percentile)
    got = {name: {labels.get("version", ""): value for labels, value in prom.query(text)} for name, text in q.items()}
    return {v: Measurement(requests=got["requests"].get(v, 0.0), errors=got["errors"].get(v, 0.0),
                           latency_s=got["latency"].get(v)) for v in got["requests"]}
