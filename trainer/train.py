"""The training loop: DDP or FSDP2, gradient accumulation, AdamW + warmup/cosine, checkpoints, metrics.

Usage (normally through `python -m trainer`, see trainer/__main__.py):
    from trainer.config import build_config
    from trainer.train import train
    summary = train(build_config("tiny", overrides=["train.steps=20"]), run_dir=Path("runs/dev"))

Every rank runs the same loop. Step `s` (0-based) trains on global batch `s` of the GlobalSampler; each rank
takes its contiguous slice and splits it into micro batches, so the global batch in tokens and the sample order
never depend on the number of workers. On start the newest verified checkpoint is loaded; SIGTERM finishes the
current step, saves synchronously and exits 0.

Test hook (used by tests/trainer, harmless otherwise): TRAINER_TEST_KILL_AT_STEP=N (and optionally
TRAINER_TEST_KILL_RANK=R, default 0) makes rank R SIGKILL itself in the middle of step N (after backward,
before the optimizer step) on the first launch only (TORCHELASTIC_RESTART_COUNT=0).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import flops
from trainer.checkpoint import CheckpointManager
from trainer.config import Config, ConfigError, batch_layout, flatten, to_dict
from trainer.distributed import DistEnv, init_distributed, seed_everything, shutdown
from trainer.metrics import JsonlLog, TrainerMetrics, plot_loss
from trainer.model import GPT

log = logging.getLogger("trainer")


# ---------------------------------------------------------------------------------------------- helpers
def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of 0-based optimizer step `step`: linear warmup to lr, then cosine decay to min_lr."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def params_sha256(model: torch.nn.Module) -> str | None:
    """sha256 over the full (unsharded) model state dict in sorted key order; same value for DDP and FSDP.

    Collective (gathers FSDP shards); the digest is returned on rank 0, None elsewhere.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for key in sorted(sd):
        t = sd[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def batch_hash(indices: list[int]) -> str:
    return hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()


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


class _Preemption:
    """SIGTERM (spot reclaim, pod eviction, torchrun shutdown) sets a flag; the loop saves and exits."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


def _test_kill_hook(step: int, env: DistEnv) -> None:
    at = os.environ.get("TRAINER_TEST_KILL_AT_STEP")
    if at is None or env.restart_count != 0:
        return
    if step == int(at) and env.rank == int(os.environ.get("TRAINER_TEST_KILL_RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


def _setup_logging(env: DistEnv) -> None:
    logging.basicConfig(
        level=logging.INFO if env.rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


# ---------------------------------------------------------------------------------------------- train
def train(cfg: Config, run_dir: Path) -> dict[str, Any]:
    env = init_distributed()
    try:
        return _train(cfg, Path(run_dir), env)
    finally:
        shutdown()


def _train(cfg: Config, run_dir: Path, env: DistEnv) -> dict[str, Any]:
    from trainer.data import GlobalSampler, open_dataset
    from trainer.tracking import TAG_DATASET_MANIFEST, TAG_DATASET_URI, Tracker

    _setup_logging(env)
    # `kill -USR1 <pid>` prints every thread's Python stack: the first thing to look at in a hung collective.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    preempt = _Preemption()
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    global_batch, accum = batch_layout(cfg, env.world_size)
    T = cfg.model.context
    if env.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")

    # ---- data
    ds = open_dataset(
        cfg.data.uri, context=T, cache_dir=cfg.data.cache_dir or str(run_dir / "cache"),
        cache_max_bytes=cfg.data.cache_max_bytes, prefetch_shards=cfg.data.prefetch_shards,
        endpoint_url=cfg.data.endpoint_url or os.environ.get("TRAINER_S3_ENDPOINT_URL") or None,
    )
    ds_vocab = getattr(ds, "vocab_size", None)
    if ds_vocab is not None and cfg.model.vocab_size < ds_vocab:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of dataset {cfg.data.uri} "
            f"({ds_vocab}, from its manifest); set model.vocab_size >= {ds_vocab}"
        )
    sampler = GlobalSampler(ds.num_windows, global_batch=global_batch, seed=cfg.train.seed)

    # ---- model, optimizer, schedule
    dtype = resolve_dtype(cfg, env)
    model, wrapped = build_model(cfg, env, dtype)
    optimizer = build_optimizer(model, cfg, env.device)
    t = cfg.train

    def lr_lambda(s: int) -> float:
        return lr_at(s, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps) / t.lr

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    n_params = model.num_params(non_embedding=False)
    n_nonemb = model.num_params(non_embedding=True)
    flops_token = flops.flops_per_token(n_nonemb, cfg.model.n_layer, cfg.model.n_head,
                                        cfg.model.d_model // cfg.model.n_head, T)
    peak = flops.gpu_peak_flops(torch.cuda.get_device_name(env.device) if env.is_cuda else None)

    # ---- checkpoint: resume
    ckpt = CheckpointManager(
        Path(cfg.checkpoint.local_dir or run_dir / "checkpoints"), cfg.checkpoint.remote_uri,
        keep=cfg.checkpoint.keep, env=env, async_save=cfg.checkpoint.async_save,
        endpoint_url=cfg.checkpoint.endpoint_url or None,
    )
    step, tokens_seen, run_id = 0, 0, None
    loss_value = float("nan")  # loss of the last completed step (kept in checkpoints)
    found = ckpt.find_latest()
    if found is not None:
        state = ckpt.load(found, model, optimizer)
        step, tokens_seen, run_id = state["step"], state["tokens"], state.get("mlflow_run_id")
        loss_value = state.get("loss", loss_value)
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        if sampler.next_step != step:
            raise RuntimeError(f"checkpoint {found}: sampler is at step {sampler.next_step} but step is {step}")
        log.info("resumed from %s at step %d (%d tokens seen)", found, step, tokens_seen)
    resumed_from = str(found) if found else None

    # ---- outputs
    metrics = TrainerMetrics(port=cfg.metrics.port + env.local_rank if cfg.metrics.port else 0)
    metrics.restarts.set(env.restart_count)
    jsonl = JsonlLog(run_dir / "metrics.jsonl") if env.rank == 0 else None
    tracker = Tracker.create(cfg.tracking, run_dir=run_dir, resume_run_id=run_id, enabled=env.rank == 0)
    tracker.log_params(flatten(cfg))
    tracker.set_tags({TAG_DATASET_URI: cfg.data.uri, TAG_DATASET_MANIFEST: ds.manifest_sha256})
    if jsonl:
        jsonl.write({
            "event": "start", "step": step, "world_size": env.world_size, "restart_count": env.restart_count,
            "resumed_from": resumed_from, "global_batch": global_batch, "grad_accum": accum,
            "params": n_params, "non_embedding_params": n_nonemb, "time": time.time(),
        })
        log.info(
            "model %.2fM params (%.2fM non-embedding), world %d, global batch %d x %d tokens, %d micro batches "
            "of %d per rank, %s, %s", n_params / 1e6, n_nonemb / 1e6, env.world_size, global_batch, T, accum,
            t.micro_batch_size, t.parallel, "bf16" if dtype else "fp32",
        )

    progress = None
    if env.rank == 0 and sys.stdout.isatty():
        from tqdm import tqdm

        progress = tqdm(total=t.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)

    autocast = (
        torch.autocast(env.device.type, dtype=dtype)
        if dtype is not None and t.parallel == "ddp" else contextlib.nullcontext()
    )
    per_rank = global_batch // env.world_size
    seen_saves = len(ckpt.saved)
    start_step, loop_t0 = step, time.perf_counter()
    first_loss: float | None = None  # loss of the first step of this launch, for the closing summary
    if step >= t.steps:
        log.info("checkpoint %s is already at train.steps=%d: nothing to train", found, t.steps)
    status = "completed"
    ckpt_block = 0.0

    def trainer_state() -> dict[str, Any]:
        return {
            "step": step, "tokens": tokens_seen, "loss": loss_value, "sampler": sampler.state_dict(),
            "scheduler": scheduler.state_dict(), "mlflow_run_id": tracker.run_id,
            "world_size": env.world_size,
        }

    def report_saves(seen: int) -> int:
        """Publish checkpoints that finished in the background since the last call; returns the new count."""
        for rec in ckpt.saved[seen:]:
            metrics.observe_checkpoint(rec.duration_s or 0.0, rec.finished_unix or time.time())
            tracker.log_checkpoint(rec.step, rec.remote_uri or str(rec.path))
        return len(ckpt.saved)

    wrapped.train()
    while step < t.steps:
        t_step = time.perf_counter()
        # ---- data
        indices = sampler.rank_slice(step, env.rank, env.world_size)
        if step + 1 < t.steps:
            nxt = (step + 1) * global_batch + env.rank * per_rank
            ds.prefetch(sampler.windows_at(np.arange(nxt, nxt + per_rank)).tolist())
        windows = torch.from_numpy(np.stack([ds.window(i) for i in indices]))
        windows = windows.to(env.device, non_blocking=True)
        t_data = time.perf_counter()
        # ---- forward / backward over micro batches
        loss_acc = torch.zeros((), device=env.device)
        for micro in range(accum):
            chunk = windows[micro * t.micro_batch_size:(micro + 1) * t.micro_batch_size]
            x, y = chunk[:, :-1], chunk[:, 1:]
            last = micro == accum - 1
            if t.parallel == "fsdp":
                model.set_requires_gradient_sync(last)
                sync_ctx = contextlib.nullcontext()
            else:
                ddp = wrapped._orig_mod if hasattr(wrapped, "_orig_mod") else wrapped
                sync_ctx = contextlib.nullcontext() if last else ddp.no_sync()
            with sync_ctx, autocast:
                _, loss = wrapped(x, targets=y)
                loss = loss / accum
                loss.backward()
            loss_acc += loss.detach()
        _test_kill_hook(step, env)
        t_fb = time.perf_counter()
        # ---- optimizer
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        # Mean loss over the global batch and "any rank got SIGTERM", in one small collective.
        flag = torch.stack([loss_acc.float(), torch.tensor(float(preempt.requested), device=env.device)])
        dist.all_reduce(flag)
        loss_value = flag[0].item() / env.world_size
        if first_loss is None:
            first_loss = loss_value
        stop = flag[1].item() > 0
        step += 1
        tokens_seen += t.global_batch_tokens
        t_opt = time.perf_counter()
        batch_sha = None
        if cfg.metrics.batch_hash:
            every: list[list[int] | None] = [None] * env.world_size
            dist.all_gather_object(every, indices)
            batch_sha = batch_hash([i for part in every for i in part])

        # ---- checkpoint
        ckpt_block = 0.0
        if stop or (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == t.steps:
            ckpt_block = ckpt.save(step, model, optimizer, trainer_state(), to_dict(cfg),
                                   block=stop or step == t.steps)
        t_end = time.perf_counter()

        # ---- metrics
        step_s = t_end - t_step
        tps = t.global_batch_tokens / step_s
        step_mfu = flops.mfu(tps, flops_token, peak, env.world_size)
        now = time.time()
        metrics.observe_step(
            step=step, loss=loss_value, tokens=t.global_batch_tokens, step_s=step_s, data_wait_s=t_data - t_step,
            fwd_bwd_s=t_fb - t_data, optim_s=t_opt - t_fb, ckpt_block_s=ckpt_block, tokens_per_s=tps,
            mfu=step_mfu, now=now,
        )
        seen_saves = report_saves(seen_saves)
        if jsonl:
            record = {
                "event": "step", "step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                "tokens": tokens_seen, "step_s": step_s, "data_wait_s": t_data - t_step,
                "forward_backward_s": t_fb - t_data, "optimizer_s": t_opt - t_fb, "checkpoint_block_s": ckpt_block,
                "tokens_per_s": tps, "mfu": step_mfu, "time": now,
                "checkpoint_age_s": now - ckpt.last_success_unix if ckpt.last_success_unix else None,
            }
            if batch_sha:
                record["batch_sha256"] = batch_sha
            jsonl.write(record)
        if step == t.steps or step % cfg.tracking.log_every == 0:
            tracker.log_metrics(
                {"loss": loss_value, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tps, "mfu": step_mfu,
                 "step_s": step_s, "data_wait_s": t_data - t_step, "forward_backward_s": t_fb - t_data,
                 "optimizer_s": t_opt - t_fb, "checkpoint_block_s": ckpt_block, "tokens": tokens_seen},
                step=step,
            )
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tps:,.0f}")
        elif env.rank == 0 and (step % cfg.metrics.log_every == 0 or step == t.steps):
            log.info("step %d/%d loss %.4f lr %.2e %.0f tok/s mfu %s", step, t.steps, loss_value,
                     scheduler.get_last_lr()[0], tps, flops.format_mfu(step_mfu))
        if stop:
            status = "preempted"
            log.warning("SIGTERM: saved checkpoint at step %d, exiting", step)
            break

    ckpt.wait()
    report_saves(seen_saves)
    if progress is not None:
        progress.close()
    elapsed = time.perf_counter() - loop_t0
    tokens_per_s = (step - start_step) * t.global_batch_tokens / elapsed if step > start_step else 0.0
    run_mfu = flops.mfu(tokens_per_s, flops_token, peak, env.world_size)
    digest = params_sha256(model)
    summary = {
        "step": step, "tokens": tokens_seen, "final_loss": loss_value if math.isfinite(loss_value) else None,
        "params_sha256": digest,
        "restarts": env.restart_count, "tokens_per_s": tokens_per_s, "mfu": run_mfu, "status": status,
        # Rank 0's peak GPU memory (allocated by tensors), for sizing; None on CPU.
        "peak_memory_gb": torch.cuda.max_memory_allocated(env.device) / 1e9 if env.is_cuda else None,
    }
    if env.rank == 0:
        _finish_outputs(cfg, run_dir, ckpt, model, summary, tracker, ds.manifest_sha256,
                        first=(start_step + 1, first_loss) if first_loss is not None else None)
    tracker.close(status="KILLED" if status == "preempted" else "FINISHED")
    if jsonl:
        jsonl.close()
    metrics.close()
    ckpt.close()
    ds.close()
    return summary


def _finish_outputs(cfg: Config, run_dir: Path, ckpt: CheckpointManager, model: GPT, summary: dict[str, Any],
                    tracker: Any, manifest_sha: str, first: tuple[int, float] | None) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    tracker.log_artifact(run_dir / "loss.png")
    tracker.log_artifact(run_dir / "summary.json")
    tracker.log_artifact(run_dir / "config.json")
    if cfg.tracking.register_name and summary["status"] == "completed":
        model_dir = run_dir / "model"
        model_dir.mkdir(exist_ok=True)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        torch.save(state, model_dir / "model.pt")
        (model_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        tracker.register_model(model_dir, cfg.tracking.register_name, {
            "dataset.uri": cfg.data.uri, "dataset.manifest_sha256": manifest_sha,
            "params_sha256": summary["params_sha256"], "step": summary["step"],
        })
    last = ckpt.saved[-1] if ckpt.saved else None
    lines = [
        "",
        "=" * 72,
        f"training {summary['status']}: {summary['step']}/{cfg.train.steps} steps, "
        f"{summary['tokens']:,} tokens, restarts {summary['restarts']}",
        "final loss      " + ("n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}")
        + (f"   (step {first[0]}: {first[1]:.4f})" if first else ""),
        f"throughput      {summary['tokens_per_s']:,.0f} tokens/s   MFU {flops.format_mfu(summary['mfu'])}",
        f"checkpoints     {ckpt.local_dir}" + (f"  (latest: {last.path.name})" if last else ""),
    ]
    if ckpt.remote_uri:
        lines.append(f"remote          {ckpt.remote_uri}")
    lines += [
        f"summary         {run_dir / 'summary.json'}",
        f"metrics         {run_dir / 'metrics.jsonl'}",
        f"loss curve      {run_dir / 'loss.png'}",
    ]
    hint = tracker.ui_hint()
    if hint:
        lines.append(f"mlflow          {hint}")
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)
