"""The serving metrics: names, labels and buckets shared by the route, the local model server, the promotion loop's
queries, the alert rules and the dashboard.

Usage:
    m = RouteMetrics()                                 # a registry of its own (prometheus_client)
    m.observe(service="chat", version="3", code=200, seconds=0.12)
    m.render()                                         # the /metrics text

What clients see is measured at the route (every request, by version and status code): the canary's SLOs, the
serving alerts (infra/k8s/rules/serving/serving.yaml) and the dashboard read these two series. The buckets put
boundaries on the common latency thresholds (100, 200, 300, 500 ms, 1 s, ...), so `histogram_quantile` does not
interpolate across a threshold.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

REQUESTS = "gpu_train_route_requests"  # a counter: exposed as gpu_train_route_requests_total
LATENCY = "gpu_train_route_request_duration_seconds"
WEIGHT = "gpu_train_route_weight_percent"
MODEL_REQUESTS = "gpu_train_model_requests"
MODEL_LATENCY = "gpu_train_model_request_duration_seconds"
MODEL_TOKENS = "gpu_train_model_generated_tokens"
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouteMetrics:
    """The route's series: requests by service, version and status code; latency by service and version; and the
    share of requests each version is given."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(REQUESTS, "Requests the route answered, by the version that served them and the "
                                          "status code", ["service", "version", "code"], registry=self.registry)
        self.latency = Histogram(LATENCY, "Seconds from a request's arrival at the route to its last byte, by "
                                          "version", ["service", "version"], buckets=BUCKETS, registry=self.registry)
        self.weight = Gauge(WEIGHT, "Percent of requests the route gives each version", ["service", "version"],
                            registry=self.registry)

    def set_weights(self, service: str, weights: dict[str, int]) -> None:
        self.weight.clear()
        for version, percent in weights.items():
            self.weight.labels(service, version).set(percent)

    def observe(self, *, service: str, version: str, code: int, seconds: float) -> None:
        self.requests.labels(service, version, str(code)).inc()
        self.latency.labels(service, version).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """A model server's own view: requests, latency and generated tokens of one model version."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(MODEL_REQUESTS, "Requests the model server answered, by path and status code",
                                ["model", "version", "path", "code"], registry=self.registry)
        self.latency = Histogram(MODEL_LATENCY, "Seconds to answer a completion", ["model", "version"],
                                 buckets=BUCKETS, registry=self.registry)
        self.tokens = Counter(MODEL_TOKENS, "Tokens generated", ["model", "version"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
