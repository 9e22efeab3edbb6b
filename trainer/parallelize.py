"""The model on the devices: its initial weights, its data-parallel wrapping (DDP or FSDP2), the autocast dtype,
the optimizer and the learning-rate schedule. trainer/model.py knows nothing of any of this.

Usage:
    from trainer.parallelize import build_model, build_optimizer, build_scheduler, resolve_dtype
    dtype = resolve_dtype(cfg, env)                          # bf16 on CUDA by default, None = fp32
    model, wrapped = build_model(cfg, env, dtype)            # raw GPT (state dict names) and the module to call
    with grad_sync(model, wrapped, cfg, last=micro == accum - 1): loss.backward()   # sync on the last only
    optimizer = build_optimizer(model, cfg, env.device)
    scheduler = build_scheduler(optimizer, cfg)              # linear warmup, then cosine to train.min_lr
    continue_schedule(optimizer, scheduler, cfg, step)       # after a resume: at `step` under cfg's settings

`parallelize(model, cfg, env, dtype)` is the one place that decides how a model is spread over the devices:
it takes the model and the distributed environment and returns the module the loop calls. Data parallelism
(DDP, or FSDP2's fully_shard per block + root) is what it does today; tensor and pipeline parallelism belong
here too, as torchtitan's parallelize functions do (torchtitan/models/*/parallelize.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from gpu_train.spec.trainer_config import Config
from trainer.distributed import DistEnv
from trainer.model import GPT


def resolve_dtype(cfg: Config, env: DistEnv) -> torch.dtype | None:
    """Autocast dtype, or None for fp32."""
    p = cfg.train.precision
    if p == "bf16" or (p == "auto" and env.is_cuda):
        return torch.bfloat16
    return None


def parallelize(model: GPT, cfg: Config, env: DistEnv, dtype: torch.dtype | None) -> torch.nn.Module:
    """Wrap for data parallelism; returns the module to call (the raw model keeps the state dict names)."""
    if cfg.train.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        # Parameters gathered in bf16, gradients reduced in fp32
        # (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        wrapped: torch.nn.Module = model
    else:
        wrapped = DDP(model, device_ids=[env.local_rank] if env.is_cuda else None)
    if cfg.train.compile:
        wrapped = torch.compile(wrapped)
    return wrapped


def grad_sync(model: GPT, wrapped: torch.nn.Module, cfg: Config, *, last: bool) -> contextlib.AbstractContextManager:
    """Around one micro batch's backward pass: gradients are reduced across ranks on the last micro batch only
    (DDP's no_sync before it; FSDP2's set_requires_gradient_sync)."""
    if cfg.train.parallel == "fsdp":
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    ddp = getattr(wrapped, "_orig_mod", wrapped)  # under torch.compile, DDP is inside
    return contextlib.nullcontext() if last else ddp.no_sync()


def build_model(cfg: Config, env: DistEnv, dtype: torch.dtype | None) -> tuple[GPT, torch.nn.Module]:
    """Initial weights from train.seed, identical for DDP and FSDP2; returns (raw model, module to call).

    DDP: every rank builds the model on its device from the same seed. FSDP2: the model is built on the meta
    device and sharded, so no rank ever holds all parameters on its accelerator; rank 0 initialises the full
    weights in host memory and they are scattered shard by shard (set_model_state_dict with
    broadcast_from_rank0, https://pytorch.org/docs/stable/distributed.checkpoint.html).
    """
    if cfg.train.parallel == "fsdp":
        with torch.device("meta"):
            model = GPT(cfg.model)
        model.activation_checkpointing = cfg.train.activation_checkpointing
        full: dict[str, torch.Tensor] = {}
        if env.rank == 0:
            torch.manual_seed(cfg.train.seed)
            full = GPT(cfg.model).state_dict()
        wrapped = parallelize(model, cfg, env, dtype)
        model.to_empty(device=env.device)
        model.init_buffers()
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        del full
    else:
        torch.manual_seed(cfg.train.seed)
        with torch.device(env.device):
            model = GPT(cfg.model)
        model.activation_checkpointing = cfg.train.activation_checkpointing
        wrapped = parallelize(model, cfg, env, dtype)
    # From here on each rank draws from its own stream (dropout); restored per rank on resume.
    torch.manual_seed(cfg.train.seed + 1 + env.rank)
    return model, wrapped


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains/biases are not decayed)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), fused=device.type == "cuda"
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
