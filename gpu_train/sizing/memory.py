"""The memory one GPU needs under a layout, checked at plan and submit time against the pool's GPUs, and the layout
recommended for the large presets on each kind of GPU.

Usage:
    from gpu_train.sizing.memory import memory_per_gpu, memory_problem, recommended_layout
    est = memory_per_gpu(cfg, layout)         # MemoryEstimate: parameters, gradients, optimizer, activations, ...
    est.total / 1e9                           # GB
    memory_problem(cfg, layout, "L4")         # None, or one line naming the settings to change
    sized(cfg, world_size=8, capacity_bytes=80e9)  # cfg with train.micro_batch_size=auto made a number
    recommended_layout("gpt2-2.7b", "L4")     # {"train.pp": 4, ...}: the overrides for that GPU

It is an estimate from the model's shape (docs/trainer.md, "Choosing a layout"), meant to refuse a layout that
cannot fit before a node is started, not to predict the allocator's peak to the byte: the trainer's summary.json
reports the measured peak.

The formula, in bytes:
- parameters, gradients and AdamW's two moments are fp32: 16 bytes per parameter the GPU holds. A GPU holds the
  parameters of its pipeline stage (the blocks of pp_stages_per_rank stages, plus the embeddings on the first
  stage and the tied output layer on the last), divided by tp (matrices are split; norms are few) and, under
  FSDP, by dp_shard (HSDP replicates across dp_replicate). FSDP also gathers two blocks at a time (one
  computing, one prefetched): 2 x block parameters / tp x 6 bytes (bf16 parameters and fp32 gradients).
- activations of one micro batch, per block, in bf16 with a flash attention kernel (no T x T scores kept):
  34 x b x T x d bytes / tp with sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in
  Large Transformer Models", https://arxiv.org/abs/2205.05198, section 4); with train.activation_checkpointing
  only each block's input stays, 2 x b x T x d / tp, plus one block's full set while it is recomputed. A stage
  keeps the activations of the micro batches in flight: all of a schedule run's under GPipe, up to pp under
  1F1B (and its interleaved form), one at a time without a pipeline.
- the logits of one micro batch: b x T x vocab / tp x 10 bytes (bf16 logits, their fp32 copy and its gradient);
  with the chunked output layer and loss (train.loss_chunk_tokens, used without tensor and pipeline parallelism)
  only one chunk's, min(b x T, train.loss_chunk_tokens) x vocab x 10 bytes.
The total must fit in USABLE_FRACTION of the GPU's memory (the rest goes to the CUDA context, NCCL's buffers and
the allocator's fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpu_train.sizing.layout import Layout, pipeline_runs, resolve_layout, world_problems
from gpu_train.spec.catalog.gpus import memory_gb
from gpu_train.spec.errors import ConfigError

# Bytes per parameter a GPU holds: fp32 weights, fp32 gradients, AdamW's two fp32 moments.
PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 4, 4, 8
# Activation bytes per token and d_model of one block in 16-bit with a flash attention kernel, sequence parallel
# (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198, eq. 2 and section 4.2.2 without the T x T terms).
BLOCK_ACTIVATION_FACTOR = 34
LOGIT_BYTES = 10  # per logit: bf16 logits, their fp32 copy and its gradient
USABLE_FRACTION = 0.9  # of a GPU's memory; the rest is the CUDA context's, NCCL's and the allocator's

NVLINK_8 = ("H100", "H200", "A100-80GB", "A100-40GB", "B200")  # 8 GPUs per node on NVLink/NVSwitch
PCIE = ("L4", "L40S", "A10G")  # PCIe only, no NVLink between a node's GPUs

# The layouts docs/trainer.md recommends for the presets that need more than plain DDP, by kind of GPU. Each entry
# fits its GPUs by memory_per_gpu (tests/gpu_train/sizing/test_layout.py checks it).
RECOMMENDED_LAYOUTS: dict[str, dict[tuple[str, ...], dict[str, Any]]] = {
    "gpt2-2.7b": {
        # FSDP inside a node (NVLink), replicas across nodes (HSDP): one all-reduce of a shard per step between
        # nodes instead of all-gathers of every layer.
        NVLINK_8: {"train.parallel": "fsdp", "train.dp_shard": 8, "train.dp_replicate": -1},
        # No NVLink: four pipeline stages pass only activations between GPUs (FSDP would move every layer's
        # weights over PCIe each micro batch); whole replicas of the pipeline across what is left.
        PCIE: {"train.pp": 4, "train.pp_schedule": "1f1b", "train.dp_shard": 1, "train.dp_replicate": -1,
               "train.micro_batch_size": 2, "train.activation_checkpointing": True},
    },
    "7b": {
        # Tensor parallel pairs on NVLink halve each GPU's activations; FSDP over the rest.
        NVLINK_8: {"train.parallel": "fsdp", "train.tp": 2},
    },
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU needs, by kind (the most loaded rank: the first or the last pipeline stage)."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float  # FSDP's unsharded blocks in flight
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations + self.logits

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in (
            ("parameters", self.parameters), ("gradients", self.gradients), ("optimizer", self.optimizer),
            ("gathered blocks", self.gathered), ("activations", self.activations), ("logits", self.logits)) if v)
        return f"{self.total / 1e9:.1f} GB ({parts})"


def _block_params(m: Any) -> int:
    norms = 2 * (2 * m.d_model if m.norm == "layernorm" else m.d_model)
    return (4 + 2 * m.mlp_ratio) * m.d_model * m.d_model + norms


def _in_flight(cfg: Any, layout: Layout) -> int:
    """Micro batches whose activations a stage holds at once."""
    if layout.pp == 1:
        return 1
    per_run, _ = pipeline_runs(cfg, layout)
    return per_run if cfg.train.pp_schedule == "gpipe" else min(per_run, layout.pp)


def memory_per_gpu(cfg: Any, layout: Layout) -> MemoryEstimate:
    """The estimate of the module docstring for a trainer Config under `layout` (ConfigError when the layout does
    not fit the global batch)."""
    m, t = cfg.model, cfg.train
    act_bytes = 4 if t.precision == "fp32" else 2
    stages = layout.pp * t.pp_stages_per_rank
    layers = m.n_layer // stages * t.pp_stages_per_rank
    block = _block_params(m)
    embed = m.vocab_size * m.d_model + (m.context * m.d_model if m.pos == "learned" else 0)
    head = m.vocab_size * m.d_model if layout.pp > 1 else 0  # the last stage's copy of the tied embedding
    params = layers * block + max(embed, head) + (2 * m.d_model)
    held = params / layout.tp / (layout.dp_shard if layout.sharded else 1)
    gathered = 2 * block / layout.tp * (act_bytes + GRAD_BYTES) if layout.sharded else 0.0
    tokens = t.micro_batch_size * m.context
    full_block = BLOCK_ACTIVATION_FACTOR * tokens * m.d_model / layout.tp * act_bytes / 2
    per_block = 2 * tokens * m.d_model / layout.tp * act_bytes / 2 if t.activation_checkpointing else full_block
    activations = _in_flight(cfg, layout) * layers * per_block + (full_block if t.activation_checkpointing else 0)
    chunked = t.loss_chunk_tokens > 0 and layout.tp == 1 and layout.pp == 1  # as trainer/parallelize.py does
    logits = (min(tokens, t.loss_chunk_tokens) if chunked else tokens) * m.vocab_size / layout.tp * LOGIT_BYTES
    return MemoryEstimate(parameters=held * PARAM_BYTES, gradients=held * GRAD_BYTES, optimizer=held * OPTIMIZER_BYTES,
                          gathered=gathered, activations=activations, logits=logits)


def recommended_layout(preset: str, gpu_type: str) -> dict[str, Any] | None:
    """The overrides docs/trainer.md recommends for a preset on a kind of GPU; None when it names none."""
    for kinds, overrides in RECOMMENDED_LAYOUTS.get(preset, {}).items():
        if gpu_type in kinds:
            return dict(overrides)
    return None


def memory_problem(cfg: Any, layout: Layout, gpu_type: str, *, preset: str = "") -> str | None:
    """One line when the estimate does not fit `gpu_type`'s memory (None when it fits or the GPU is unknown)."""
    capacity = memory_gb(gpu_type)
    if capacity is None:
        return None
    est = memory_per_gpu(cfg, layout)
    usable = capacity * 1e9 * USABLE_FRACTION
    if est.total <= usable:
        return None
    hint = recommended_layout(preset, gpu_type)
    advice = ("the recommended layout on " + gpu_type + " is " + ", ".join(f"{k}={v}" for k, v in hint.items())
              if hint else "raise train.tp or train.pp, shard with train.parallel=fsdp, set "
              "train.activation_checkpointing=true or lower train.micro_batch_size")
    return (f"the model needs about {est.describe()} per GPU under {layout} (train.micro_batch_size="
            f"{cfg.train.micro_batch_size}), more than {USABLE_FRACTION:.0%} of a {gpu_type}'s {capacity} GB; "
            f"{advice} (docs/trainer.md, Choosing a layout)")


def with_micro_batch(cfg: Any, size: int) -> Any:
    return replace(cfg, train=replace(cfg.train, micro_batch_size=size))


def fitting_micro_batch(cfg: Any, world_size: int, capacity_bytes: float, *, gpus_per_node: int | None = None,
                        where: str = "") -> int:
    """train.micro_batch_size=auto at this world size: the largest micro batch whose layout divides the step
    (world_problems) and whose estimate fits USABLE_FRACTION of `capacity_bytes`, one worker's memory. ConfigError
    naming the setting when the step divides for none, or not even one sequence fits."""
    sequences = cfg.train.global_batch_tokens // cfg.model.context
    usable = capacity_bytes * USABLE_FRACTION
    smallest: MemoryEstimate | None = None
    for size in sorted((b for b in range(1, sequences + 1) if sequences % b == 0), reverse=True):
        sized_cfg = with_micro_batch(cfg, size)
        if world_problems(sized_cfg, world_size, gpus_per_node):
            continue
        smallest = memory_per_gpu(sized_cfg, resolve_layout(cfg.train, world_size))
        if smallest.total <= usable:
            return size
    where = where or f"world size {world_size}"
    if smallest is None:  # not even one sequence per micro batch: the layout's own problem
        _, text = world_problems(with_micro_batch(cfg, 1), world_size, gpus_per_node)[0]
        raise ConfigError(f"train.micro_batch_size=auto: no micro batch fits the layout at {where}: {text}")
    raise ConfigError(f"train.micro_batch_size=auto: even the smallest micro batch needs about "
                      f"{smallest.describe()} per worker at {where}, more than {USABLE_FRACTION:.0%} of "
                      f"{capacity_bytes / 1e9:.1f} GB; raise train.tp or train.pp, shard with train.parallel=fsdp or "
                      "set train.activation_checkpointing=true (docs/trainer.md, Choosing a layout)")


def sized(cfg: Any, world_size: int, capacity_bytes: float, **kwargs: Any) -> Any:
    """`cfg` with train.micro_batch_size=auto replaced by fitting_micro_batch's choice; `cfg` itself otherwise."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    return with_micro_batch(cfg, fitting_micro_batch(cfg, world_size, capacity_bytes, **kwargs))
