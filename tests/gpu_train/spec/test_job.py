"""The one job model: a job spec read once (types, MIN:MAX, unknown keys), its settings in one order, its checks
against pools and teams given as plain facts.

Run: .venv/bin/pytest tests/gpu_train/spec/test_job.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpu_train.sizing.job import layout_problems
from gpu_train.spec.errors import ConfigError, SettingsError
from gpu_train.spec.job import (
    MANAGED_OVERRIDES,
    JobSpec,
    NodeRange,
    job_problems,
    override_text,
    read_job,
    trainer_config,
    trainer_settings,
)
from gpu_train.spec.trainer_config import build_config, reference

SPEC = {"name": "llm", "team": "research", "pool": "h100", "preset": "gpt2-124m", "nodes": "2:4", "steps": 100,
        "globalBatchTokens": 786432, "checkpointEvery": 10, "overrides": {"train.micro_batch_size": 8}}


@dataclass(frozen=True)
class Pool:
    name: str = "h100"
    instance_type: str = "p5.48xlarge"
    gpus_per_node: int = 8
    max_nodes: int = 4
    gpu_type: str = "H100"


@dataclass(frozen=True)
class Team:
    name: str = "research"
    gpu_quota: dict = None  # type: ignore[assignment]


def problems(job: JobSpec, quota: int = 64, pool: Pool = Pool()) -> list[str]:
    """The job's own checks, then its layout and memory (gpu_train.sizing.job), as gpu_train.jobs.check runs them."""
    return (job_problems(job, pools=[pool], teams=[Team(gpu_quota={pool.name: quota})], scheme="s3://", key="job")
            + layout_problems(job, pools=[pool], key="job"))


def test_nodes_are_parsed_once_and_written_back_as_given():
    job = read_job(SPEC, key="job")
    assert job.nodes == NodeRange(2, 4) and (job.nodes.min, job.nodes.max) == (2, 4)
    assert str(job.nodes) == "2:4" and job.model_dump(by_alias=True)["nodes"] == "2:4"
    assert read_job(job.model_dump(by_alias=True), key="job") == job  # a round trip through the spec format


@pytest.mark.parametrize("nodes", ["4", "3:2", "0:2", ":", "1:2:3", 3, "a:b"])
def test_a_node_range_that_is_not_one_names_the_form(nodes):
    with pytest.raises(SettingsError) as err:
        read_job({**SPEC, "nodes": nodes}, key="job")
    assert err.value.problems == [f"job.nodes must be MIN:MAX with 1 <= MIN <= MAX, like '2:4' (got {nodes!r})"]


def test_unknown_keys_and_wrong_types_are_all_named_at_once():
    with pytest.raises(SettingsError) as err:
        read_job({**SPEC, "stepz": 1, "suspend": "yes", "maxRestarts": 2.5}, key="job")
    assert sorted(err.value.problems) == sorted([
        "job.stepz is not a known setting (did you mean 'steps'?)",
        "job.suspend must be true or false (got 'yes')",
        "job.maxRestarts must be a whole number (got 2.5)",
    ])


def test_trainer_settings_put_the_job_first_the_platform_next_and_the_overrides_last():
    job = read_job(SPEC, key="job")
    settings = trainer_settings(job, {"data.uri": "s3://b/m.json", "tracking.experiment": "llm"})
    assert list(settings) == ["train.steps", "train.global_batch_tokens", "checkpoint.every_steps", "data.uri",
                              "tracking.experiment", "train.micro_batch_size"]
    # Every key is one the trainer's own schema knows, and the values parse as its types.
    known = {key for key, _, _ in reference()}
    assert set(settings) <= known
    cfg = build_config(job.preset, overrides=[override_text(k, v) for k, v in settings.items()])
    assert (cfg.train.steps, cfg.checkpoint.every_steps, cfg.data.uri) == (100, 10, "s3://b/m.json")
    assert cfg.train.global_batch_tokens == 786432


def test_the_trainer_config_of_a_job_is_its_preset_then_its_settings():
    job = read_job({**SPEC, "overrides": {"train.micro_batch_size": 8, "train.lr": 3e-4, "model.norm": "rmsnorm"}},
                   key="job")
    cfg = trainer_config(job)
    assert (cfg.train.steps, cfg.train.global_batch_tokens, cfg.checkpoint.every_steps) == (100, 786432, 10)
    assert (cfg.train.micro_batch_size, cfg.train.lr, cfg.model.norm) == (8, 3e-4, "rmsnorm")
    assert cfg.model == build_config("gpt2-124m", overrides=["model.norm=rmsnorm"]).model
    with pytest.raises(ConfigError, match="train.lrr"):
        trainer_config(job.model_copy(update={"overrides": {"train.lrr": 1}}))


def test_every_managed_trainer_key_exists_and_has_its_job_setting():
    known = {key for key, _, _ in reference()}
    assert set(MANAGED_OVERRIDES) <= known
    assert set(MANAGED_OVERRIDES.values()) <= {f.alias for f in JobSpec.model_fields.values()}


def test_a_good_job_has_no_problems():
    assert problems(read_job(SPEC, key="job")) == []


def test_quota_is_checked_against_min_nodes():
    # MIN 2 nodes x 8 GPUs = 16 GPUs must be the team's nominal quota on the pool.
    assert problems(read_job(SPEC, key="job"), quota=16) == []
    found = problems(read_job(SPEC, key="job"), quota=15)
    assert found == ["gpu-train:teams[0].gpuQuota gives team 'research' 15 GPUs of nominal quota on pool 'h100', "
                     "below the 16 that job.nodes MIN 2 x 8 GPUs need"]


def test_the_batch_must_divide_at_every_world_size():
    # 786432 / 1024 = 768 sequences divide by 16, 24 and 32 GPUs x micro batch 8 (SPEC passes, above). 524288 /
    # 1024 = 512 sequences do not divide by 24 x 8 = 192, the world size of 3 nodes.
    (message,) = problems(read_job({**SPEC, "globalBatchTokens": 524288}, key="job"))
    assert message.startswith("job.globalBatchTokens 524288 does not divide at world size 24 (3 nodes x 8 GPUs")
    # lcm(16, 24, 32) x 8 x 1024 = 786432: the multiple the message offers is the one SPEC uses.
    assert "A multiple of 786432 tokens works at every world size from 16 to 32" in message


def test_the_managed_keys_are_refused_as_overrides_naming_their_setting():
    found = problems(read_job({**SPEC, "overrides": {"train.steps": 5, "data.uri": "s3://x/y"}}, key="job"))
    assert "job.overrides.train.steps is set by job.steps; set that instead" in found
    assert "job.overrides.data.uri is set by job.datasetUri; set that instead" in found


def test_uris_must_name_the_platforms_object_store_unless_there_is_none():
    job = read_job({**SPEC, "datasetUri": "gs://bucket/x/manifest.json"}, key="job")
    assert problems(job) == ["job.datasetUri must be s3://<bucket>/<path> (got 'gs://bucket/x/manifest.json')"]
    # On a machine without an object store (`gpu-train run --local`) URIs are not checked here.
    assert job_problems(job, pools=[Pool()], teams=[Team(gpu_quota={"h100": 64})], scheme=None, key="job") == []


OWN = {"name": "own", "team": "research", "pool": "h100", "nodes": "1:2", "command": ["python", "train.py"]}
REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com/"
PINNED = REGISTRY + "research/own@sha256:" + "a" * 64


def test_a_job_without_a_command_runs_the_bundled_trainer():
    job = read_job(SPEC, key="job")
    assert job.bundled and job.argv == ["python", "-m", "trainer"] and job.image == ""
    assert read_job({**SPEC, "command": ["python", "-m", "trainer"]}, key="job").bundled
    own = read_job(OWN, key="job")
    assert not own.bundled and own.argv == ["python", "train.py"]
    assert problems(own) == []


def test_an_empty_command_is_refused_naming_it():
    for empty in ([], [""]):
        assert problems(read_job({**OWN, "command": empty}, key="job")) == [
            'job.command is empty: give the argv every node runs (like ["python", "train.py"]), or leave it out to '
            "run the bundled trainer"]
    with pytest.raises(SettingsError, match="job.command"):
        read_job({**OWN, "command": "python train.py"}, key="job")  # an argv list, not a shell line


def test_a_job_of_its_own_code_sets_none_of_the_bundled_trainers_settings():
    found = problems(read_job({**OWN, "preset": "tiny", "steps": 10, "overrides": {"train.lr": 1e-3}}, key="job"))
    assert found == [f"job.{k} is a setting of the bundled trainer, and job.command runs your own code: pass it in "
                     "job.command's arguments instead" for k in ("preset", "overrides", "steps")]
    # Nor is its batch checked against the trainer's layout: 1000 steps of 524288 tokens are the defaults' only.
    assert problems(read_job({**OWN, "nodes": "1:3"}, key="job"), pool=Pool(max_nodes=4)) == []


def test_the_image_is_pinned_and_from_an_admitted_registry():
    def image(ref: str, registries=(REGISTRY,), repositories=()) -> list[str]:
        return job_problems(read_job({**OWN, "image": ref}, key="job"), pools=[Pool()],
                            teams=[Team(gpu_quota={"h100": 64})], scheme="s3://", key="job", registries=registries,
                            repositories=repositories)

    assert image(PINNED) == []
    (tag,) = image(REGISTRY + "research/own:v1")
    assert tag.startswith(f"job.image '{REGISTRY}research/own:v1' must be pinned by digest")
    other = "ghcr.io/acme/own@sha256:" + "b" * 64
    (outside,) = image(other)
    assert outside == (f"job.image {other}: team namespaces admit only images from the platform registry or an "
                       f"allowed one ({REGISTRY}; the stack setting image.allowedRegistries adds registries)")
    assert image(other, registries=(REGISTRY, "ghcr.io/acme/")) == []
    assert image(other, repositories=("ghcr.io/acme/own",)) == []
    # Where the registries are not known yet (the stack's settings, before its registry exists), only the digest.
    assert image(other, registries=None) == []
