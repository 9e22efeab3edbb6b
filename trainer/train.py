"""The training loop: DDP or FSDP2, gradient accumulation, AdamW + warmup/cosine, checkpoints, metrics.

Usage (normally through `python -m trainer`, see trainer/__main__.py):
    from trainer.config import build_config
    from trainer.train import train
    summary = train(build_config("tiny", overrides=["train.steps=20"]), run_dir=Path("runs/dev"))
    summary["status"]      # "completed" or "preempted"; bad input raises BadInput, a retryable failure
                           # TrainingFailed (trainer/errors.py)

Every rank runs the same loop. Step `s` (0-based) trains on global batch `s` of the GlobalSampler; each rank
takes its contiguous slice and splits it into micro batches, so the global batch in tokens and the sample order
never depend on the number of workers. On start the newest checkpoint that every rank can load is restored
(trainer/checkpoint.py).

Decisions every rank must take together go through collectives, so no rank waits for another that has
already given up: the inputs are checked on every rank and the verdict all-gathered before anything is
written; after each step's backward pass one all-reduce carries the loss, "some rank got SIGTERM", "some rank
hit bad data" and "some rank hit a storage failure", before the optimizer step. Then:
- SIGTERM anywhere: every rank finishes the step, saves a checkpoint synchronously and returns "preempted"
  (exit 75: resumable, not completed);
- a non-finite loss (or, with train.grad_clip, a non-finite gradient norm): the step is not applied, nothing
  is saved, BadInput (exit 2), since a restart would replay the same step from the same checkpoint;
- a data error: BadInput for a missing or corrupt shard, TrainingFailed for a storage outage.

Test hook (used by tests/trainer and bench/recovery.py, harmless otherwise): TRAINER_TEST_KILL_AT_STEP=N (and
optionally TRAINER_TEST_KILL_RANK=R, default 0) makes rank R SIGKILL itself in the middle of 0-based step N
(after backward, before the optimizer step), once: it first creates the file TRAINER_TEST_KILL_MARKER (default
RUN_DIR/.test-kill-N) and does nothing if that file exists.
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
from trainer.checkpoint import CheckpointInvalid, CheckpointManager
from trainer.config import Config, batch_layout, flatten, to_dict
from trainer.distributed import DistEnv, init_distributed, seed_everything, shutdown
from trainer.errors import BadInput, TrainingFailed, one_line
from trainer.metrics import JsonlLog, TrainerMetrics, plot_loss
from trainer.model import GPT
from trainer.preflight import check_inputs, checkpoint_dir_of

log = logging.getLogger("trainer")

# Keys that fix the parameter shapes: a checkpoint made with other values cannot be loaded.
SHAPE_KEYS = ("n_layer", "n_head", "d_model", "context", "vocab_size", "norm", "pos", "mlp_ratio")


# ---------------------------------------------------------------------------------------------- helpers
def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of 0-based optimizer step `step`: linear warmup to lr, then cosine decay to min_lr."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict in host memory on rank 0, {} elsewhere.

    Collective: FSDP2 gathers its shards, so every rank must call it (rank 0 alone would wait forever).
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.get_rank() == 0 else {}


def state_sha256(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over a full state dict in sorted key order; the same value for DDP and FSDP."""
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
    """SIGTERM (spot reclaim, pod eviction, torchrun shutting down) sets a flag; the loop saves and stops."""

    def __init__(self) -> None:
        self.requested = False
        self.at: float | None = None  # monotonic time of the first SIGTERM
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self.at is None:
            self.at = time.monotonic()

    def report(self, step: int, saved: bool) -> None:
        """Say how much of torchrun's shutdown timeout the final save used (the launcher passes the timeout as
        TRAINER_SHUTDOWN_TIMEOUT_S); torchrun SIGKILLs the workers when it runs out."""
        what = "saved checkpoint" if saved else "checkpoint FAILED"
        budget = os.environ.get("TRAINER_SHUTDOWN_TIMEOUT_S", "")
        if self.at is None:
            log.warning("SIGTERM: %s at step %d, stopping (the signal reached another node)", what, step)
            return
        used = time.monotonic() - self.at
        if budget.isdigit():
            log.warning("SIGTERM: %s at step %d, stopping (%.1fs after the signal; torchrun kills workers %ss "
                        "after it)", what, step, used, budget)
            if used > 0.5 * int(budget):
                log.warning("the final checkpoint took %.1fs, more than half of torchrun's --shutdown-timeout "
                            "(%ss): raise it and the pod's terminationGracePeriodSeconds", used, budget)
        else:
            log.warning("SIGTERM: %s at step %d, stopping (%.1fs after the signal)", what, step, used)


def _test_kill_hook(step: int, env: DistEnv, run_dir: Path) -> None:
    at = os.environ.get("TRAINER_TEST_KILL_AT_STEP")
    if at is None or step != int(at) or env.rank != int(os.environ.get("TRAINER_TEST_KILL_RANK", "0")):
        return
    marker = Path(os.environ.get("TRAINER_TEST_KILL_MARKER") or run_dir / f".test-kill-{at}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _setup_logging(env: DistEnv) -> None:
    # INFO from one worker per node (what this node resumed from, what it downloaded), warnings from all.
    logging.basicConfig(
        level=logging.INFO if env.local_rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _agree(error: str | None, world: int) -> str | None:
    """The first error any rank reports (all ranks get the same answer); None if there is none. Collective."""
    every: list[str | None] = [None] * world
    dist.all_gather_object(every, error)
    return next((e for e in every if e), None)


def _shape(model_cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={model_cfg.get(k)!r}" for k in SHAPE_KEYS)


def compatibility_problem(cfg: Config, manifest: dict[str, Any], where: str, manifest_sha: str) -> str | None:
    """Why the checkpoint described by `manifest` must not be resumed with `cfg` and this dataset, or None.

    The model shape must match (else DCP cannot load it), and so must what fixes the sample order: the
    dataset's manifest hash, train.global_batch_tokens and train.seed (else the run would silently continue on
    other data or another order). Everything else (steps, learning rate, world size, ddp/fsdp) may change.
    """
    ck_cfg = manifest.get("config") or {}
    ck_model = ck_cfg.get("model")
    mine = to_dict(cfg)
    if isinstance(ck_model, dict):
        differ = [k for k in SHAPE_KEYS if ck_model.get(k) != mine["model"][k]]
        if differ:
            return (f"checkpoint {where} holds a model with {_shape(ck_model)} but the settings ask for "
                    f"{_shape(mine['model'])} (model.{', model.'.join(differ)} differ): set them back, or train "
                    "the new shape in a new --run-dir with its own checkpoint.local_dir and checkpoint.remote_uri")
    ck_train = ck_cfg.get("train")
    if isinstance(ck_train, dict):
        for key in ("global_batch_tokens", "seed"):
            if key in ck_train and ck_train[key] != mine["train"][key]:
                return (f"checkpoint {where} was trained with train.{key}={ck_train[key]} but the settings say "
                        f"train.{key}={mine['train'][key]}: the sample order would change mid-run; set it back or "
                        "start a new run directory")
    data = (manifest.get("trainer") or {}).get("dataset")
    if isinstance(data, dict) and data.get("manifest_sha256") and data["manifest_sha256"] != manifest_sha:
        return (f"checkpoint {where} was trained on dataset {data.get('uri')} (manifest sha256 "
                f"{str(data['manifest_sha256'])[:16]}) but data.uri={cfg.data.uri} has manifest sha256 "
                f"{manifest_sha[:16]}: resume with the same dataset, or start a new run directory")
    return None


# ---------------------------------------------------------------------------------------------- train
def train(cfg: Config, run_dir: Path) -> dict[str, Any]:
    env = init_distributed()
    try:
        return _train(cfg, Path(run_dir), env)
    finally:
        shutdown()


def _train(cfg: Config, run_dir: Path, env: DistEnv) -> dict[str, Any]:
    from trainer.data import DataError, GlobalSampler
    from trainer.tracking import TAG_DATASET_MANIFEST, TAG_DATASET_URI, Tracker

    _setup_logging(env)
    # `kill -USR1 <pid>` prints every thread's Python stack: the first thing to look at in a hung collective.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    preempt = _Preemption()
    t = cfg.train
    T = cfg.model.context

    # ---- inputs: checked on every rank, verdict agreed before anything is written
    ds = None
    problem = None
    try:
        ds = check_inputs(cfg, run_dir, world_sizes=[env.world_size], local_world_size=env.local_world_size)
    except BadInput as exc:
        problem = str(exc)
    problem = _agree(problem, env.world_size)
    if problem:
        if ds is not None:
            ds.close()
        raise BadInput(problem)
    assert ds is not None
    global_batch, accum = batch_layout(cfg, env.world_size)
    seed_everything(t.seed, t.deterministic)
    dataset_info = {"uri": cfg.data.uri, "manifest_sha256": ds.manifest_sha256}

    # ---- model, optimizer, schedule, sampler
    dtype = resolve_dtype(cfg, env)

    def lr_lambda(s: int) -> float:
        return lr_at(s, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps) / t.lr

    def fresh() -> tuple[GPT, torch.nn.Module, torch.optim.Optimizer, Any, Any]:
        model, wrapped = build_model(cfg, env, dtype)
        optimizer = build_optimizer(model, cfg, env.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        sampler = GlobalSampler(ds.num_windows, global_batch=global_batch, seed=t.seed)
        return model, wrapped, optimizer, scheduler, sampler

    model, wrapped, optimizer, scheduler, sampler = fresh()
    n_params = model.num_params(non_embedding=False)
    n_nonemb = model.num_params(non_embedding=True)
    flops_token = flops.flops_per_token(n_nonemb, cfg.model.n_layer, cfg.model.n_head,
                                        cfg.model.d_model // cfg.model.n_head, T,
                                        lm_head_params=cfg.model.vocab_size * cfg.model.d_model)
    peak = flops.gpu_peak_flops(torch.cuda.get_device_name(env.device) if env.is_cuda else None)

    # ---- checkpoint: resume (refuses an incompatible checkpoint before writing anything)
    ckpt = CheckpointManager(
        checkpoint_dir_of(cfg, run_dir), cfg.checkpoint.remote_uri,
        keep=cfg.checkpoint.keep, env=env, async_save=cfg.checkpoint.async_save,
        endpoint_url=cfg.checkpoint.endpoint_url or None,
    )
    restored: dict[str, Any] = {}

    def check(manifest: dict[str, Any], where: str) -> None:
        reason = compatibility_problem(cfg, manifest, where, ds.manifest_sha256)
        if reason:
            raise BadInput(reason)

    def apply(state: dict[str, Any]) -> None:
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise CheckpointInvalid(f"trainer state step {step!r} is not a whole number")
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        if sampler.next_step != step:
            raise CheckpointInvalid(f"sampler is at step {sampler.next_step} but the checkpoint is at step {step}")
        restored.clear()
        restored.update(step=step, tokens=int(state["tokens"]), run_id=state.get("mlflow_run_id"),
                        loss=float(state.get("loss", math.nan)))

    try:
        found = ckpt.resume(model, optimizer, check=check, apply=apply)
    except BaseException:
        ckpt.close()
        ds.close()
        raise
    if found is None and ckpt.model_touched:
        # A load that failed part-way may have overwritten some parameters: start again from the seed.
        model, wrapped, optimizer, scheduler, sampler = fresh()
    step, tokens_seen, run_id = 0, 0, None
    loss_value = math.nan  # loss of the last completed step (kept in checkpoints)
    if found is not None:
        step, tokens_seen, run_id, loss_value = (restored["step"], restored["tokens"], restored["run_id"],
                                                  restored["loss"])
        log.info("resumed from %s at step %d (%d tokens seen)", found, step, tokens_seen)
    resumed_from = str(found) if found else None

    # ---- outputs (only now: a refused launch has changed nothing in the run directory)
    if env.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
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

    status = "failed"
    try:
        status, step, tokens_seen, loss_value, first, start_step, elapsed = _loop(
            cfg, env, run_dir, preempt=preempt, ds=ds, sampler=sampler, model=model, wrapped=wrapped,
            optimizer=optimizer, scheduler=scheduler, ckpt=ckpt, metrics=metrics, jsonl=jsonl, tracker=tracker,
            step=step, tokens_seen=tokens_seen, loss_value=loss_value, global_batch=global_batch, accum=accum,
            dtype=dtype, flops_token=flops_token, peak=peak, dataset_info=dataset_info, data_error=DataError,
        )
        ckpt.wait()
        if status == "completed" and ckpt.failed and ckpt.failed[-1].step == step and (
            not ckpt.saved or ckpt.saved[-1].step < step
        ):
            raise TrainingFailed(f"the final checkpoint (step {step}) was not saved: {ckpt.failed[-1].error}")
        tokens_per_s = (step - start_step) * t.global_batch_tokens / elapsed if step > start_step else 0.0
        run_mfu = flops.mfu(tokens_per_s, flops_token, peak, env.world_size)
        # Collective (FSDP gathers shards): every rank takes part, rank 0 gets the full state.
        full = full_state_dict(model)
        summary = {
            "step": step, "tokens": tokens_seen, "final_loss": loss_value if math.isfinite(loss_value) else None,
            "params_sha256": state_sha256(full) if env.rank == 0 else None,
            "restarts": env.restart_count, "tokens_per_s": tokens_per_s, "mfu": run_mfu, "status": status,
            # Rank 0's peak GPU memory (allocated by tensors), for sizing; None on CPU.
            "peak_memory_gb": torch.cuda.max_memory_allocated(env.device) / 1e9 if env.is_cuda else None,
        }
        if env.rank == 0:
            _finish_outputs(cfg, run_dir, ckpt, full, summary, tracker, ds.manifest_sha256, first=first)
        del full
        return summary
    finally:
        tracker.close(status={"completed": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))
        if jsonl:
            jsonl.close()
        metrics.close()
        ckpt.close()
        ds.close()


def _loop(cfg: Config, env: DistEnv, run_dir: Path, *, preempt: _Preemption, ds: Any, sampler: Any, model: GPT,
          wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, ckpt: CheckpointManager,
          metrics: TrainerMetrics, jsonl: JsonlLog | None, tracker: Any, step: int, tokens_seen: int,
          loss_value: float, global_batch: int, accum: int, dtype: torch.dtype | None, flops_token: int,
          peak: float | None, dataset_info: dict[str, str], data_error: type[Exception]) -> tuple:
    t = cfg.train
    T = cfg.model.context
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
    first: tuple[int, float] | None = None  # (step, loss) of the first step of this launch, for the summary
    if step >= t.steps:
        log.info("the checkpoint is already at train.steps=%d: nothing to train", t.steps)

    def trainer_state() -> dict[str, Any]:
        return {
            "step": step, "tokens": tokens_seen, "loss": loss_value, "sampler": sampler.state_dict(),
            "scheduler": scheduler.state_dict(), "mlflow_run_id": tracker.run_id,
            "world_size": env.world_size, "dataset": dataset_info,
        }

    def report_saves(seen: int) -> int:
        """Publish checkpoints that finished in the background since the last call; returns the new count."""
        for rec in ckpt.saved[seen:]:
            metrics.observe_checkpoint(rec.duration_s or 0.0, rec.finished_unix or time.time())
            tracker.log_checkpoint(rec.step, rec.remote_uri or str(rec.path))
        return len(ckpt.saved)

    # SIGTERM that arrived while starting (loading, resuming): stop before training, nothing new to save.
    flag = torch.tensor([float(preempt.requested)], device=env.device)
    dist.all_reduce(flag)
    if flag.item() > 0 and step < t.steps:
        log.warning("SIGTERM before the first step: stopping at step %d without a new checkpoint", step)
        return "preempted", step, tokens_seen, loss_value, first, start_step, time.perf_counter() - loop_t0

    status = "completed"
    wrapped.train()
    while step < t.steps:
        t_step = time.perf_counter()
        # ---- data (a failure is reported through the step's all-reduce; zeros keep the collectives in step)
        fault: tuple[str, str] | None = None
        try:
            indices = sampler.rank_slice(step, env.rank, env.world_size)
            if step + 1 < t.steps:
                nxt = (step + 1) * global_batch + env.rank * per_rank
                ds.prefetch(sampler.windows_at(np.arange(nxt, nxt + per_rank)).tolist())
            windows = torch.from_numpy(np.stack([ds.window(i) for i in indices]))
        except data_error as exc:
            kind = "failed" if _transient(exc) else "bad"
            fault = (kind, one_line(f"rank {env.rank}, step {step + 1}: data.uri: {exc}"))
            windows = torch.zeros((per_rank, T + 1), dtype=torch.int64)
            indices = []
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
        _test_kill_hook(step, env, run_dir)
        t_fb = time.perf_counter()
        # ---- one all-reduce: mean loss, and whether any rank got SIGTERM, bad data or a storage failure
        flags = torch.stack([
            loss_acc.float(), torch.tensor(float(preempt.requested), device=env.device),
            torch.tensor(float(fault is not None and fault[0] == "bad"), device=env.device),
            torch.tensor(float(fault is not None and fault[0] == "failed"), device=env.device),
        ])
        dist.all_reduce(flags)
        if flags[2].item() > 0 or flags[3].item() > 0:
            every: list[Any] = [None] * env.world_size
            dist.all_gather_object(every, fault)
            bad = [f[1] for f in every if f and f[0] == "bad"]
            if bad:
                raise BadInput(bad[0])
            raise TrainingFailed(next(f[1] for f in every if f))
        step_loss = flags[0].item() / env.world_size
        if not math.isfinite(step_loss):
            raise BadInput(_diverged(cfg, step + 1, f"loss {step_loss}", ckpt))
        # ---- optimizer
        if t.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if not math.isfinite(norm):
                raise BadInput(_diverged(cfg, step + 1, f"gradient norm {norm}", ckpt))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss_value = step_loss
        if first is None:
            first = (step + 1, loss_value)
        stop = flags[1].item() > 0
        step += 1
        tokens_seen += t.global_batch_tokens
        t_opt = time.perf_counter()
        batch_sha = None
        if cfg.metrics.batch_hash:
            gathered: list[list[int] | None] = [None] * env.world_size
            dist.all_gather_object(gathered, indices)
            batch_sha = batch_hash([i for part in gathered for i in part])

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
            preempt.report(step, saved=bool(ckpt.saved) and ckpt.saved[-1].step == step)
            break

    ckpt.wait()
    report_saves(seen_saves)
    if progress is not None:
        progress.close()
    return status, step, tokens_seen, loss_value, first, start_step, time.perf_counter() - loop_t0


def _transient(exc: BaseException) -> bool:
    """A storage outage rather than bad data: the data layer wraps the storage error that outlasted its
    retries (trainer/data/storage.py StorageError.transient) in a shard error; look down the cause chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "transient", False):
            return True
        seen = seen.__cause__
    return False


def _diverged(cfg: Config, step: int, what: str, ckpt: CheckpointManager) -> str:
    last = ckpt.saved[-1].step if ckpt.saved else None
    where = f"the newest checkpoint is step {last}" if last is not None else "no checkpoint was saved by this launch"
    return (f"non-finite {what} at step {step}: training diverged, the step was not applied and nothing was "
            f"saved ({where}); lower train.lr (now {cfg.train.lr}) or set train.grad_clip (now {cfg.train.grad_clip})")


def _finish_outputs(cfg: Config, run_dir: Path, ckpt: CheckpointManager, full: dict[str, torch.Tensor],
                    summary: dict[str, Any], tracker: Any, manifest_sha: str,
                    first: tuple[int, float] | None) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    tracker.log_artifact(run_dir / "loss.png")
    tracker.log_artifact(run_dir / "summary.json")
    tracker.log_artifact(run_dir / "config.json")
    if cfg.tracking.register_name and summary["status"] == "completed":
        model_dir = run_dir / "model"
        model_dir.mkdir(exist_ok=True)
        torch.save(full, model_dir / "model.pt")
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
