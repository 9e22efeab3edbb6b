"""How a run is spread over its GPUs: the (pp, dp_replicate, dp_shard, tp) degrees at a world size, the checks
that refuse a layout that does not fit a world size before anything starts, and the pipeline's micro-batches. The
degrees that cannot work at any world size are refused by the trainer's schema (gpu_train.spec.trainer_config,
static_problems); the memory a GPU needs under a layout is gpu_train/sizing/memory.py's.

Usage:
    from gpu_train.sizing.layout import batch_layout, resolve_layout, world_problems
    layout = resolve_layout(cfg.train, world_size=16)     # Layout(pp=2, dp_replicate=1, dp_shard=4, tp=2)
    layout.dp, layout.world                                # 4, 16
    world_problems(cfg, world_size=16, gpus_per_node=8)    # [] or lines naming the setting
    batch_layout(cfg, world_size=16)                       # (global batch in sequences, micro batches per rank)

The mesh. Ranks are laid out as a row-major array of shape (pp, dp_replicate, dp_shard, tp), tp innermost:
global rank = ((pp_rank * dp_replicate + replicate_rank) * dp_shard + shard_rank) * tp + tp_rank. torchrun numbers
ranks node by node (a node's workers hold consecutive ranks), so when train.tp divides the GPUs per node, every
tensor-parallel group is one node's GPUs (NVLink), and the data-parallel and pipeline groups are the ones that cross
nodes. Nothing else places ranks: the JobSet gives each pod a node's GPUs and torchrun numbers them.

Degrees. train.tp and train.pp are fixed for the run; data parallelism takes what is left of the world,
world / (pp x tp), so an elastic job that gains or loses nodes changes only its data-parallel degree. Under
train.parallel=ddp all of it replicates (dp_replicate = the rest, dp_shard = 1); under fsdp, train.dp_shard and
train.dp_replicate split it (HSDP: shard inside a group of dp_shard ranks, replicate across dp_replicate groups),
-1 meaning "the rest".

Micro-batches. Each data-parallel rank trains global batch / dp sequences per step, in micro batches of
train.micro_batch_size. Without pipeline parallelism they run one after the other (gradient accumulation). With it,
the pipeline schedule runs train.pp_microbatches of them at a time (0: all of the step's), so a step is
micro_batches / pp_microbatches schedule runs; each run must have at least as many micro batches as there are
stages, or a stage would wait with nothing to do for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_train.spec.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Layout:
    """The degrees of one run at one world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def sharded(self) -> bool:
        """Whether the model goes through FSDP2 (sharded, or replicated through FSDP2 under tp/pp)."""
        return self.tp > 1 or self.pp > 1 or self.dp_shard > 1

    def __str__(self) -> str:
        return f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"


class LayoutError(ConfigError):
    """A layout that does not fit a world size; `setting` is the trainer key to change."""

    def __init__(self, setting: str, text: str) -> None:
        self.setting = setting
        super().__init__(text)


def resolve_layout(train: Any, world_size: int) -> Layout:
    """The degrees at `world_size` (train: a TrainConfig); LayoutError naming the setting when they do not fit."""
    model_parallel = train.pp * train.tp
    if world_size % model_parallel:
        raise LayoutError("train.pp" if train.pp > 1 else "train.tp",
                          f"world size {world_size} is not a multiple of train.pp x train.tp = {train.pp} x "
                          f"{train.tp} = {model_parallel}")
    rest = world_size // model_parallel
    if train.parallel == "ddp":
        return Layout(pp=train.pp, dp_replicate=rest, dp_shard=1, tp=train.tp)
    rep, shard = train.dp_replicate, train.dp_shard
    where = f"the data-parallel degree {rest} (world size {world_size} / (train.pp x train.tp))"
    if shard == -1:
        if rest % rep:
            raise LayoutError("train.dp_replicate", f"train.dp_replicate={rep} does not divide {where}")
        shard = rest // rep
    elif rep == -1:
        if rest % shard:
            raise LayoutError("train.dp_shard", f"train.dp_shard={shard} does not divide {where}")
        rep = rest // shard
    elif rep * shard != rest:
        raise LayoutError("train.dp_shard", f"train.dp_replicate={rep} x train.dp_shard={shard} = {rep * shard} is "
                          f"not {where}; set one of them to -1")
    return Layout(pp=train.pp, dp_replicate=rep, dp_shard=shard, tp=train.tp)


def micro_batches(cfg: Any, layout: Layout) -> int:
    """Micro batches of train.micro_batch_size per data-parallel rank per step; LayoutError when the global batch
    does not divide."""
    sequences = cfg.train.global_batch_tokens // cfg.model.context
    per_step = layout.dp * cfg.train.micro_batch_size
    if sequences % per_step:
        dp = f"data-parallel degree {layout.dp} (world size {layout.world} / (train.pp x train.tp))" \
            if layout.pp * layout.tp > 1 else f"world size ({layout.world})"
        raise LayoutError("train.global_batch_tokens",
                          f"train.global_batch_tokens / model.context = {sequences} sequences is not divisible by "
                          f"{dp} x train.micro_batch_size ({cfg.train.micro_batch_size}) = {per_step}; change "
                          "train.global_batch_tokens or train.micro_batch_size")
    return sequences // per_step


def batch_layout(cfg: Any, world_size: int) -> tuple[int, int]:
    """(global batch in sequences, micro batches per data-parallel rank per step) for this world size.

    The global batch is fixed by the config; the number of micro batches absorbs the data-parallel degree, which
    is the world size divided by train.pp x train.tp (gpu_train/sizing/layout.py).
    """
    layout = resolve_layout(cfg.train, world_size)
    return cfg.train.global_batch_tokens // cfg.model.context, micro_batches(cfg, layout)


def pipeline_runs(cfg: Any, layout: Layout) -> tuple[int, int]:
    """(micro batches per schedule run, schedule runs per step) under pipeline parallelism; LayoutError when the
    step's micro batches do not split into runs of at least train.pp."""
    t, total = cfg.train, micro_batches(cfg, layout)
    per_run = t.pp_microbatches or total
    if total % per_run:
        raise LayoutError("train.pp_microbatches",
                          f"train.pp_microbatches={t.pp_microbatches} does not divide the {total} micro batches of "
                          f"a data-parallel rank's step at world size {layout.world}")
    if per_run < layout.pp:
        raise LayoutError("train.micro_batch_size",
                          f"train.pp={layout.pp}: a schedule run has {per_run} micro batches at world size "
                          f"{layout.world}, fewer than the {layout.pp} stages (the pipeline would idle); lower "
                          "train.micro_batch_size or raise train.global_batch_tokens")
    rounds = per_run // layout.pp  # torch's interleaved 1F1B runs its micro batches in rounds of pp
    if t.pp_schedule == "interleaved_1f1b" and per_run % rounds:
        raise LayoutError("train.pp_microbatches",
                          f"train.pp_schedule=interleaved_1f1b: a schedule run's {per_run} micro batches at world "
                          f"size {layout.world} do not split into its {rounds} rounds of train.pp={layout.pp}")
    return per_run, total // per_run


def world_problems(cfg: Any, world_size: int, gpus_per_node: int | None = None) -> list[tuple[str, str]]:
    """What is wrong with the layout at this world size (and node size, when known), as (trainer setting, text)
    pairs; [] when it fits."""
    t = cfg.train
    if gpus_per_node:
        if t.tp > gpus_per_node:
            return [("train.tp", f"train.tp={t.tp} is more than the {gpus_per_node} GPUs of a node: a "
                                 "tensor-parallel group must stay on one node's NVLink")]
        if gpus_per_node % t.tp:
            return [("train.tp", f"train.tp={t.tp} does not divide the {gpus_per_node} GPUs of a node: a "
                                 "tensor-parallel group would span two nodes")]
    try:
        layout = resolve_layout(t, world_size)
        if layout.pp > 1:
            pipeline_runs(cfg, layout)
        else:
            micro_batches(cfg, layout)
    except LayoutError as exc:
        return [(exc.setting, str(exc))]
    return []


def stage_layers(n_layer: int, stages: int) -> list[range]:
    """The block indices of each pipeline stage: consecutive, equal groups."""
    per = n_layer // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages one pipeline rank holds: rank r holds r, r + pp, r + 2 pp, ... (the interleaved schedules'
    loop order; stage 0 is on the first rank, the last stage on the last)."""
    return [pp_rank + i * pp for i in range(stages_per_rank)]
