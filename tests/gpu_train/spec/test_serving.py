"""The one model of a served model: a service spec read once (model references, SLOs, the canary schedule), its
checks against the platform's teams and serving pools, the reaction bound, and the stack's `serving` settings.

Run: .venv/bin/pytest tests/gpu_train/spec/test_serving.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from gpu_train.spec import settings_checks
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.serving import ModelRef, reaction_bound_s, read_service, service_problems

ROOT = Path(__file__).resolve().parents[3]
SPEC = {"name": "chat", "team": "research", "model": "tiny-gpt@champion"}
RUN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("text", "ref"), [
    ("tiny-gpt", ModelRef("tiny-gpt")),
    ("tiny-gpt:3", ModelRef("tiny-gpt", version=3)),
    ("tiny-gpt@champion", ModelRef("tiny-gpt", alias="champion")),
    ("org.team_model-2:12", ModelRef("org.team_model-2", version=12)),
])
def test_a_model_reference_is_parsed_once_and_written_back_as_given(text, ref):
    spec = read_service({**SPEC, "model": text})
    assert spec.model == ref and str(spec.model) == text
    assert spec.model_dump(by_alias=True, mode="json")["model"] == text
    assert read_service(spec.model_dump(by_alias=True, mode="json")) == spec


@pytest.mark.parametrize(("text", "words"), [
    ("tiny:0", "must have a whole version >= 1 in NAME:VERSION (got 'tiny:0')"),
    ("tiny:v2", "must have a whole version >= 1 in NAME:VERSION (got 'tiny:v2')"),
    ("tiny@1st", "must have an alias of a letter then letters, digits, _ or - like champion (got 'tiny@1st')"),
    ("my model", "must name the model with letters, digits, '.', '_' or '-' (NAME, NAME:VERSION or NAME@ALIAS; "
                 "got 'my model')"),
    (7, "must be NAME, NAME:VERSION or NAME@ALIAS (got 7)"),
])
def test_a_bad_model_reference_names_the_field_and_the_form(text, words):
    with pytest.raises(SettingsError) as err:
        read_service({**SPEC, "model": text})
    assert err.value.problems == [f"service.model {words}"]


@pytest.mark.parametrize(("patch", "problem"), [
    ({"canary": {"steps": [50, 10]}}, "service.canary.steps must rise (got [50, 10])"),
    ({"canary": {"steps": [10, 100]}}, "service.canary.steps[1] must be <= 99 (got 100)"),
    ({"canary": {"stepSeconds": 20, "intervalSeconds": 30}},
     "service.canary.intervalSeconds 30 must be <= stepSeconds 20"),
    ({"canary": {"slo": {"errorRate": 1.5}}}, "service.canary.slo.errorRate must be <= 1.0 (got 1.5)"),
    ({"canary": {"slo": {"latencyPercentile": 100}}}, "service.canary.slo.latencyPercentile must be < 100.0 (got 100)"),
    ({"canary": {"slo": {"latencyMs": 0}}}, "service.canary.slo.latencyMs must be > 0.0 (got 0)"),
    ({"canary": {"quality": {"prompts": []}}}, "service.canary.quality.prompts"),
    ({"replicas": {"min": 3, "max": 2}}, "service.replicas.max must be >= min (got 2 < 3)"),
    ({"runtime": "tgi"}, "service.runtime must be one of 'auto', 'vllm' | 'huggingface' (got 'tgi')"),
    ({"canary": {"stepz": 5}}, "service.canary.stepz is not a known setting (did you mean 'steps'?)"),
])
def test_bad_values_name_their_key(patch, problem):
    with pytest.raises(SettingsError) as err:
        read_service({**SPEC, **patch})
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(problem), err.value.problems


def test_the_runtime_follows_the_pool_unless_set():
    assert read_service(SPEC).backend() == "huggingface" and read_service(SPEC).gpus() == 0
    on_gpu = read_service({**SPEC, "pool": "l4-serve"})
    assert on_gpu.backend() == "vllm" and on_gpu.gpus() == 1
    assert read_service({**SPEC, "pool": "l4-serve", "runtime": "huggingface"}).backend() == "huggingface"
    assert read_service({**SPEC, "pool": "l4-serve", "resources": {"gpus": 2}}).gpus() == 2


def test_the_reaction_bound_is_scrape_plus_evaluation_plus_step():
    spec = read_service({**SPEC, "canary": {"stepSeconds": 120, "intervalSeconds": 10}})
    # A breach is scraped within 15 s, seen by the next evaluation within 10 s, and dominates a 120 s window.
    assert reaction_bound_s(spec.canary, scrape_interval_s=15) == 145


def test_service_checks_name_each_culprit():
    spec = read_service({**SPEC, "name": "Chat", "team": "vision", "pool": "h100", "runtime": "vllm",
                         "canary": {"stepSeconds": 300, "intervalSeconds": 30, "maxReactionSeconds": 300}})
    assert service_problems(spec, teams=["research"], gpu_pools=["l4-serve"], scrape_interval_s=15) == [
        "service.name 'Chat' must be a lowercase DNS label of at most 32 characters",
        "service.team 'vision' is not one of teams[].name (research)",
        "service.pool 'h100' is not one of serving.gpuPools (l4-serve); \"\" runs on the cluster's CPU nodes",
        "service.canary.maxReactionSeconds 300 is below the reaction bound 345 s (scrape interval 15 + "
        "intervalSeconds 30 + stepSeconds 300): shorten the step or the interval",
    ]
    cpu_vllm = read_service({**SPEC, "runtime": "vllm", "resources": {"gpus": 1}})
    assert service_problems(cpu_vllm, teams=["research"], gpu_pools=[], scrape_interval_s=15) == [
        "service.runtime vllm needs a GPU: set service.pool to one of serving.gpuPools",
        "service.resources.gpus 1 needs a GPU pool: set service.pool",
    ]
    assert service_problems(read_service(SPEC), teams=["research"], gpu_pools=[], scrape_interval_s=15) == []


# ------------------------------------------------------------------------------------------- stack settings

def raw_stack(name: str) -> dict:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{name}.yaml").read_text())["config"]


def test_serving_is_off_by_default_in_every_stack_file():
    for stack in ("aws-dev", "aws-prod", "gcp-dev", "gcp-prod"):
        assert settings_checks.parse(raw_stack(stack), stack).serving.enabled is False


def _with_serving(serving: dict, quota: dict | None = None) -> dict:
    raw = copy.deepcopy(raw_stack("aws-dev"))
    raw["gpu-train:serving"] = serving
    if quota is not None:
        raw["gpu-train:teams"][0]["gpuQuota"] = quota
    return raw


def test_a_stack_service_pins_its_version_artifacts_and_run():
    raw = _with_serving({"enabled": True, "services": [{**SPEC, "model": "tiny-gpt@champion"}]})
    with pytest.raises(SettingsError) as err:
        settings_checks.parse(raw, "aws-dev")
    assert err.value.problems == [
        "gpu-train:serving.services[0].model 'tiny-gpt@champion' must name a version (NAME:VERSION): a stack pins "
        "what it serves",
        "gpu-train:serving.services[0].source is required in a stack (`gpu-train serve deploy ... --dry-run` prints "
        "it)",
        "gpu-train:serving.services[0].runId must be the MLflow run id (32 hex characters) that trained the version",
    ]
    pinned = {**SPEC, "model": "tiny-gpt:3", "source": f"mlflow-artifacts:/1/{RUN}/artifacts/model", "runId": RUN}
    cfg = settings_checks.parse(_with_serving({"enabled": True, "services": [pinned]}), "aws-dev")
    assert cfg.serving.services[0].model == ModelRef("tiny-gpt", version=3)


def test_a_serving_gpu_pool_carries_no_team_quota():
    raw = _with_serving({"enabled": True, "gpuPools": ["l4-spot", "a100"]})
    with pytest.raises(SettingsError) as err:
        settings_checks.parse(raw, "aws-dev")
    # research has 4 GPUs of quota on l4-spot (stacks/Pulumi.aws-dev.yaml); platform has none there.
    assert err.value.problems == [
        "gpu-train:teams[0].gpuQuota gives team 'research' 4 GPUs on pool 'l4-spot', which serving.gpuPools[0] lends "
        "to serving: Kueue would admit training onto GPUs a service holds (give the team 0 there)",
        "gpu-train:serving.gpuPools[1] 'a100' is not one of gpuPools[].name (l4-spot, l40s-spot)",
    ]
    # With research's quota moved off l4-spot (the stack's job moved along), the pool may serve.
    raw = _with_serving({"enabled": True, "gpuPools": ["l4-spot"]}, quota={"l40s-spot": 1})
    raw["gpu-train:job"]["pool"] = "l40s-spot"
    assert settings_checks.parse(raw, "aws-dev").serving.gpu_pools == ("l4-spot",)


def test_services_without_serving_enabled_are_refused():
    with pytest.raises(SettingsError) as err:
        settings_checks.parse(_with_serving({"gpuPools": ["l40s-spot"]}), "aws-dev")
    assert err.value.problems == ["gpu-train:serving.services and serving.gpuPools need serving.enabled: true"]
