"""The served model: one model of a service, whoever makes it (`gpu-train serve`, the stack's `serving.services`).

Usage:
    spec = read_service(raw, key="service")            # a spec file's mapping -> ServiceSpec (types, ranges)
    problems = service_problems(spec, teams=["research"], gpu_pools=["l4-serve"], scrape_interval_s=15)
    ModelRef.parse("tiny-gpt@champion")                 # tiny-gpt@champion, tiny-gpt:3, or tiny-gpt (its newest)
    reaction_bound_s(spec.canary, scrape_interval_s=15) # the longest a breach can go unanswered

A service names a team (its namespace), a registered model (`name:VERSION`, `name@ALIAS` or `name`), where it
runs (`pool`: "" for the cluster's CPU nodes, else a GPU pool the platform lends to serving), its runtime
(`auto`: vLLM on a GPU pool, Hugging Face transformers on CPU), resources and replicas, and how a new version
is tried: a canary schedule (traffic steps, step length, evaluation interval) with service-level objectives
(a latency percentile and its threshold, an error-rate threshold, optionally the latency regression allowed
against the stable version) and an optional quality check on a fixed prompt set. docs/serving.md explains
each setting.

The reaction bound: a breach that starts at time t is in Prometheus after at most one scrape interval, the
promotion loop looks at most one evaluation interval later, and by then the breach has weighed on a trailing
window of one step; so the canary is removed at most scrape + evaluation + step seconds after the breach
began. `canary.maxReactionSeconds` must be at least that, which `service_problems` checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gpu_train.spec.errors import Int, SettingsError, validation_problems
from gpu_train.spec.errors import SpecModel as Spec
from gpu_train.spec.naming import DNS_LABEL

# KServe, pinned: v0.20.0 is the newest release in its public repository (github.com/kserve/kserve tags), whose
# charts (kserve-crd, kserve-resources) and CRDs the offline checks hold the plan against. Its Hugging Face
# server images: the CPU build (transformers) and the GPU build (vLLM) that its release workflows push as
# kserve/huggingfaceserver:<tag> and :<tag>-gpu (.github/workflows/huggingface*-docker-publish.yml); and the
# storage initializer that downloads a model before the server starts. Pinned by tag: KServe publishes no
# digests in its repository, and the team namespaces' admission policies accept exactly these references.
KSERVE_VERSION = "v0.20.0"
RUNTIME_IMAGES = {"huggingface": f"docker.io/kserve/huggingfaceserver:{KSERVE_VERSION}",
                  "vllm": f"docker.io/kserve/huggingfaceserver:{KSERVE_VERSION}-gpu"}
STORAGE_INITIALIZER_IMAGE = f"docker.io/kserve/storage-initializer:{KSERVE_VERSION}"
# MLflow aliases the serving decisions move: the version serving all traffic, and the one on trial.
CHAMPION = "champion"
CHALLENGER = "challenger"
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ALIAS = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
# A canary step: a share of the traffic in percent.
Percent = Annotated[Int, Field(ge=1, le=99)]


@dataclass(frozen=True)
class ModelRef:
    """A registered model: one version (`name:3`), the version an alias points at (`name@champion`), or the newest
    version (`name`)."""

    name: str
    version: int | None = None
    alias: str | None = None

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.name}:{self.version}"
        return f"{self.name}@{self.alias}" if self.alias else self.name

    @classmethod
    def parse(cls, text: Any) -> ModelRef:
        if isinstance(text, ModelRef):
            return text
        if not isinstance(text, str):
            raise PydanticCustomError("registered_model", "must be NAME, NAME:VERSION or NAME@ALIAS (got {got})",
                                      {"got": repr(text)})
        name, version, alias = text, None, None
        if "@" in text:
            name, alias = text.split("@", 1)
            if not ALIAS.match(alias):
                raise PydanticCustomError("registered_model", "must have an alias of a letter then letters, "
                                          "digits, _ or - like champion (got {got})", {"got": repr(text)})
        elif ":" in text:
            name, number = text.rsplit(":", 1)
            if not number.isdigit() or int(number) < 1:
                raise PydanticCustomError("registered_model", "must have a whole version >= 1 in NAME:VERSION "
                                          "(got {got})", {"got": repr(text)})
            version = int(number)
        if not MODEL_NAME.match(name):
            raise PydanticCustomError("registered_model", "must name the model with letters, digits, '.', '_' "
                                      "or '-' (NAME, NAME:VERSION or NAME@ALIAS; got {got})", {"got": repr(text)})
        return cls(name, version, alias)


ModelText = Annotated[ModelRef, PlainValidator(ModelRef.parse), PlainSerializer(str, return_type=str),
                      WithJsonSchema({"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*([:@].+)?$"})]


class Slo(Spec):
    """What the canary must hold, measured at the service's route (what its clients see)."""

    latency_percentile: float = Field(99.0, gt=0, lt=100, description="which latency percentile is held to "
                                                                      "latencyMs (99 = p99)")
    latency_ms: float = Field(500.0, gt=0, description="the canary's latency at that percentile must stay at or "
                                                       "below this many milliseconds")
    error_rate: float = Field(0.01, ge=0, le=1, description="the canary's share of 5xx answers must stay at or "
                                                            "below this (0.01 = 1%)")
    max_latency_regression: float | None = Field(None, ge=0, description="if set, the canary's latency may exceed "
                                                                         "the stable version's by at most this "
                                                                         "fraction (0.2 = 20% slower)")


class QualityPrompt(Spec):
    prompt: str = Field(description="sent as a completion with temperature 0")
    expect: str = Field(description="the completion scores 1 when it contains this text, else 0")


class QualityCheck(Spec):
    """A fixed prompt set both versions answer before the canary takes any traffic."""

    prompts: tuple[QualityPrompt, ...] = Field(min_length=1, description="the fixed prompt set")
    max_tokens: Int = Field(32, ge=1, le=4096, description="tokens generated per prompt")
    min_score: float = Field(0.0, ge=0, le=1, description="the canary's share of prompts answered as expected "
                                                          "must be at least this")
    max_regression: float = Field(0.0, ge=0, le=1, description="and at most this much below the stable "
                                                               "version's share")


class Canary(Spec):
    """How a new version is tried: traffic steps, each held for stepSeconds while the SLOs hold."""

    steps: tuple[Percent, ...] = Field((10, 50), min_length=1, description="traffic percentages (1 to 99) the "
                                                                            "canary is given in turn, rising; after "
                                                                            "the last it is promoted")
    step_seconds: Int = Field(300, ge=1, description="how long each step lasts, and the trailing window the SLOs "
                                                     "are measured over")
    interval_seconds: Int = Field(30, ge=1, description="how often the promotion loop reads Prometheus")
    min_requests: Int = Field(50, ge=1, description="canary requests a window must hold before a step may "
                                                    "pass (a quiet step is held, not passed)")
    timeout_seconds: Int = Field(0, ge=0, description="a canary still short of traffic after this long is "
                                                      "rolled back (0 = three times the schedule)")
    max_reaction_seconds: Int = Field(900, ge=1, description="the longest a breach may go unanswered; must be "
                                                             "at least scrape interval + intervalSeconds + "
                                                             "stepSeconds")
    slo: Slo = Field(default_factory=Slo, description="service-level objectives")
    quality: QualityCheck | None = Field(None, description="a fixed prompt set both versions answer first")

    @model_validator(mode="after")
    def _steps_rise(self) -> Canary:
        problems = []
        if list(self.steps) != sorted(set(self.steps)):
            problems.append(f"steps must rise (got {list(self.steps)})")
        if self.interval_seconds > self.step_seconds:
            problems.append(f"intervalSeconds {self.interval_seconds} must be <= stepSeconds {self.step_seconds}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def deadline_s(self) -> int:
        """When a canary still waiting for traffic is given up."""
        return self.timeout_seconds or 3 * self.step_seconds * len(self.steps)


class Resources(Spec):
    cpu: str = Field("2", description="CPU request (a Kubernetes quantity)")
    memory: str = Field("8Gi", description="memory request and limit")
    gpus: Int = Field(0, ge=0, description="GPUs per replica (0 = 1 on a GPU pool, none on CPU)")


class Replicas(Spec):
    min: Int = Field(1, ge=1, description="replicas always running")
    max: Int = Field(1, ge=1, description="replicas the autoscaler may add up to")

    @model_validator(mode="after")
    def _order(self) -> Replicas:
        if self.max < self.min:
            raise ValueError(f"max must be >= min (got {self.max} < {self.min})")
        return self


class ServiceSpec(Spec):
    """A served model: the file `gpu-train serve` reads, and each entry of the stack's `serving.services`."""

    name: str = Field(description="DNS label: the service's route and the prefix of its InferenceServices")
    team: str = Field(description="one of teams[].name: the namespace it runs in")
    model: ModelText = Field(description="registered model: NAME:VERSION, NAME@ALIAS or NAME (its newest version)")
    runtime: Literal["auto", "vllm", "huggingface"] = Field("auto", description="vllm on a GPU pool, huggingface "
                                                                                "(transformers) on CPU; auto picks")
    pool: str = Field("", description="\"\" = the cluster's CPU nodes; else one of serving.gpuPools")
    resources: Resources = Field(default_factory=Resources, description="per replica")
    replicas: Replicas = Field(default_factory=Replicas, description="per version")
    canary: Canary = Field(default_factory=Canary, description="how a new version is tried")
    # Where the stack's own services come from: the plan cannot ask MLflow, so a stack names the version's
    # artifacts and run as `gpu-train serve deploy --dry-run` prints them; the command fills them in itself.
    source: str = Field("", description="the version's artifact URI as MLflow records it (filled in by "
                                        "`gpu-train serve`; required in a stack)")
    run_id: str = Field("", description="the MLflow run that trained the version (filled in like source)")

    def backend(self) -> str:
        """The runtime this service gets: its setting, or vLLM on a GPU pool and transformers on CPU."""
        if self.runtime != "auto":
            return self.runtime
        return "vllm" if self.pool else "huggingface"

    def gpus(self) -> int:
        return self.resources.gpus or (1 if self.pool else 0)


def read_service(raw: Any, key: str = "service") -> ServiceSpec:
    """A service spec from a mapping, types and ranges checked, each problem naming its key."""
    try:
        return ServiceSpec.model_validate_json(json.dumps(raw))
    except ValidationError as exc:
        raise SettingsError(validation_problems(exc, prefix=key, root=ServiceSpec, raw=raw),
                            title="invalid service") from None


def reaction_bound_s(canary: Canary, scrape_interval_s: int) -> int:
    """The longest a breach goes unanswered: it is scraped, then seen at the next evaluation, over a trailing window
    of one step (module docstring)."""
    return scrape_interval_s + canary.interval_seconds + canary.step_seconds


def service_problems(spec: ServiceSpec, *, teams: Sequence[str], gpu_pools: Sequence[str], scrape_interval_s: int,
                     key: str = "service") -> list[str]:
    """Everything wrong with a service on a platform with these teams and serving GPU pools, naming the setting."""
    p = []
    if not DNS_LABEL.match(spec.name):
        p.append(f"{key}.name {spec.name!r} must be a lowercase DNS label of at most 32 characters")
    if spec.team not in teams:
        p.append(f"{key}.team {spec.team!r} is not one of teams[].name ({', '.join(teams) or 'none'})")
    if spec.pool and spec.pool not in gpu_pools:
        p.append(f"{key}.pool {spec.pool!r} is not one of serving.gpuPools ({', '.join(gpu_pools) or 'none'}); "
                 "\"\" runs on the cluster's CPU nodes")
    if spec.backend() == "vllm" and not spec.pool:
        p.append(f"{key}.runtime vllm needs a GPU: set {key}.pool to one of serving.gpuPools")
    if not spec.pool and spec.resources.gpus:
        p.append(f"{key}.resources.gpus {spec.resources.gpus} needs a GPU pool: set {key}.pool")
    bound = reaction_bound_s(spec.canary, scrape_interval_s)
    if spec.canary.max_reaction_seconds < bound:
        p.append(f"{key}.canary.maxReactionSeconds {spec.canary.max_reaction_seconds} is below the reaction bound "
                 f"{bound} s (scrape interval {scrape_interval_s} + intervalSeconds {spec.canary.interval_seconds} "
                 f"+ stepSeconds {spec.canary.step_seconds}): shorten the step or the interval")
    return p


def stack_service_problems(spec: ServiceSpec, key: str) -> list[str]:
    """What a service in a stack must name besides: an exact version, its artifacts and run (the plan is offline)."""
    p = []
    if spec.model.version is None:
        p.append(f"{key}.model {str(spec.model)!r} must name a version (NAME:VERSION): a stack pins what it serves")
    if not spec.source:
        p.append(f"{key}.source is required in a stack (`gpu-train serve deploy ... --dry-run` prints it)")
    if not re.fullmatch(r"[0-9a-f]{32}", spec.run_id):
        p.append(f"{key}.runId must be the MLflow run id (32 hex characters) that trained the version")
    return p
