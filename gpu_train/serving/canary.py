"""The promotion loop: at each evaluation it reads Prometheus, holds the canary against the service's SLOs and the
stable version, and advances it a step, promotes it, or removes it and records why.

Usage (gpu-train serve canary --auto runs it in the command or hands it to the namespace's in-cluster loop,
gpu_train.serving.promote; gpu-train serve --local --auto runs it on this machine):
    loop = PromotionLoop(prometheus=Prometheus(url), selector='service="chat"', actions=actions, registry=registry)
    state = CanaryState.new(spec, stable=3, canary=4, canary_run_id=run_id, now=time.time())
    decision = loop.run(state)                 # blocks until promoted or rolled back
    state, decision = loop.tick(state, now)    # or one evaluation at a time (the in-cluster loop persists state)

One canary, step by step (docs/serving.md):
1. Before any traffic, the quality check, if the service has one: both versions answer the fixed prompt set
   greedily; a canary scoring below `minScore`, or more than `maxRegression` below the stable version, is rolled
   back at once.
2. The canary gets `steps[0]` percent of the route's requests, and the registry's `challenger` alias.
3. Every `intervalSeconds`: each version's requests, 5xx answers and latency percentile over the trailing
   `stepSeconds` (gpu_train.serving.prometheus). A window holding at least `minRequests` canary requests is
   judged: an error rate above `slo.errorRate`, a latency percentile above `slo.latencyMs`, or (when set) more
   than `slo.maxLatencyRegression` above the stable version's, rolls the canary back at once. A quieter window is
   not judged: a handful of requests says nothing about a percentile.
4. A step that has lasted `stepSeconds`, judged and unbroken, advances to the next step; after the last, the
   canary is promoted: it takes all traffic, the stable version is removed, and `champion` moves to it.
5. A canary still without a judged window `timeoutSeconds` after it started is rolled back, and so is one whose
   metrics Prometheus has not answered for `maxReactionSeconds` (the loop could not see a breach in time).

Every decision is one log line with the numbers it was made on, an entry with the same numbers for the actions
(in the cluster: an Event and the route ConfigMap), and tags on the canary's model version (`serving.decision`,
`serving.reason`, `serving.metrics`). Reaction bound: gpu_train.spec.serving.reaction_bound_s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

from gpu_train.serving.prometheus import Measurement, Prometheus, PrometheusError, versions
from gpu_train.spec.serving import Canary, ServiceSpec, Slo

LOG = logging.getLogger("gpu_train.serving.canary")
Action = Literal["start", "advance", "promote", "rollback"]


@dataclass(frozen=True)
class CanaryState:
    """Where one canary is; JSON-able, so the in-cluster loop keeps it in the route ConfigMap across restarts."""

    service: str
    model: str
    stable: int
    canary: int
    canary_run_id: str
    policy: dict[str, Any]  # the service's `canary` settings (gpu_train.spec.serving.Canary, by alias)
    started_at: float
    step: int = -1  # index into policy.steps; -1 until the canary takes traffic
    step_started_at: float = 0.0
    blind_since: float = 0.0  # when Prometheus stopped answering (0: it answers)

    @classmethod
    def new(cls, spec: ServiceSpec, *, stable: int, canary: int, canary_run_id: str, now: float) -> CanaryState:
        return cls(service=spec.name, model=spec.model.name, stable=stable, canary=canary,
                   canary_run_id=canary_run_id, policy=spec.canary.model_dump(mode="json", by_alias=True),
                   started_at=now)

    @property
    def canary_policy(self) -> Canary:
        return Canary.model_validate_json(json.dumps(self.policy))

    def weight(self) -> int:
        return self.canary_policy.steps[self.step] if self.step >= 0 else 0

    def document(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> CanaryState:
        return cls(**doc)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    weight: int  # the canary's share of traffic after the decision
    at: float
    metrics: dict[str, Any] = field(default_factory=dict)

    def line(self, state: CanaryState) -> str:
        what = {"start": f"started at {self.weight}%", "advance": f"advanced to {self.weight}%",
                "promote": "promoted", "rollback": "rolled back"}[self.action]
        return (f"canary {state.model}:{state.canary} of service {state.service} {what}: {self.reason} "
                f"{json.dumps(self.metrics, sort_keys=True)}")


class Actions(Protocol):
    """What the loop does to the service: in the cluster (gpu_train.serving.cluster) or on this machine
    (gpu_train.serving.local)."""

    def set_canary_weight(self, state: CanaryState, percent: int) -> None: ...

    def promote(self, state: CanaryState) -> None: ...

    def rollback(self, state: CanaryState) -> None: ...

    def record(self, state: CanaryState, decision: Decision) -> None: ...

    def complete(self, version: int, prompt: str, max_tokens: int) -> str: ...


class Registry(Protocol):
    """The model registry's side of each decision (gpu_train.serving.registry)."""

    def canary_started(self, model: str, version: int, service: str) -> None: ...

    def decided(self, model: str, version: int, stable: int, decision: Decision, service: str) -> None: ...


def judge(slo: Slo, canary: Measurement, stable: Measurement | None) -> str | None:
    """The first objective the canary breaks in a judged window, None when it holds them all."""
    if canary.error_rate > slo.error_rate:
        return f"error rate {canary.error_rate:.1%} > {slo.error_rate:.1%}"
    if canary.latency_s is not None:
        ms = canary.latency_s * 1000
        p = f"p{slo.latency_percentile:g}"
        if ms > slo.latency_ms:
            return f"{p} latency {ms:.0f} ms > {slo.latency_ms:g} ms"
        reg = slo.max_latency_regression
        if reg is not None and stable is not None and stable.latency_s is not None \
                and canary.latency_s > stable.latency_s * (1 + reg):
            return (f"{p} latency {ms:.0f} ms is more than {reg:.0%} above the stable version's "
                    f"{stable.latency_s * 1000:.0f} ms")
    return None


def quality_score(answers: list[str], policy: Canary) -> float:
    prompts = policy.quality.prompts if policy.quality else ()
    return sum(p.expect in a for p, a in zip(prompts, answers, strict=True)) / len(prompts) if prompts else 1.0


@dataclass
class PromotionLoop:
    prometheus: Prometheus
    selector: str  # PromQL label matchers of the service's route series, e.g. service="chat",namespace="team-x"
    actions: Actions
    registry: Registry | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep

    def _decide(self, state: CanaryState, decision: Decision) -> Decision:
        LOG.info("%s", decision.line(state))
        if decision.action == "promote":
            self.actions.promote(state)
        elif decision.action == "rollback":
            self.actions.rollback(state)
        self.actions.record(state, decision)
        if self.registry is not None and decision.action in ("promote", "rollback"):
            self.registry.decided(state.model, state.canary, state.stable, decision, state.service)
        return decision

    def quality(self, state: CanaryState, now: float) -> Decision | None:
        policy = state.canary_policy
        check = policy.quality
        if check is None:
            return None
        answers = {v: [self.actions.complete(v, p.prompt, check.max_tokens) for p in check.prompts]
                   for v in (state.canary, state.stable)}
        canary, stable = quality_score(answers[state.canary], policy), quality_score(answers[state.stable], policy)
        metrics = {"quality": {"canary": canary, "stable": stable, "prompts": len(check.prompts)}}
        if canary < check.min_score:
            reason = f"quality {canary:.0%} < minScore {check.min_score:.0%}"
        elif canary < stable - check.max_regression:
            reason = f"quality {canary:.0%} is more than {check.max_regression:.0%} below the stable version's {stable:.0%}"
        else:
            return None
        return Decision("rollback", reason, 0, now, metrics)

    def start(self, state: CanaryState) -> tuple[CanaryState, Decision]:
        """The quality check, then the first step's traffic and the challenger alias."""
        now = self.clock()
        failed = self.quality(state, now)
        if failed is not None:
            return state, self._decide(state, failed)
        state = replace(state, step=0, step_started_at=now)
        self.actions.set_canary_weight(state, state.weight())
        if self.registry is not None:
            self.registry.canary_started(state.model, state.canary, state.service)
        return state, self._decide(state, Decision("start", "quality check passed" if state.canary_policy.quality
                                                   else "no quality check", state.weight(), now))

    def tick(self, state: CanaryState, now: float | None = None) -> tuple[CanaryState, Decision | None]:
        """One evaluation; a decision when the canary advanced, was promoted or was rolled back, else None."""
        now = self.clock() if now is None else now
        policy = state.canary_policy
        try:
            seen = versions(self.prometheus, selector=self.selector, window_s=policy.step_seconds,
                            percentile=policy.slo.latency_percentile)
        except PrometheusError as exc:
            if not state.blind_since:
                LOG.warning("canary %s:%s: %s; holding the canary at %s%%", state.model, state.canary, exc,
                            state.weight())
            state = replace(state, blind_since=state.blind_since or now)
            if now - state.blind_since < policy.max_reaction_seconds:
                return state, None
            reason = f"no metrics from Prometheus for {now - state.blind_since:.0f} s (maxReactionSeconds)"
            return state, self._decide(state, Decision("rollback", reason, 0, now, {"prometheus": str(exc)}))
        if state.blind_since:
            LOG.info("canary %s:%s: Prometheus answers again", state.model, state.canary)
            state = replace(state, blind_since=0.0)
        canary, stable = seen.get(str(state.canary), Measurement()), seen.get(str(state.stable))
        metrics = {"canary": canary.document(), "stable": stable.document() if stable else None,
                   "windowSeconds": policy.step_seconds}
        judged = canary.requests >= policy.min_requests
        if judged:
            breach = judge(policy.slo, canary, stable)
            if breach is not None:
                return state, self._decide(state, Decision("rollback", breach, 0, now, metrics))
        elif now - state.started_at >= policy.deadline_s():
            reason = (f"fewer than {policy.min_requests} canary requests per {policy.step_seconds} s window after "
                      f"{now - state.started_at:.0f} s (timeoutSeconds)")
            return state, self._decide(state, Decision("rollback", reason, 0, now, metrics))
        if not judged or now - state.step_started_at < policy.step_seconds:
            return state, None
        if state.step + 1 >= len(policy.steps):
            return state, self._decide(state, Decision("promote", f"every step held the SLOs (last: {state.weight()}% "
                                                                  f"for {policy.step_seconds} s)", 100, now, metrics))
        held = state.weight()
        state = replace(state, step=state.step + 1, step_started_at=now)
        self.actions.set_canary_weight(state, state.weight())
        return state, self._decide(state, Decision("advance", f"{held}% held the SLOs for {policy.step_seconds} s",
                                                   state.weight(), now, metrics))

    def run(self, state: CanaryState) -> Decision:
        """From the start to a promotion or rollback, evaluating every intervalSeconds."""
        state, decision = self.start(state)
        interval = state.canary_policy.interval_seconds
        while decision.action not in ("promote", "rollback"):
            self.sleep(interval)
            state, found = self.tick(state)
            decision = found or decision
        return decision
