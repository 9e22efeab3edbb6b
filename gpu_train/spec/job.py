"""The job: one model of a training job, whoever makes it (the stack's `job`, `gpu-train submit`, `run --local`).

Usage:
    job = read_job(raw, key="job")                          # a spec file's mapping -> JobSpec (types, ranges)
    problems = job_problems(job, pools=pools, teams=teams, scheme="s3://")   # against the platform's pools/teams
    job.nodes.min, job.nodes.max                            # "2:4" parsed once
    trainer_settings(job, {"data.uri": ...})                # the trainer's dotted settings, in launch order
    job.bundled, job.argv                                   # runs the bundled trainer?; the command it runs

A job names a team (its namespace and queue), a pool (its nodes), MIN:MAX nodes for torchrun's elastic
rendezvous, restarts and waits, and what runs: `image` (the platform's trainer image unless set: then pinned by
digest and from a registry the platform allows) and `command`, the argv the launcher runs under torchrun on
every node (gpu_train.jobs.launch maps it to torchrun's module, script or --no-python form). Without a command
the job runs the bundled trainer, `python -m trainer`, which alone reads the trainer settings: a preset with dotted
overrides (`train.lr: 3e-4`, checked against the trainer's own schema, gpu_train.spec.trainer_config) and the
settings the platform itself reads: steps and global batch tokens (the batch must divide at every world size the
job may run at; the carbon and sweep budgets count tokens) and the checkpoint interval. Those trainer keys are set
only through their job settings, never through `overrides`, so a job has one value for each. A job of its own
code gets its arguments from its command and everything else from the launcher's environment (docs/your-code.md),
so it may set none of the trainer settings. Whether its layout and memory fit its pool's GPUs is
gpu_train.sizing.job's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from gpu_train.spec.errors import ConfigError, Int, SettingsError, SpecModel, validation_problems
from gpu_train.spec.naming import DNS_LABEL, PROJECT

# From Kueue's admission to a running trainer container on a fresh GPU node: the provisioner's decision, instance
# launch and boot, GPU driver and fabric setup, the NVMe DaemonSet, and pulling the trainer image.
GPU_NODE_STARTUP_S = 15 * 60
# Kueue's waitForPodsReady.timeout (also Kueue's own default): an admitted job whose pods are not all ready by then
# is evicted and requeued, so it must outlast a node start. The Kueue configuration (infra/k8s/tenancy.py) sets it.
PODS_READY_TIMEOUT_S = 30 * 60

# Trainer keys that have their own job setting: setting them again in `overrides` would be ambiguous.
MANAGED_OVERRIDES = {
    "train.steps": "steps",
    "train.global_batch_tokens": "globalBatchTokens",
    "checkpoint.every_steps": "checkpointEvery",
    "checkpoint.remote_uri": "checkpointUri",
    "data.uri": "datasetUri",
}
# The bundled trainer's command: a job without a `command` runs this, with its trainer settings as arguments.
BUNDLED_TRAINER = ("python", "-m", "trainer")
# Settings only the bundled trainer reads (job field -> its camelCase name in a spec).
TRAINER_ONLY = {"preset": "preset", "overrides": "overrides", "steps": "steps",
                "global_batch_tokens": "globalBatchTokens", "checkpoint_every": "checkpointEvery"}
IMAGE_DIGEST = re.compile(r"^[a-z0-9.\-/:_]+@sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class NodeRange:
    """torchrun's `--nnodes=MIN:MAX`: the job trains while at least MIN nodes are present, on up to MAX."""

    min: int
    max: int

    def __str__(self) -> str:
        return f"{self.min}:{self.max}"


@dataclass(frozen=True)
class World:
    """The world sizes a job runs at: MIN to MAX nodes of `gpus_per_node` GPUs each. Every figure `gpu-train submit`
    prints for a world size (the memory a GPU needs, the carbon estimate) and every layout check names it through
    `describe`, so that no two of them count a job's GPUs differently."""

    nodes: NodeRange
    gpus_per_node: int

    def size(self, nodes: int) -> int:
        """GPUs in all at `nodes` nodes."""
        return nodes * self.gpus_per_node

    def describe(self, nodes: int, which: str = "", within: str = "") -> str:
        """`world size 16 (MAX 2 nodes x 8 GPUs)`: `which` says which end of the range it is, if either, and
        `within` the setting the range comes from (`world size 8 (1 node x 8 GPUs, within job.nodes 1:2)`)."""
        node_s, gpu_s = "s" if nodes != 1 else "", "s" if self.gpus_per_node != 1 else ""
        end, setting = f"{which} " if which else "", f", within {within}" if within else ""
        return f"world size {self.size(nodes)} ({end}{nodes} node{node_s} x {self.gpus_per_node} GPU{gpu_s}{setting})"


def job_world(job: JobSpec, pool_gpus_per_node: int) -> World:
    """The job's world sizes on a pool whose nodes have this many GPUs: its own gpusPerNode, or all of a node's."""
    return World(job.nodes, job.gpus_per_node or pool_gpus_per_node)


def parse_nodes(value: Any) -> NodeRange:
    """`"2:4"` -> NodeRange(2, 4); anything else is refused with the form it must have."""
    if isinstance(value, NodeRange):
        return value
    m = re.fullmatch(r"([0-9]{1,6}):([0-9]{1,6})", value) if isinstance(value, str) else None
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise PydanticCustomError("node_range", "must be MIN:MAX with 1 <= MIN <= MAX, like '2:4' (got {got})",
                                  {"got": repr(value)})
    return NodeRange(int(m.group(1)), int(m.group(2)))


Nodes = Annotated[NodeRange, PlainValidator(parse_nodes), PlainSerializer(str, return_type=str),
                  WithJsonSchema({"type": "string", "pattern": "^[0-9]+:[0-9]+$"})]


class JobSpec(SpecModel):
    """A training job: the stack's `job` setting and the file `gpu-train submit` reads."""

    name: str = Field(description="DNS label; the JobSet name")
    team: str = Field(description="one of teams[].name: picks the namespace and LocalQueue")
    pool: str = Field(description="one of gpuPools[].name: where the pods run")
    image: str = Field("", description="the container image, pinned by digest (repo@sha256:...), from the platform "
                                       "registry or one of image.allowedRegistries; \"\" = the platform's trainer "
                                       "image")
    command: list[str] | None = Field(None, description="what every node runs under torchrun: [\"python\", \"-m\", "
                                                         "\"pkg.mod\", args...], [\"python\", \"script.py\", "
                                                         "args...] or any executable with its arguments; absent = "
                                                         "the bundled trainer (python -m trainer), which alone reads "
                                                         "preset, overrides, steps, globalBatchTokens and "
                                                         "checkpointEvery")
    preset: str = Field("gpt2-124m", description="trainer preset (python -m trainer --preset)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="trainer dotted-key overrides, checked against "
                                                                        "the trainer's own schema")
    nodes: Nodes = Field(NodeRange(1, 1), description="torchrun --nnodes MIN:MAX: the JobSet has MAX pods, admitted "
                                                      "whole; training goes on while MIN nodes are present")
    gpus_per_node: Int = Field(0, ge=0, description="0 = all GPUs of the pool's instance type")
    dataset_uri: str = Field("", description="\"\" = <datasets bucket>/<job name>/manifest.json")
    checkpoint_uri: str = Field("", description="\"\" = <checkpoints bucket>/<team>/<job name>")
    steps: Int = Field(1000, ge=1, description="optimizer steps the bundled trainer runs")
    global_batch_tokens: Int = Field(524288, ge=1, description="tokens per optimizer step over all ranks; divides at "
                                                               "every world size the job may run at")
    checkpoint_every: Int = Field(200, ge=1, description="steps between checkpoints")
    priority_class: Literal["production", "sweep"] = Field(
        "production", description="Kueue WorkloadPriorityClass gpu-train-<this>: production jobs preempt sweep "
                                  "trials in their team's queue, and sweeps are the first to give back borrowed quota")
    suspend: bool = Field(False, description="pause (true: quota released, pods gone) and resume (false) through "
                                             "`pulumi up`")
    max_restarts: Int = Field(3, ge=0, description="torchrun --max-restarts and the JobSet's failurePolicy.maxRestarts")
    data_wait_minutes: Int = Field(10, ge=0, description="how long the pods wait for the dataset manifest before "
                                                   "failing the job")
    rendezvous_timeout_minutes: Int = Field(35, ge=1, description="torchrun join timeout; at least Kueue's pods-ready "
                                                            "timeout (30)")

    @property
    def bundled(self) -> bool:
        """Whether the job runs the bundled trainer (no command, or exactly `python -m trainer`)."""
        return self.command is None or tuple(self.command) == BUNDLED_TRAINER

    @property
    def argv(self) -> list[str]:
        """The command every node runs (the bundled trainer's without its settings, which the launcher adds)."""
        return list(BUNDLED_TRAINER if self.command is None else self.command)


def read_job_file(path: str | Path, title: str = "invalid job spec") -> dict[str, Any]:
    """A job spec file's settings (YAML; they may also be wrapped in `job:`, as in a stack file), the file named in
    every problem (SettingsError)."""
    import yaml

    from gpu_train.spec import yamlfile

    p = Path(path).expanduser()
    if not p.is_file():
        raise SettingsError([f"{path}: no such job spec file"], title=title)
    try:
        raw = yamlfile.load(p.read_text())
    except OSError as exc:
        raise SettingsError([f"{path}: {exc.strerror or exc}"], title=title) from None
    except yaml.YAMLError as exc:
        raise SettingsError([f"{path}: not valid YAML: {str(exc).splitlines()[0]}"], title=title) from None
    if isinstance(raw, dict) and set(raw) == {"job"}:
        raw = raw["job"]
    if not isinstance(raw, dict):
        raise SettingsError([f"{path}: a job spec is a mapping of the job settings (name, team, pool, ...), got "
                             f"{type(raw).__name__}"], title=title)
    return raw


def read_job(raw: Any, key: str = f"{PROJECT}:job") -> JobSpec:
    """A job spec from a mapping (a spec file, or the stack's `job`), types and ranges checked, keys named."""
    import json

    try:
        return JobSpec.model_validate_json(json.dumps(raw))
    except ValidationError as exc:
        raise SettingsError(validation_problems(exc, prefix=key, root=JobSpec, raw=raw),
                            title="invalid job settings") from None


class PoolFacts(Protocol):
    """What the job checks need of a GPU pool (a contract GpuPool has these)."""

    name: str
    instance_type: str
    gpus_per_node: int
    max_nodes: int
    gpu_type: str  # the catalog's GPU model ("H100"); "" when unknown (no memory check)


class TeamFacts(Protocol):
    """What the job checks need of a team: its nominal GPUs per pool."""

    name: str
    gpu_quota: Mapping[str, int]


def gpus_per_node(job: JobSpec, pool: PoolFacts | None) -> int:
    """GPUs each of the job's pods uses: the setting, or all of its pool's (0 when the pool is unknown)."""
    return job_world(job, pool.gpus_per_node if pool is not None else 0).gpus_per_node


def override_text(key: str, value: Any) -> str:
    """One `section.key=value` argument of the trainer's command line."""
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    return f"{key}={value}"


def trainer_config(job: JobSpec) -> Any:
    """The bundled trainer's configuration for this job (gpu_train.spec.trainer_config.Config; ConfigError when the
    trainer refuses a setting): its preset and trainer settings, through the same text the worker parses."""
    from gpu_train.spec.trainer_config import build_config

    return build_config(job.preset, overrides=[override_text(k, v) for k, v in trainer_settings(job).items()])


def trainer_settings(job: JobSpec, platform: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trainer's dotted settings for this job, in launch order: the job's own settings, then what the platform
    sets (paths and endpoints that depend on where it runs), then the job's overrides."""
    return {
        "train.steps": job.steps,
        "train.global_batch_tokens": job.global_batch_tokens,
        "checkpoint.every_steps": job.checkpoint_every,
        **(platform or {}),
        **job.overrides,
    }


def timeout_problems(*, rendezvous_s: int, key: str, node_startup_s: int = GPU_NODE_STARTUP_S,
                     pods_ready_s: int = PODS_READY_TIMEOUT_S) -> list[str]:
    """The three waits must nest: a node starts within Kueue's pods-ready timeout, and the first torchrun agents
    wait for their peers at least as long as Kueue gives the pods to come up (else they give up, and fail the pod,
    while Kueue still considers the start on time)."""
    problems = []
    if pods_ready_s < node_startup_s:
        problems.append(f"Kueue's waitForPodsReady timeout ({pods_ready_s} s) is shorter than a GPU node's "
                        f"start ({node_startup_s} s): every cold start would be evicted")
    if rendezvous_s < pods_ready_s:
        problems.append(f"{key} is {rendezvous_s // 60} minutes, shorter than Kueue's waitForPodsReady timeout "
                        f"({pods_ready_s // 60} minutes): the first pods would stop waiting for their peers "
                        "while Kueue still lets the others start")
    return problems


def image_problems(image: str, *, registries: Sequence[str] | None, repositories: Sequence[str] = (),
                   key: str = f"{PROJECT}:job.image") -> list[str]:
    """A job's own image: pinned by digest, and (when the platform's `registries` prefixes are known) from one of
    them or one of the allowed `repositories`, which the team namespaces' admission policies also require."""
    from gpu_train.spec.pod_rules import image_allowed

    if not IMAGE_DIGEST.match(image):
        return [f"{key} {image!r} must be pinned by digest, like <registry>/<repository>@sha256:<64 hex> (push it, "
                "then use the digest the push printed)"]
    if registries is not None and not image_allowed(image, registries, repositories):
        allowed = ", ".join([*registries, *repositories]) or "none"
        return [f"{key} {image}: team namespaces admit only images from the platform registry or an allowed one "
                f"({allowed}; the stack setting image.allowedRegistries adds registries)"]
    return []


def command_problems(job: JobSpec, key: str = f"{PROJECT}:job") -> list[str]:
    """The command is present when given, and a job of its own code sets none of the bundled trainer's settings."""
    if job.command is None:
        return []
    if not job.command or not job.command[0].strip():
        return [f"{key}.command is empty: give the argv every node runs (like [\"python\", \"train.py\"]), or leave "
                "it out to run the bundled trainer"]
    if job.bundled:
        return []
    return [f"{key}.{camel} is a setting of the bundled trainer, and {key}.command runs your own code: pass it in "
            f"{key}.command's arguments instead" for name, camel in TRAINER_ONLY.items() if name in job.model_fields_set]


def job_problems(job: JobSpec, *, pools: Sequence[PoolFacts], teams: Sequence[TeamFacts], scheme: str | None,
                 key: str = f"{PROJECT}:job", registries: Sequence[str] | None = None,
                 repositories: Sequence[str] = ()) -> list[str]:
    """Everything wrong with a job on a platform with these pools and teams, each problem naming its setting.
    `scheme` is the object store's ("s3://", "gs://"), which dataset and checkpoint URIs must use; None on a
    machine without one. `registries` are the image prefixes the platform admits (its own registry and the allowed
    ones) and `repositories` the single repositories it admits besides; None where they are not known yet (the
    image is then checked for its digest only)."""
    p: list[str] = command_problems(job, key)
    if job.image:
        p += image_problems(job.image, registries=registries, repositories=repositories, key=f"{key}.image")
    if not DNS_LABEL.match(job.name):
        p.append(f"{key}.name {job.name!r} must be a lowercase DNS label of at most 32 characters")
    team = next((t for t in teams if t.name == job.team), None)
    if team is None:
        p.append(f"{key}.team {job.team!r} is not one of teams[].name ({', '.join(t.name for t in teams)})")
    pool = next((x for x in pools if x.name == job.pool), None)
    if pool is None:
        p.append(f"{key}.pool {job.pool!r} is not one of gpuPools[].name ({', '.join(x.name for x in pools)})")
    elif job.nodes.max > pool.max_nodes:
        p.append(f"{key}.nodes MAX {job.nodes.max} is more than pool {pool.name!r} maxNodes {pool.max_nodes}")
    if pool is not None and pool.gpus_per_node and job.gpus_per_node > pool.gpus_per_node:
        p.append(f"{key}.gpusPerNode {job.gpus_per_node} is more than {pool.instance_type} has ({pool.gpus_per_node})")
    p.extend(timeout_problems(rendezvous_s=job.rendezvous_timeout_minutes * 60, key=f"{key}.rendezvousTimeoutMinutes"))
    for name, camel in (("dataset_uri", "datasetUri"), ("checkpoint_uri", "checkpointUri")):
        uri = getattr(job, name)
        if scheme is not None and uri and not re.fullmatch(re.escape(scheme) + r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?", uri):
            p.append(f"{key}.{camel} must be {scheme}<bucket>/<path> (got {uri!r})")
    shape_ok = override_shape_problems(job, key, p)
    gpus = gpus_per_node(job, pool)
    if shape_ok and job.bundled:
        p.extend(trainer_problems(job, key=key))
    if team is not None and pool is not None:
        nominal = int(team.gpu_quota.get(pool.name, 0))
        need = job.nodes.min * gpus
        if nominal < need:
            index = list(teams).index(team)
            p.append(f"{PROJECT}:teams[{index}].gpuQuota gives team {team.name!r} {nominal} GPUs of nominal quota "
                     f"on pool {pool.name!r}, below the {need} that {key}.nodes MIN {job.nodes.min} x {gpus} GPUs need")
    return p


def override_shape_problems(job: JobSpec, key: str, p: list[str]) -> bool:
    ok = True
    for name, value in job.overrides.items():
        if not re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", name):
            p.append(f"{key}.overrides.{name} must be a dotted trainer key like 'train.lr'")
            ok = False
        elif name in MANAGED_OVERRIDES:
            p.append(f"{key}.overrides.{name} is set by {key}.{MANAGED_OVERRIDES[name]}; set that instead")
            ok = False
        if isinstance(value, dict | list) or value is None:
            p.append(f"{key}.overrides.{name} must be a number, string or true/false (got {value!r})")
            ok = False
        elif isinstance(value, float) and not math.isfinite(value):
            p.append(f"{key}.overrides.{name} must be a finite number (got {value!r})")
            ok = False
    return ok


def trainer_problems(job: JobSpec, *, key: str = f"{PROJECT}:job") -> list[str]:
    """The job's preset and trainer settings through the trainer's own schema. Its layout and global batch at every
    world size, and the memory a GPU needs, are gpu_train.sizing.job.layout_problems's."""
    try:
        trainer_config(job)
    except ConfigError as exc:
        text = str(exc)
        if text.startswith("--preset"):
            return [f"{key}.preset {job.preset!r}: {text.split(':', 1)[1].strip()}"]
        name = re.match(r"[a-z_]*(\.[a-z_0-9]+)?", text).group(0)  # type: ignore[union-attr]
        return [f"{setting_key(job, name, key)}: the trainer refuses it: {text}"]
    return []


def setting_key(job: JobSpec, name: str, key: str) -> str:
    """Where the job sets trainer key `name`: its own setting, an override, or (neither) its preset."""
    if name in MANAGED_OVERRIDES:
        return f"{key}.{MANAGED_OVERRIDES[name]}"
    return f"{key}.overrides.{name}" if name in job.overrides else f"{key}.preset {job.preset!r}"
