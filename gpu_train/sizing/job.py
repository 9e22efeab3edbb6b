"""A job's fit to its GPUs, checked beside gpu_train.spec.job.job_problems by the plan, `submit` and `run --local`.

Usage: `layout_problems(job, pools=pools)` ([] or where the job first does not fit, naming the setting);
`memory_line(job, gpus=8, gpu_type="H100")` (the line `gpu-train submit` prints)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gpu_train.sizing.layout import resolve_layout, world_problems
from gpu_train.sizing.memory import memory_per_gpu, memory_problem, sized
from gpu_train.spec.catalog.gpus import memory_gb
from gpu_train.spec.errors import ConfigError
from gpu_train.spec.job import (
    JobSpec,
    PoolFacts,
    World,
    gpus_per_node,
    override_shape_problems,
    setting_key,
    trainer_config,
)
from gpu_train.spec.naming import PROJECT


def layout_problems(job: JobSpec, *, pools: Sequence[PoolFacts], key: str = f"{PROJECT}:job") -> list[str]:
    """The bundled trainer's layout, global batch and memory at every world size from MIN to MAX nodes of its pool's
    GPUs; [] where job_problems refuses the trainer settings or the GPUs per node are not known."""
    pool = next((x for x in pools if x.name == job.pool), None)
    gpus = gpus_per_node(job, pool)
    if not job.bundled or gpus < 1 or not override_shape_problems(job, key, []):
        return []
    try:
        tcfg = trainer_config(job)
    except ConfigError:
        return []
    return _world_problems(job, tcfg, gpus=gpus, gpu_type=pool.gpu_type if pool is not None else "", key=key)


def _world_problems(job: JobSpec, tcfg: Any, *, gpus: int, gpu_type: str, key: str) -> list[str]:
    """The first world size from MIN to MAX nodes where the layout or the batch does not fit, or the model does not
    fit a GPU's memory (gpu_train/sizing/layout.py, gpu_train/sizing/memory.py)."""
    lo, hi = job.nodes.min, job.nodes.max
    model_parallel = tcfg.train.pp * tcfg.train.tp
    auto = tcfg.train.micro_batch_size == "auto"
    capacity = (memory_gb(gpu_type) or math.inf) * 1e9  # an unknown GPU: the layout alone sizes auto

    world = World(job.nodes, gpus)

    def where(n: int) -> str:
        return world.describe(n, within=f"{key}.nodes {job.nodes}")

    sized_at: dict[int, Any] = {}
    for n in range(lo, hi + 1):
        try:  # train.micro_batch_size=auto as the trainer will choose it on this pool's GPUs
            sized_at[n] = sized(tcfg, n * gpus, capacity, gpus_per_node=gpus, where=where(n))
        except ConfigError as exc:
            return [f"{setting_key(job, 'train.micro_batch_size', key)}: {exc}"]
    for n in range(lo, hi + 1):
        tcfg = sized_at[n]
        for setting, text in world_problems(tcfg, n * gpus, gpus_per_node=gpus):
            if setting != "train.global_batch_tokens":
                return [f"{setting_key(job, setting, key)}: the layout does not fit {where(n)}: {text}"]
            per_step = tcfg.train.micro_batch_size * tcfg.model.context
            sizes = [m * gpus for m in range(lo, hi + 1)]
            lcm = math.lcm(*(size // model_parallel for size in sizes)) * per_step
            hint = (f"A multiple of {lcm} tokens works at every world size from {sizes[0]} to {sizes[-1]}"
                    if lcm <= 1 << 32 else f"No global batch of practical size divides every world size from "
                    f"{sizes[0]} to {sizes[-1]}; narrow {key}.nodes")
            return [f"{key}.globalBatchTokens {job.global_batch_tokens} does not divide at {where(n)}: "
                    f"{text}. {hint}"]
    for n in range(lo, hi + 1) if gpu_type and not auto else ():
        problem = memory_problem(sized_at[n], resolve_layout(tcfg.train, n * gpus), gpu_type, preset=job.preset)
        if problem:
            return [f"{key}.pool {job.pool!r}: at {where(n)}, {problem}"]
    return []


def memory_line(job: JobSpec, *, gpus: int, gpu_type: str) -> str:
    """The line `gpu-train submit` prints: the memory a GPU needs under the job's layout at MIN nodes, where it is
    largest (more nodes only add data-parallel ranks, which shard or replicate, never add, what a GPU holds); the
    line names that world size as the carbon line names its own (World.describe)."""
    world = World(job.nodes, gpus)
    capacity = memory_gb(gpu_type)
    try:
        tcfg = trainer_config(job)
        auto = tcfg.train.micro_batch_size == "auto"
        tcfg = sized(tcfg, world.size(job.nodes.min), (capacity or math.inf) * 1e9, gpus_per_node=gpus)
        layout = resolve_layout(tcfg.train, world.size(job.nodes.min))
        estimate = memory_per_gpu(tcfg, layout)
    except ConfigError as exc:
        return f"memory: no estimate ({exc})"
    of = f" of a {gpu_type}'s {capacity} GB" if capacity else ""
    chosen = f", train.micro_batch_size=auto: {tcfg.train.micro_batch_size}" if auto else ""
    return (f"memory: ~{estimate.describe()} per GPU{of}, under {layout}{chosen} at "
            f"{world.describe(job.nodes.min, 'MIN')}, where a GPU holds the most")
