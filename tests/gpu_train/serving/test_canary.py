"""The promotion loop's decisions, one evaluation at a time: the PromQL it asks, the SLOs it holds the canary to,
the steps it advances, and when it promotes or rolls back (with the registry's side). Prometheus answers here from
a table of per-version values (the real one is in tests/gpu_train/serving/test_local.py); the clock is given.

Run: .venv/bin/pytest tests/gpu_train/serving/test_canary.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.serving.canary import CanaryState, Decision, PromotionLoop, judge, quality_score
from gpu_train.serving.prometheus import Measurement, PrometheusError, duration_s, queries
from gpu_train.spec.serving import Slo, read_service

SPEC = read_service({"name": "chat", "team": "research", "model": "tiny:4", "canary": {
    "steps": [10, 50], "stepSeconds": 60, "intervalSeconds": 10, "minRequests": 20, "timeoutSeconds": 600,
    "maxReactionSeconds": 120, "slo": {"latencyPercentile": 99, "latencyMs": 500, "errorRate": 0.01,
                                       "maxLatencyRegression": 0.5}}})


class Table:
    """Prometheus as a table: the version -> (requests, errors, latency seconds) it holds now."""

    def __init__(self) -> None:
        self.now: dict[str, tuple[float, float, float | None]] = {}
        self.asked: list[str] = []
        self.down = False

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        if self.down:
            raise PrometheusError("Prometheus at http://prom did not answer /api/v1/query (connection refused)")
        self.asked.append(promql)
        column = 2 if promql.startswith("histogram_quantile") else 1 if 'code=~"5.."' in promql else 0
        return [({"version": v}, row[column]) for v, row in self.now.items() if row[column] is not None]


class Record:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_canary_weight(self, state, percent):
        self.calls.append(("weight", percent))

    def promote(self, state):
        self.calls.append(("promote", state.canary))

    def rollback(self, state):
        self.calls.append(("rollback", state.canary))

    def record(self, state, decision: Decision):
        self.calls.append(("record", decision.action))

    def complete(self, version, prompt, max_tokens):
        return {3: "def f(): return 1", 4: "nonsense"}[version]

    def canary_started(self, model, version, service):
        self.calls.append(("challenger", model, version))

    def decided(self, model, version, stable, decision, service):
        self.calls.append(("registry", decision.action, model, version, stable))


def loop(prom: Table, record: Record) -> PromotionLoop:
    return PromotionLoop(prometheus=prom, selector='service="chat",namespace="team-research"', actions=record,
                         registry=record, clock=lambda: 1000.0)


def started(spec=SPEC) -> tuple[Table, Record, PromotionLoop, CanaryState]:
    prom, record = Table(), Record()
    lp = loop(prom, record)
    state, decision = lp.start(CanaryState.new(spec, stable=3, canary=4, canary_run_id="r4", now=1000.0))
    assert decision.action == "start" and state.step == 0
    return prom, record, lp, state


def test_the_queries_are_per_version_over_the_step_window():
    q = queries('service="chat"', 60, 99)
    assert q == {
        "requests": 'sum by (version) (increase(gpu_train_route_requests_total{service="chat"}[60s]))',
        "errors": 'sum by (version) (increase(gpu_train_route_requests_total{service="chat",code=~"5.."}[60s]))',
        "latency": "histogram_quantile(0.99, sum by (version, le) "
                   '(rate(gpu_train_route_request_duration_seconds_bucket{service="chat"}[60s])))',
    }
    assert [duration_s(t) for t in ("15s", "1m", "1m30s", "500ms", "2h")] == [15, 60, 90, 1, 7200]


@pytest.mark.parametrize(("canary", "stable", "breach"), [
    (Measurement(100, 2, 0.1), Measurement(100, 0, 0.1), "error rate 2.0% > 1.0%"),
    (Measurement(100, 0, 0.6), Measurement(100, 0, 0.5), "p99 latency 600 ms > 500 ms"),
    (Measurement(100, 0, 0.31), Measurement(100, 0, 0.2), "p99 latency 310 ms is more than 50% above the stable "
                                                          "version's 200 ms"),
    (Measurement(100, 1, 0.29), Measurement(100, 0, 0.2), None),  # 1% and 45% slower: held
    (Measurement(100, 0, None), None, None),
])
def test_the_slos(canary, stable, breach):
    assert judge(SPEC.canary.slo, canary, stable) == breach
    assert judge(Slo(), Measurement(10, 0, 0.2), None) is None


def test_start_gives_the_first_step_and_the_challenger_alias():
    _, record, _, state = started()
    assert record.calls == [("weight", 10), ("challenger", "tiny", 4), ("record", "start")]
    assert state.weight() == 10 and state.step_started_at == 1000.0


def test_a_healthy_canary_advances_step_by_step_then_is_promoted():
    prom, record, lp, state = started()
    prom.now = {"3": (400, 0, 0.2), "4": (40, 0, 0.25)}
    assert lp.tick(state, now=1030.0) == (state, None)  # judged and healthy, but the step lasts 60 s
    state, decision = lp.tick(state, now=1060.0)
    assert decision.action == "advance" and decision.weight == 50 and state.step == 1
    assert decision.reason == "10% held the SLOs for 60 s" and record.calls[-2:] == [("weight", 50), ("record", "advance")]
    assert decision.metrics["canary"] == {"requests": 40, "errors": 0, "errorRate": 0.0, "latencyMs": 250.0}
    assert lp.tick(state, now=1100.0)[1] is None
    state, decision = lp.tick(state, now=1120.0)
    assert decision.action == "promote" and decision.weight == 100
    assert record.calls[-3:] == [("promote", 4), ("record", "promote"), ("registry", "promote", "tiny", 4, 3)]
    assert any('namespace="team-research"' in q for q in prom.asked)


def test_a_breach_rolls_back_at_the_first_judged_window():
    prom, record, lp, state = started()
    prom.now = {"3": (400, 0, 0.2), "4": (40, 4, 0.2)}
    _, decision = lp.tick(state, now=1010.0)
    assert decision.action == "rollback" and decision.reason == "error rate 10.0% > 1.0%"
    assert record.calls[-3:] == [("rollback", 4), ("record", "rollback"), ("registry", "rollback", "tiny", 4, 3)]


def test_a_quiet_window_is_not_judged_and_a_canary_that_stays_quiet_is_given_up():
    prom, record, lp, state = started()
    prom.now = {"3": (400, 0, 0.2), "4": (5, 5, 2.0)}  # 5 requests, all failed: too few to judge
    assert lp.tick(state, now=1500.0)[1] is None
    _, decision = lp.tick(state, now=1600.0)  # timeoutSeconds 600 after the start
    assert decision.action == "rollback" and decision.reason.startswith("fewer than 20 canary requests per 60 s")


def test_without_metrics_the_canary_is_held_then_rolled_back_after_the_reaction_bound():
    prom, record, lp, state = started()
    prom.down = True
    state, decision = lp.tick(state, now=1010.0)
    assert decision is None and state.blind_since == 1010.0
    state, decision = lp.tick(state, now=1100.0)
    assert decision is None
    _, decision = lp.tick(state, now=1130.0)  # maxReactionSeconds 120 without an answer
    assert decision.action == "rollback" and decision.reason == "no metrics from Prometheus for 120 s " \
                                                                "(maxReactionSeconds)"


def test_the_quality_check_rolls_back_before_any_traffic():
    spec = read_service({**SPEC.model_dump(mode="json", by_alias=True), "canary": {
        **SPEC.canary.model_dump(mode="json", by_alias=True),
        "quality": {"prompts": [{"prompt": "def f():", "expect": "return"}], "minScore": 1.0}}})
    prom, record = Table(), Record()
    state, decision = loop(prom, record).start(CanaryState.new(spec, stable=3, canary=4, canary_run_id="r", now=0))
    assert decision.action == "rollback" and decision.reason == "quality 0% < minScore 100%"
    assert decision.metrics == {"quality": {"canary": 0.0, "stable": 1.0, "prompts": 1}}
    assert ("weight", 10) not in record.calls and record.calls[0] == ("rollback", 4)
    assert quality_score(["a return b"], spec.canary) == 1.0


def test_a_canary_state_survives_its_json():
    _, _, _, state = started()
    assert CanaryState.from_document(state.document()) == state
    assert state.canary_policy == SPEC.canary
