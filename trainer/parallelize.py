"""The model on the devices: its initial weights, how it is spread over the ranks (DDP, FSDP2, tensor and pipeline
parallelism on one DeviceMesh), the autocast dtype, the optimizer and the learning-rate schedule. trainer/model.py
knows nothing of any of this.

Usage:
    from trainer.parallelize import build_model, build_optimizer, build_scheduler, resolve_dtype
    dtype = resolve_dtype(cfg, env)                          # bf16 on CUDA by default, None = fp32
    model, runner = build_model(cfg, env, dtype)             # this rank's GPT (state dict names) and its StepRunner
    loss = runner.forward_backward(windows, micro_batches)   # a step's forward and backward passes
    norm = runner.clip_grad_norm_(cfg.train.grad_clip)       # the global gradient norm, a device tensor
    optimizer = build_optimizer(model, cfg, env.device)
    scheduler = build_scheduler(optimizer, cfg)              # linear warmup, then cosine to train.min_lr
    continue_schedule(optimizer, scheduler, cfg, step)       # after a resume: at `step` under cfg's settings

The layout (gpu_train/sizing/layout.py) says how many ranks each kind of parallelism gets. With train.tp = train.pp
= 1 and train.parallel=ddp the model is wrapped in DDP (on one worker it runs unwrapped: nothing to reduce); otherwise
the ranks form a DeviceMesh of shape (pp,
dp_replicate, dp_shard, tp), and, as torchtitan's parallelize functions do (torchtitan/models/llama3/infra/
parallelize.py): pipeline stages are cut first (trainer/pipeline.py), tensor parallelism is applied on the "tp"
dimension (trainer/runner.py), then FSDP2's fully_shard per block and per stage on the data-parallel dimensions ("dp_shard", or
("dp_replicate", "dp_shard") for HSDP; under train.parallel=ddp a shard group of one, so parameters stay
replicated and FSDP2 all-reduces the gradients). Every parameter keeps its name in every layout, so DCP reshards
a checkpoint from one layout to another.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from gpu_train.sizing.layout import Layout, resolve_layout
from gpu_train.sizing.memory import memory_per_gpu, sized
from gpu_train.spec.trainer_config import Config, ModelConfig
from trainer.distributed import DistEnv
from trainer.errors import BadInput
from trainer.model import GPT
from trainer.pipeline import PipelineRunner
from trainer.runner import StepRunner, build_mesh, dp_mesh, fully_shard_model, tensor_parallel

log = logging.getLogger(__name__)


def resolve_dtype(cfg: Config, env: DistEnv) -> torch.dtype | None:
    """Autocast dtype, or None for fp32."""
    p = cfg.train.precision
    if p == "bf16" or (p == "auto" and env.is_cuda):
        return torch.bfloat16
    return None


def model_params(model: ModelConfig) -> tuple[int, int]:
    """(all parameters, non-embedding parameters) of the whole model, whatever part of it this rank holds."""
    with torch.device("meta"):
        full = GPT(model)
    return full.num_params(non_embedding=False), full.num_params(non_embedding=True)


# ---------------------------------------------------------------------------------------------- layout
def worker_memory_bytes(device: torch.device, local_world_size: int) -> tuple[float, str]:
    """(bytes, what they are) one worker on `device` may fill: its GPU's memory, or on a CPU its share of the host's
    among the node's `local_world_size` workers."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"a {props.name}'s memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / local_world_size, f"1/{local_world_size} of this host's memory"


def sized_config(cfg: Config, env: DistEnv) -> Config:
    """`cfg` with train.micro_batch_size=auto replaced by the largest micro batch that fits this worker's memory by
    the plan's estimate (gpu_train/sizing/memory.py fitting_micro_batch); one log line says what was chosen."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    capacity, what = worker_memory_bytes(env.device, env.local_world_size)
    chosen = sized(cfg, env.world_size, capacity, gpus_per_node=env.local_world_size,
                   where=f"world size {env.world_size}")
    if env.rank == 0:
        est = memory_per_gpu(chosen, resolve_layout(chosen.train, env.world_size))
        log.info("train.micro_batch_size=auto: %d at world size %d, estimated %s per worker of %.1f GB (%s)",
                 chosen.train.micro_batch_size, env.world_size, est.describe(), capacity / 1e9, what)
    return chosen


def rank_layout(cfg: Config, env: DistEnv) -> Layout:
    """The layout at this world size; BadInput naming the setting when it does not fit (the plan checks the same
    before a job starts, gpu_train/sizing/layout.py)."""
    layout = resolve_layout(cfg.train, env.world_size)  # ConfigError is a BadInput
    if env.local_world_size % layout.tp:
        raise BadInput(f"train.tp={layout.tp} does not divide the {env.local_world_size} workers of this node: a "
                       "tensor-parallel group would span two nodes")
    if cfg.train.parallel == "fsdp" and layout.world == 1 and env.rank == 0:
        log.warning("train.parallel=fsdp in a world of one worker shards nothing, yet FSDP2 still gathers and "
                    "reduces every block each step (0.26x to 0.41x the bare loop's tokens/s on one H100, "
                    "docs/performance.md); train.parallel=ddp is the faster choice for one worker")
    return layout


def _initial_weights(cfg: Config, env: DistEnv) -> dict[str, torch.Tensor]:
    """Rank 0's full initial weights from train.seed in host memory ({} elsewhere): the same in every layout."""
    if env.rank != 0:
        return {}
    torch.manual_seed(cfg.train.seed)
    return GPT(cfg.model).state_dict()


def build_model(cfg: Config, env: DistEnv, dtype: torch.dtype | None) -> tuple[GPT, StepRunner]:
    """Initial weights from train.seed, identical in every layout; returns (this rank's model, its StepRunner).

    DDP: every rank builds the model on its device from the same seed. Otherwise the model is built on the meta
    device, cut into this rank's pipeline stages, split and sharded, so no rank ever holds all parameters on its
    accelerator; rank 0 initialises the full weights in host memory and they are scattered shard by shard
    (set_model_state_dict with broadcast_from_rank0, https://pytorch.org/docs/stable/distributed.checkpoint.html).
    """
    layout = rank_layout(cfg, env)
    if not layout.sharded and cfg.train.parallel == "ddp":
        torch.manual_seed(cfg.train.seed)
        with torch.device(env.device):
            model = GPT(cfg.model)
        model.activation_checkpointing = cfg.train.activation_checkpointing
        model.loss_chunk_tokens = cfg.train.loss_chunk_tokens
        # One worker has no gradients to reduce: DDP's reducer (its hooks and bucket copies) would be pure overhead,
        # so, as torchtitan applies data parallelism only across more than one rank, the model runs unwrapped.
        wrapped = DDP(model, device_ids=[env.local_rank] if env.is_cuda else None) if env.world_size > 1 else model
        runner: StepRunner = StepRunner(layout, env, model, torch.compile(wrapped) if cfg.train.compile else wrapped,
                                        autocast_dtype=dtype, attention=cfg.train.attention)
    else:
        mesh = build_mesh(layout, env)
        with torch.device("meta"):
            model = GPT(cfg.model)
        model.activation_checkpointing = cfg.train.activation_checkpointing
        full = _initial_weights(cfg, env)
        if layout.pp > 1:
            runner = PipelineRunner(cfg, layout, env, model, mesh, dtype)  # cuts, splits, shards, materialises
        else:
            if layout.tp > 1:
                tensor_parallel(model, mesh["tp"])
            else:  # under tensor parallelism the loss is computed on vocabulary shards instead (trainer/runner.py)
                model.loss_chunk_tokens = cfg.train.loss_chunk_tokens
            fully_shard_model([model], list(model.blocks.values()), dp_mesh(mesh, layout), dtype)
            runner = StepRunner(layout, env, model, torch.compile(model) if cfg.train.compile else model, mesh=mesh,
                                attention=cfg.train.attention)
            model.to_empty(device=env.device)
            model.init_buffers()
        # Rank 0's full weights hold other stages' blocks too: each rank keeps its own (strict only without a pipeline).
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                   strict=layout.pp == 1))
        del full
    # From here on each rank draws from its own stream (dropout); restored per rank on resume.
    torch.manual_seed(cfg.train.seed + 1 + env.rank)
    return model, runner


# ---------------------------------------------------------------------------------------------- optimizer
def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains/biases are not decayed), the fused kernel on every
    device (CUDA and CPU): it alone takes `found_inf`, through which a step that must not be applied is skipped on
    the device (trainer/step_flags.py), and it reads no step counter on the host. `device` is kept for callers."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), fused=True
    )


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of 0-based optimizer step `step`: linear warmup to lr, then cosine decay to min_lr."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def schedule_lr(step: int, cfg: Config) -> float:
    """The learning rate of 0-based optimizer step `step` under cfg's train.* settings."""
    t = cfg.train
    return lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at` as a scheduler (its state goes into every checkpoint)."""
    t = cfg.train
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(
        s, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps) / t.lr)


# The settings a checkpoint's optimizer and scheduler state carries, which a resume takes from the new config.
HYPERPARAMETERS = ("lr", "min_lr", "warmup_steps", "steps", "weight_decay", "beta1", "beta2")


def continue_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: Config,
                      step: int) -> None:
    """After loading a checkpoint of `step`: the optimizer and scheduler at that step under cfg's settings.

    The schedule is a pure function of (step, current settings): the optimizer's and scheduler's saved learning
    rates (the old train.lr as base, the lr of the old schedule) are replaced by `schedule_lr(step, cfg)`, so a
    changed train.lr, min_lr, warmup_steps or steps takes effect at once, without repeating the warmup (unless
    the new warmup_steps is beyond `step`) and with the cosine decay ending at the new train.steps. AdamW's
    weight decay and betas, also saved with the optimizer, are set from cfg as well (no decay on the second
    group stays no decay). The moments (exp_avg, exp_avg_sq) and the step counts are kept."""
    t = cfg.train
    lr = schedule_lr(step, cfg)
    for i, group in enumerate(optimizer.param_groups):
        group["lr"], group["initial_lr"], group["betas"] = lr, t.lr, (t.beta1, t.beta2)
        group["weight_decay"] = t.weight_decay if i == 0 else 0.0
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    scheduler.last_epoch = step
    scheduler._last_lr = [lr] * len(optimizer.param_groups)  # what get_last_lr() reports


def schedule_change(old_train: dict, cfg: Config, step: int) -> str | None:
    """One line for a resume at `step` whose settings differ from the checkpoint's train.* (`old_train`, from its
    manifest) in HYPERPARAMETERS: each changed setting old -> new, and the lr at `step` before and after; None
    when nothing changed."""
    new = dataclasses.asdict(cfg.train)
    changed = [k for k in HYPERPARAMETERS if k in old_train and old_train[k] != new[k]]
    if not changed:
        return None
    settings = ", ".join(f"train.{k} {old_train[k]!r} -> {new[k]!r}" for k in changed)
    try:
        before = lr_at(step, lr=float(old_train["lr"]), min_lr=float(old_train["min_lr"]),
                       warmup_steps=int(old_train["warmup_steps"]), total_steps=int(old_train["steps"]))
        lrs = f"lr of step {step + 1}: {before:.4g} -> {schedule_lr(step, cfg):.4g}"
    except (KeyError, TypeError, ValueError):
        lrs = f"lr of step {step + 1}: {schedule_lr(step, cfg):.4g}"
    warmup = cfg.train.warmup_steps
    how = (f"the warmup continues to step {warmup}" if step < warmup else "the warmup is not repeated")
    return (f"resuming at step {step} with changed settings: {settings}; {lrs} (the schedule continues at this "
            f"step under the new settings: {how}, the cosine decay reaches train.min_lr at step {cfg.train.steps})")
