"""The training loop: DDP or FSDP2, gradient accumulation, AdamW + warmup/cosine, validation loss and early
stopping, checkpoints, metrics, hang detection, and the run's outputs (summary, registered model, a sample).

Usage (normally through `python -m trainer`, see trainer/__main__.py):
    from gpu_train.spec.trainer_config import build_config
    from trainer.train import train
    summary = train(build_config("tiny", overrides=["train.steps=20"]), run_dir=Path("runs/dev"))
    summary["status"]      # "completed", "stopped_early" (eval.early_stopping_patience) or "preempted"; bad
                           # input raises BadInput, a retryable failure TrainingFailed (trainer/errors.py)

Every rank runs the same loop. Step `s` (0-based) trains on global batch `s` of the GlobalSampler (the block
shuffle over the dataset's shards, `build_sampler`); each rank takes its contiguous slice and splits it into
micro batches, so the global batch in tokens and the sample order never depend on the number of workers.
Before reading a step's windows the loop hands the shards of the next two blocks to the dataset, which fetches
them in the background (`ds.fetch_ahead(sampler.upcoming_shards(...))`). On start the newest checkpoint that
every rank can load is restored (trainer/checkpoint.py).

Decisions every rank must take together go through collectives, so no rank waits for another that has
already given up: the inputs are checked on every rank and the verdict all-gathered before anything is
written; after each step's backward pass one all-reduce carries the loss, "some rank got SIGTERM", "some rank
hit bad data" and "some rank hit a storage failure", before the optimizer step. Then:
- SIGTERM anywhere: every rank finishes the step, saves a checkpoint synchronously and returns "preempted"
  (exit 75: resumable, not completed);
- a non-finite loss (or, with train.grad_clip, a non-finite gradient norm): the step is not applied, nothing
  is saved, BadInput (exit 2), since a restart would replay the same step from the same checkpoint;
- a data error: BadInput for a missing or corrupt shard, TrainingFailed for a storage outage.

Validation loss (eval.every_steps > 0): every N steps and after the last one, every rank evaluates its share
of the fixed held-out windows (trainer/evaluate.py) and one all-reduce gives every rank the same value, so
early stopping (eval.early_stopping_patience evaluations without a new best) is decided identically
everywhere; the evaluation of a step runs before that step's checkpoint, which records it (`EvalState`), so a
resumed run stops exactly where an uninterrupted one would. A run that stopped early ends with status
"stopped_early" (exit 0) after a final checkpoint; resuming it trains nothing unless the patience is raised.

Hang detection: a watchdog thread per rank (trainer/watchdog.py) follows the phases of each step (data,
forward_backward, collective, optimizer) and the checkpoint, eval and finish phases; past its bound it names
the rank and phase, dumps every thread's stack and exits 124, and torchrun restarts the group. The process
group's timeouts are derived from the same settings so that it speaks first.

Test hooks (used by tests/trainer and bench/recovery.py, harmless otherwise), each once per marker file, which
the hook creates first and does nothing if it exists:
- TRAINER_TEST_KILL_AT_STEP=N (TRAINER_TEST_KILL_RANK=R, default 0): rank R SIGKILLs itself in 0-based step
  N after backward, before the optimizer step (marker TRAINER_TEST_KILL_MARKER, default RUN_DIR/.test-kill-N);
- TRAINER_TEST_HANG_AT_STEP=N (TRAINER_TEST_HANG_RANK=R, default 0): rank R sleeps TRAINER_TEST_HANG_S
  seconds (default 3600) in 0-based step N's collective phase instead of joining the all-reduce, which the
  other ranks wait in (marker TRAINER_TEST_HANG_MARKER, default RUN_DIR/.test-hang-N; it holds the time the
  sleep began);
- TRAINER_TEST_SLOW_RANK=R: rank R sleeps TRAINER_TEST_SLOW_S seconds (default 0.2) in every step, between
  the last micro batch's forward and backward passes: a straggler (no marker, every step).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
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

from gpu_train.spec.trainer_config import Config, batch_layout, flatten, to_dict
from trainer import flops
from trainer.checkpoint import CheckpointInvalid, CheckpointManager
from trainer.distributed import DistEnv, init_distributed, seed_everything, shutdown
from trainer.errors import BadInput, TrainingFailed, one_line
from trainer.metrics import JsonlLog, StepClock, TrainerMetrics, plot_loss
from trainer.model import GPT
from trainer.preflight import check_inputs, checkpoint_dir_of, open_checked_dataset
from trainer.watchdog import (
    Watchdog,
    checkpoint_timeout_s,
    collective_timeout_s,
    nccl_env,
    nccl_heartbeat_s,
)

log = logging.getLogger("trainer")

# The end-of-run sample decodes as `python -m trainer.sample` does by default.
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 40
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


def _marked_once(env_name: str, default: Path) -> bool:
    """Create the marker file named by env `env_name` (else `default`); False if it already existed."""
    marker = Path(os.environ.get(env_name) or default)
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")
    return True


def _test_kill_hook(step: int, env: DistEnv, run_dir: Path) -> None:
    at = os.environ.get("TRAINER_TEST_KILL_AT_STEP")
    if at is None or step != int(at) or env.rank != int(os.environ.get("TRAINER_TEST_KILL_RANK", "0")):
        return
    if _marked_once("TRAINER_TEST_KILL_MARKER", run_dir / f".test-kill-{at}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _test_hang_hook(step: int, env: DistEnv, run_dir: Path) -> None:
    at = os.environ.get("TRAINER_TEST_HANG_AT_STEP")
    if at is None or step != int(at) or env.rank != int(os.environ.get("TRAINER_TEST_HANG_RANK", "0")):
        return
    if _marked_once("TRAINER_TEST_HANG_MARKER", run_dir / f".test-hang-{at}"):
        time.sleep(float(os.environ.get("TRAINER_TEST_HANG_S", "3600")))


def _test_slow_hook(env: DistEnv) -> None:
    rank = os.environ.get("TRAINER_TEST_SLOW_RANK")
    if rank is not None and env.rank == int(rank):
        time.sleep(float(os.environ.get("TRAINER_TEST_SLOW_S", "0.2")))


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
    dataset's manifest hash, train.global_batch_tokens, train.seed, data.packing (which windows exist) and
    data.block_shards (else the run would silently continue on other data or another order). A checkpoint from
    before data.block_shards existed keeps the order it was trained with (`build_sampler`). Everything else
    (steps, learning rate, world size, ddp/fsdp, evaluation, watchdog) may change.
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
    # (section, key, what a checkpoint without the key was trained with; None: nothing to compare)
    order_keys = (("train", "global_batch_tokens", None), ("train", "seed", None), ("data", "packing", True),
                  ("data", "block_shards", None))
    for section, key, before in order_keys:
        ck_section = ck_cfg.get(section)
        if not isinstance(ck_section, dict):
            continue
        theirs = ck_section.get(key, before)
        if theirs is not None and theirs != mine[section][key]:
            return (f"checkpoint {where} was trained with {section}.{key}={theirs} but the settings "
                    f"say {section}.{key}={mine[section][key]}: the sample order would change mid-run; set it "
                    "back or start a new run directory")
    data = (manifest.get("trainer") or {}).get("dataset")
    if isinstance(data, dict) and data.get("manifest_sha256") and data["manifest_sha256"] != manifest_sha:
        return (f"checkpoint {where} was trained on dataset {data.get('uri')} (manifest sha256 "
                f"{str(data['manifest_sha256'])[:16]}) but data.uri={cfg.data.uri} has manifest sha256 "
                f"{manifest_sha[:16]}: resume with the same dataset, or start a new run directory")
    return None


def build_sampler(ds: Any, global_batch: int, cfg: Config, *, legacy: bool = False) -> Any:
    """The run's GlobalSampler: the block shuffle over the dataset's shards (trainer/data/sampler.py).

    `legacy`: the whole-dataset shuffle of runs whose checkpoints predate the block shuffle (their sampler
    state has no shard count): resuming such a run keeps its order exactly instead of switching mid-epoch.
    """
    from trainer.data import GlobalSampler

    if legacy:
        return GlobalSampler(ds.num_windows, global_batch=global_batch, seed=cfg.train.seed)
    return GlobalSampler(ds.num_windows, global_batch=global_batch, seed=cfg.train.seed,
                         shard_windows=ds.shard_windows, block_shards=cfg.data.block_shards)


def is_legacy_sampler_state(state: dict[str, Any]) -> bool:
    """A sampler state written with the whole-dataset shuffle (no shards known): before data.block_shards."""
    return not state.get("num_shards")


@dataclass
class EvalState:
    """What the run knows about its validation loss; kept in every checkpoint so early stopping survives
    restarts (an evaluation at a checkpoint's step runs before that checkpoint is saved)."""

    last: float | None = None
    last_step: int | None = None
    best: float | None = None
    best_step: int | None = None
    bad: int = 0  # evaluations in a row without a new best

    def record(self, step: int, val_loss: float) -> None:
        self.last, self.last_step = val_loss, step
        if math.isfinite(val_loss) and (self.best is None or val_loss < self.best):
            self.best, self.best_step, self.bad = val_loss, step, 0
        else:
            self.bad += 1

    def exhausted(self, patience: int) -> bool:
        """Early stopping is due: `patience` evaluations in a row brought no new best."""
        return patience > 0 and self.bad >= patience

    def to_dict(self) -> dict[str, Any]:
        return {"last": self.last, "last_step": self.last_step, "best": self.best, "best_step": self.best_step,
                "bad": self.bad}

    @classmethod
    def from_dict(cls, data: Any) -> EvalState:
        if not isinstance(data, dict):
            return cls()
        return cls(last=data.get("last"), last_step=data.get("last_step"), best=data.get("best"),
                   best_step=data.get("best_step"), bad=int(data.get("bad") or 0))


# ---------------------------------------------------------------------------------------------- train
def train(cfg: Config, run_dir: Path) -> dict[str, Any]:
    wd = cfg.watchdog
    nccl = {**nccl_env(), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(nccl_heartbeat_s(wd))}
    env = init_distributed(timeout_s=collective_timeout_s(wd), nccl_env=nccl)
    try:
        return _train(cfg, Path(run_dir), env)
    finally:
        shutdown()


@dataclass
class _Run:
    """Everything the loop works with (one object instead of two dozen arguments)."""

    cfg: Config
    env: DistEnv
    run_dir: Path
    preempt: _Preemption
    ds: Any
    val: Any
    sampler: Any
    model: GPT
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ckpt: CheckpointManager
    metrics: TrainerMetrics
    jsonl: JsonlLog | None
    tracker: Any
    watchdog: Watchdog
    clock: StepClock
    global_batch: int
    accum: int
    dtype: torch.dtype | None
    flops_token: int
    peak: float | None
    dataset_info: dict[str, str]
    evals: EvalState
    step: int = 0
    tokens_seen: int = 0
    loss_value: float = math.nan  # loss of the last completed step (kept in checkpoints)
    first: tuple[int, float] | None = None  # (step, loss) of the first step of this launch, for the summary
    start_step: int = 0
    elapsed: float = 0.0

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step, "tokens": self.tokens_seen, "loss": self.loss_value,
            "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
            "mlflow_run_id": self.tracker.run_id, "world_size": self.env.world_size,
            "dataset": self.dataset_info, "eval": self.evals.to_dict(),
        }


def _train(cfg: Config, run_dir: Path, env: DistEnv) -> dict[str, Any]:
    from trainer.tracking import TAG_DATASET_MANIFEST, TAG_DATASET_URI, Tracker

    _setup_logging(env)
    # `kill -USR1 <pid>` prints every thread's Python stack: the first thing to look at in a hung collective.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    preempt = _Preemption()
    t = cfg.train
    T = cfg.model.context

    # ---- inputs: checked on every rank, verdict agreed before anything is written
    ds = val = None
    tokenizer = None
    problem = None
    try:
        ds = check_inputs(cfg, run_dir, world_sizes=[env.world_size], local_world_size=env.local_world_size)
        if cfg.eval.every_steps:
            val = open_checked_dataset(cfg, split="val")
        if env.rank == 0 and (cfg.eval.sample_tokens or cfg.tracking.register_name):
            tokenizer = _dataset_tokenizer(cfg)
    except BadInput as exc:
        problem = str(exc)
    problem = _agree(problem, env.world_size)
    if problem:
        for opened in (ds, val):
            if opened is not None:
                opened.close()
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
        return model, wrapped, optimizer, scheduler, build_sampler(ds, global_batch, cfg)

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
        endpoint_url=cfg.checkpoint.endpoint_url or None, timeout_s=checkpoint_timeout_s(cfg.watchdog),
    )
    restored: dict[str, Any] = {}

    def check(manifest: dict[str, Any], where: str) -> None:
        reason = compatibility_problem(cfg, manifest, where, ds.manifest_sha256)
        if reason:
            raise BadInput(reason)

    def apply(state: dict[str, Any]) -> None:
        nonlocal sampler
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise CheckpointInvalid(f"trainer state step {step!r} is not a whole number")
        legacy = is_legacy_sampler_state(state["sampler"])
        sampler = build_sampler(ds, global_batch, cfg, legacy=legacy)
        if legacy:
            log.info("the checkpoint's sampler predates the block shuffle: this run keeps the whole-dataset "
                     "shuffle it started with (exact resume); a new run directory uses data.block_shards")
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        if sampler.next_step != step:
            raise CheckpointInvalid(f"sampler is at step {sampler.next_step} but the checkpoint is at step {step}")
        restored.clear()
        restored.update(step=step, tokens=int(state["tokens"]), run_id=state.get("mlflow_run_id"),
                        loss=float(state.get("loss", math.nan)), evals=EvalState.from_dict(state.get("eval")))

    try:
        found = ckpt.resume(model, optimizer, check=check, apply=apply)
    except BaseException:
        ckpt.close()
        for opened in (ds, val):
            if opened is not None:
                opened.close()
        raise
    if found is None and ckpt.model_touched:
        # A load that failed part-way may have overwritten some parameters: start again from the seed.
        model, wrapped, optimizer, scheduler, sampler = fresh()
    step, tokens_seen, run_id, loss_value, evals = 0, 0, None, math.nan, EvalState()
    if found is not None:
        step, tokens_seen, run_id, loss_value, evals = (restored["step"], restored["tokens"], restored["run_id"],
                                                        restored["loss"], restored["evals"])
        log.info("resumed from %s at step %d (%d tokens seen)", found, step, tokens_seen)
    resumed_from = str(found) if found else None

    # ---- outputs (only now: a refused launch has changed nothing in the run directory)
    if env.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    metrics = TrainerMetrics(port=cfg.metrics.port + env.local_rank if cfg.metrics.port else 0, rank=env.rank)
    metrics.restarts.set(env.restart_count)
    if evals.last is not None:
        metrics.observe_eval(evals.last)
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

    watchdog = Watchdog(cfg.watchdog, rank=env.rank, local_rank=env.local_rank)
    clock = StepClock(env.device)
    # When gradients reach the token embedding's output, this rank's own backward work is done
    # (trainer/metrics.py). A gradient hook on that tensor, added by a forward hook, leaves the autograd graph
    # as it is; hooks added inside a compiled region break torch.compile's graph, so a compiled model goes
    # without.
    def on_embedding(_module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda _grad: clock.grads_ready())

    hook = None if t.compile else model.tok_emb.register_forward_hook(on_embedding)
    run = _Run(
        cfg=cfg, env=env, run_dir=run_dir, preempt=preempt, ds=ds, val=val, sampler=sampler, model=model,
        wrapped=wrapped, optimizer=optimizer, scheduler=scheduler, ckpt=ckpt, metrics=metrics, jsonl=jsonl,
        tracker=tracker, watchdog=watchdog, clock=clock, global_batch=global_batch, accum=accum, dtype=dtype,
        flops_token=flops_token, peak=peak, dataset_info=dataset_info, evals=evals, step=step,
        tokens_seen=tokens_seen, loss_value=loss_value,
    )
    status = "failed"
    try:
        watchdog.start()
        status = _loop(run)
        # Finishing (the last background save, the full state dict, the outputs) has the checkpoint allowance.
        with watchdog.allowance("finish", cfg.watchdog.checkpoint_s, "watchdog.checkpoint_s, the end of the run"):
            ckpt.wait()
            step = run.step
            if status != "preempted" and ckpt.failed and ckpt.failed[-1].step == step and (
                not ckpt.saved or ckpt.saved[-1].step < step
            ):
                raise TrainingFailed(f"the final checkpoint (step {step}) was not saved: {ckpt.failed[-1].error}")
            tokens_per_s = (step - run.start_step) * t.global_batch_tokens / run.elapsed if step > run.start_step \
                else 0.0
            run_mfu = flops.mfu(tokens_per_s, flops_token, peak, env.world_size)
            # Collective (FSDP gathers shards): every rank takes part, rank 0 gets the full state.
            full = full_state_dict(model)
            summary = {
                "step": step, "tokens": run.tokens_seen,
                "final_loss": run.loss_value if math.isfinite(run.loss_value) else None,
                "val_loss": run.evals.last, "best_val_loss": run.evals.best, "best_val_step": run.evals.best_step,
                "params_sha256": state_sha256(full) if env.rank == 0 else None,
                "restarts": env.restart_count, "tokens_per_s": tokens_per_s, "mfu": run_mfu, "status": status,
                # Rank 0's peak GPU memory (allocated by tensors), for sizing; None on CPU.
                "peak_memory_gb": torch.cuda.max_memory_allocated(env.device) / 1e9 if env.is_cuda else None,
            }
            if env.rank == 0:
                _finish_outputs(run, full, summary, tokenizer)
            del full
        return summary
    finally:
        watchdog.stop()
        if hook is not None:
            hook.remove()
        tracker.close(status={"completed": "FINISHED", "stopped_early": "FINISHED",
                              "preempted": "KILLED"}.get(status, "FAILED"))
        if jsonl:
            jsonl.close()
        metrics.close()
        ckpt.close()
        ds.close()
        if val is not None:
            val.close()


def _dataset_tokenizer(cfg: Config) -> Any:
    """The dataset's tokenizer (sha256-checked), for the registered model and the end-of-run sample."""
    from trainer.data.errors import DataError
    from trainer.export import dataset_tokenizer

    endpoint = cfg.data.endpoint_url or os.environ.get("TRAINER_S3_ENDPOINT_URL") or None
    try:
        return dataset_tokenizer(cfg.data.uri, endpoint)
    except DataError as exc:
        raise BadInput(f"data.uri: the dataset's tokenizer: {exc}") from exc


def _evaluate(run: _Run) -> float:
    """Validation loss at run.step on every rank (the same value everywhere), recorded and published."""
    from trainer.evaluate import evaluate, reduce_eval

    cfg, env = run.cfg, run.env
    autocast = _autocast(run)
    t0 = time.perf_counter()
    with run.watchdog.allowance("eval", cfg.watchdog.eval_s):
        # The raw model: under DDP every rank holds all weights, so evaluating needs no collective per
        # forward (DDP would broadcast buffers) and a compiled wrapper is not recompiled for eval mode; under
        # FSDP2 `model` is the sharded module itself and gathers its parameters in each forward.
        part = evaluate(run.model, run.val, batches=cfg.eval.batches,
                        micro_batch_size=cfg.eval.micro_batch_size or cfg.train.micro_batch_size,
                        rank=env.rank, world=env.world_size, device=env.device, autocast=lambda: autocast)
        val_loss = reduce_eval(part, device=env.device)
    seconds = time.perf_counter() - t0
    run.evals.record(run.step, val_loss)
    run.metrics.observe_eval(val_loss)
    if run.jsonl:
        run.jsonl.write({
            "event": "eval", "step": run.step, "val_loss": val_loss, "best_val_loss": run.evals.best,
            "best_val_step": run.evals.best_step, "evals_without_improvement": run.evals.bad, "eval_s": seconds,
            "windows": cfg.eval.batches * (cfg.eval.micro_batch_size or cfg.train.micro_batch_size),
            "time": time.time(),
        })
    run.tracker.log_metrics({"val_loss": val_loss, "best_val_loss": run.evals.best}, step=run.step)
    if env.rank == 0:
        log.info("step %d validation loss %.4f (best %.4f at step %s, %.1fs)", run.step, val_loss,
                 run.evals.best if run.evals.best is not None else math.nan, run.evals.best_step, seconds)
    return val_loss


def _autocast(run: _Run) -> Any:
    if run.dtype is not None and run.cfg.train.parallel == "ddp":
        return torch.autocast(run.env.device.type, dtype=run.dtype)
    return contextlib.nullcontext()


def _loop(run: _Run) -> str:
    """Train from run.step to train.steps (or until SIGTERM or early stopping); returns the status."""
    from trainer.data import DataError

    cfg, env, t = run.cfg, run.env, run.cfg.train
    T = cfg.model.context
    ds, sampler, model, wd = run.ds, run.sampler, run.model, run.watchdog
    patience = cfg.eval.early_stopping_patience
    progress = None
    if env.rank == 0 and sys.stdout.isatty():
        from tqdm import tqdm

        progress = tqdm(total=t.steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True)
    autocast = _autocast(run)
    per_rank = run.global_batch // env.world_size
    seen_saves = len(run.ckpt.saved)
    run.start_step, loop_t0 = run.step, time.perf_counter()
    blocks = sampler.num_shards > 0  # False only for a run resumed with the old whole-dataset shuffle
    horizon = 2 * max(1, sampler.block_shards)

    def report_saves(seen: int) -> int:
        """Publish checkpoints that finished in the background since the last call; returns the new count."""
        for rec in run.ckpt.saved[seen:]:
            run.metrics.observe_checkpoint(rec.duration_s or 0.0, rec.finished_unix or time.time())
            run.tracker.log_checkpoint(rec.step, rec.remote_uri or str(rec.path))
        return len(run.ckpt.saved)

    def done(status: str) -> str:
        run.elapsed = time.perf_counter() - loop_t0
        return status

    if run.evals.exhausted(patience):
        log.info("the run stopped early at step %d (eval.early_stopping_patience=%d: no new best validation loss "
                 "in %d evaluations, best %.4f at step %s): nothing to train", run.step, patience, run.evals.bad,
                 run.evals.best, run.evals.best_step)
        return done("stopped_early")
    if run.step >= t.steps:
        log.info("the checkpoint is already at train.steps=%d: nothing to train", t.steps)
    # SIGTERM that arrived while starting (loading, resuming): stop before training, nothing new to save.
    flag = torch.tensor([float(run.preempt.requested)], device=env.device)
    dist.all_reduce(flag)
    if flag.item() > 0 and run.step < t.steps:
        log.warning("SIGTERM before the first step: stopping at step %d without a new checkpoint", run.step)
        return done("preempted")

    status = "completed"
    run.wrapped.train()
    while run.step < t.steps:
        step = run.step
        wd.begin_step(step + 1)
        t_step = time.perf_counter()
        # ---- data (a failure is reported through the step's all-reduce; zeros keep the collectives in step)
        fault: tuple[str, str] | None = None
        try:
            indices = sampler.rank_slice(step, env.rank, env.world_size)
            if blocks:
                # The shards this step and the next ones read, in the order they are needed; fetched and pinned
                # in the background (trainer/data/shards.py).
                ds.fetch_ahead(sampler.upcoming_shards(step, horizon, end_step=t.steps))
            elif step + 1 < t.steps:
                nxt = (step + 1) * run.global_batch + env.rank * per_rank
                ds.prefetch(sampler.windows_at(np.arange(nxt, nxt + per_rank)).tolist())
            windows = torch.from_numpy(ds.batch(indices))
        except DataError as exc:
            kind = "failed" if _transient(exc) else "bad"
            fault = (kind, one_line(f"rank {env.rank}, step {step + 1}: data.uri: {exc}"))
            windows = torch.zeros((per_rank, T + 1), dtype=torch.int64)
            indices = []
        windows = windows.to(env.device, non_blocking=True)
        t_data = time.perf_counter()
        # ---- forward / backward over micro batches
        wd.phase("forward_backward")
        run.clock.start()
        loss_acc = torch.zeros((), device=env.device)
        for micro in range(run.accum):
            chunk = windows[micro * t.micro_batch_size:(micro + 1) * t.micro_batch_size]
            x, y = chunk[:, :-1], chunk[:, 1:]
            last = micro == run.accum - 1
            if t.parallel == "fsdp":
                model.set_requires_gradient_sync(last)
                sync_ctx = contextlib.nullcontext()
            else:
                ddp = run.wrapped._orig_mod if hasattr(run.wrapped, "_orig_mod") else run.wrapped
                sync_ctx = contextlib.nullcontext() if last else ddp.no_sync()
            with sync_ctx, autocast:
                _, loss = run.wrapped(x, targets=y)
                if last:
                    _test_slow_hook(env)
                loss = loss / run.accum
                loss.backward()
            loss_acc += loss.detach()
        _test_kill_hook(step, env, run.run_dir)
        t_fb = time.perf_counter()
        # ---- one all-reduce: mean loss, and whether any rank got SIGTERM, bad data or a storage failure
        wd.phase("collective")
        flags = torch.stack([
            loss_acc.float(), torch.tensor(float(run.preempt.requested), device=env.device),
            torch.tensor(float(fault is not None and fault[0] == "bad"), device=env.device),
            torch.tensor(float(fault is not None and fault[0] == "failed"), device=env.device),
        ])
        _test_hang_hook(step, env, run.run_dir)
        dist.all_reduce(flags)
        run.clock.synced()
        values = flags.tolist()  # one copy to the host; on CUDA it waits for the step's GPU work
        t_sync = time.perf_counter()
        if values[2] > 0 or values[3] > 0:
            every: list[Any] = [None] * env.world_size
            dist.all_gather_object(every, fault)
            bad = [f[1] for f in every if f and f[0] == "bad"]
            if bad:
                raise BadInput(bad[0])
            raise TrainingFailed(next(f[1] for f in every if f))
        step_loss = values[0] / env.world_size
        if not math.isfinite(step_loss):
            raise BadInput(_diverged(cfg, step + 1, f"loss {step_loss}", run.ckpt))
        # ---- optimizer
        wd.phase("optimizer")
        if t.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if not math.isfinite(norm):
                raise BadInput(_diverged(cfg, step + 1, f"gradient norm {norm}", run.ckpt))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        run.loss_value = step_loss
        if run.first is None:
            run.first = (step + 1, step_loss)
        stop = values[1] > 0
        step = run.step = step + 1
        run.tokens_seen += t.global_batch_tokens
        t_opt = time.perf_counter()
        wd.end_step(t_opt - t_step)
        fb_compute, collective_wait = run.clock.split()
        batch_sha = None
        if cfg.metrics.batch_hash:
            gathered: list[list[int] | None] = [None] * env.world_size
            dist.all_gather_object(gathered, indices)
            batch_sha = batch_hash([i for part in gathered for i in part])

        # ---- validation loss (before the checkpoint of the same step, which then records it)
        t_eval = time.perf_counter()
        if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == t.steps):
            _evaluate(run)
        early = run.evals.exhausted(patience) and step < t.steps
        eval_s = time.perf_counter() - t_eval

        # ---- checkpoint
        ckpt_block = 0.0
        final = stop or early or step == t.steps
        if final or (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0):
            with wd.allowance("checkpoint", cfg.watchdog.checkpoint_s):
                ckpt_block = run.ckpt.save(step, model, run.optimizer, run.trainer_state(), to_dict(cfg),
                                           block=final)
        t_end = time.perf_counter()

        # ---- metrics
        step_s = t_end - t_step - eval_s
        tps = t.global_batch_tokens / step_s
        step_mfu = flops.mfu(tps, run.flops_token, run.peak, env.world_size)
        now = time.time()
        data_wait = t_data - t_step
        compute = fb_compute + (t_opt - t_sync)
        run.metrics.observe_step(
            step=step, loss=run.loss_value, tokens=t.global_batch_tokens, step_s=step_s, data_wait_s=data_wait,
            fwd_bwd_s=t_fb - t_data, optim_s=t_opt - t_sync, ckpt_block_s=ckpt_block, tokens_per_s=tps,
            mfu=step_mfu, now=now,
        )
        run.metrics.observe_rank(step_s=step_s, compute_s=compute, data_wait_s=data_wait,
                                 collective_wait_s=collective_wait)
        seen_saves = report_saves(seen_saves)
        lr = run.scheduler.get_last_lr()[0]
        if run.jsonl:
            record = {
                "event": "step", "step": step, "loss": run.loss_value, "lr": lr,
                "tokens": run.tokens_seen, "step_s": step_s, "data_wait_s": data_wait,
                "forward_backward_s": t_fb - t_data, "optimizer_s": t_opt - t_sync,
                "compute_s": compute, "collective_wait_s": collective_wait,
                "checkpoint_block_s": ckpt_block, "tokens_per_s": tps, "mfu": step_mfu, "time": now,
                "checkpoint_age_s": now - run.ckpt.last_success_unix if run.ckpt.last_success_unix else None,
            }
            if batch_sha:
                record["batch_sha256"] = batch_sha
            run.jsonl.write(record)
        if step == t.steps or step % cfg.tracking.log_every == 0:
            run.tracker.log_metrics(
                {"loss": run.loss_value, "lr": lr, "tokens_per_s": tps, "mfu": step_mfu,
                 "step_s": step_s, "data_wait_s": data_wait, "forward_backward_s": t_fb - t_data,
                 "optimizer_s": t_opt - t_sync, "checkpoint_block_s": ckpt_block, "tokens": run.tokens_seen},
                step=step,
            )
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{run.loss_value:.3f}", tok_s=f"{tps:,.0f}")
        elif env.rank == 0 and (step % cfg.metrics.log_every == 0 or step == t.steps):
            log.info("step %d/%d loss %.4f lr %.2e %.0f tok/s mfu %s", step, t.steps, run.loss_value, lr, tps,
                     flops.format_mfu(step_mfu))
        if stop:
            status = "preempted"
            run.preempt.report(step, saved=bool(run.ckpt.saved) and run.ckpt.saved[-1].step == step)
            break
        if early:
            status = "stopped_early"
            if env.rank == 0:
                log.warning("early stopping at step %d: no new best validation loss in %d evaluations "
                            "(eval.early_stopping_patience=%d); best %.4f at step %s", step, run.evals.bad,
                            patience, run.evals.best, run.evals.best_step)
            break

    wd.disarm()
    run.ckpt.wait()
    report_saves(seen_saves)
    if progress is not None:
        progress.close()
    return done(status)


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


def end_sample(cfg: Config, state: dict[str, torch.Tensor], tokenizer: Any, device: torch.device) -> str:
    """`eval.sample_tokens` tokens sampled from a full state dict (seeded by train.seed), decoded, with the
    prompt. On CUDA the copy is bf16 on the training device (the host may be far slower); on CPU fp32."""
    from trainer.sample import generate

    tok = tokenizer.build()
    with torch.device("meta"):
        model = GPT(cfg.model)
    if device.type == "cuda":
        model = model.to(dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    model.init_buffers()
    weights = dict(state)
    weights.setdefault("lm_head.weight", weights["tok_emb.weight"])
    model.load_state_dict(weights, strict=True)
    model.lm_head.weight = model.tok_emb.weight
    prompt = tok.encode(cfg.eval.sample_prompt).tolist() if cfg.eval.sample_prompt else [tok.eot_id]
    ids = generate(model, prompt, max_tokens=cfg.eval.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                   top_k=SAMPLE_TOP_K, vocab_limit=tok.vocab_size, stop_id=tok.eot_id,
                   generator=torch.Generator().manual_seed(cfg.train.seed))
    del model
    return cfg.eval.sample_prompt + tok.decode(ids)


def _finish_outputs(run: _Run, full: dict[str, torch.Tensor], summary: dict[str, Any], tokenizer: Any) -> None:
    from trainer.export import write_model_dir

    cfg, run_dir, ckpt, tracker = run.cfg, run.run_dir, run.ckpt, run.tracker
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    tracker.log_artifact(run_dir / "loss.png")
    tracker.log_artifact(run_dir / "summary.json")
    tracker.log_artifact(run_dir / "config.json")
    registered = None
    if cfg.tracking.register_name and summary["status"] in ("completed", "stopped_early"):
        # Weights and config in a layout that loads without this repository (trainer/export.py): Hugging Face's
        # GPT-2 layout where the architecture is GPT-2's, else safetensors with this trainer's names.
        model_dir = run_dir / "model"
        if model_dir.exists():
            shutil.rmtree(model_dir)
        registered = write_model_dir(full, cfg.model, tokenizer, model_dir, origin={
            "run_dir": str(run_dir), "step": summary["step"], "dataset_uri": cfg.data.uri,
            "params_sha256": summary["params_sha256"], "mlflow_run_id": tracker.run_id,
        })
        tracker.register_model(model_dir, cfg.tracking.register_name, {
            "dataset.uri": cfg.data.uri, "dataset.manifest_sha256": run.dataset_info["manifest_sha256"],
            "params_sha256": summary["params_sha256"], "step": summary["step"], "model.format": registered,
        })
    sample = None
    if cfg.eval.sample_tokens and summary["status"] in ("completed", "stopped_early"):
        try:
            sample = end_sample(cfg, full, tokenizer, run.env.device)
        except Exception as exc:  # an output, never a reason to fail a finished run
            log.warning("no end-of-run sample (%s); try python -m trainer.sample --run-dir %s", one_line(str(exc)),
                        run_dir)
    last = ckpt.saved[-1] if ckpt.saved else None
    first = run.first
    ev = run.evals
    lines = [
        "",
        "=" * 72,
        f"training {summary['status'].replace('_', ' ')}: {summary['step']}/{cfg.train.steps} steps, "
        f"{summary['tokens']:,} tokens, restarts {summary['restarts']}",
        "final loss      " + ("n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}")
        + (f"   (step {first[0]}: {first[1]:.4f})" if first else ""),
    ]
    if ev.last is not None:
        lines.append(f"validation loss {ev.last:.4f} at step {ev.last_step}   (best {ev.best:.4f} at step "
                     f"{ev.best_step})" if ev.best is not None else f"validation loss {ev.last:.4f}")
    lines += [
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
    if registered:
        lines.append(f"model           {run_dir / 'model'} ({registered}, registered as {cfg.tracking.register_name})")
    hint = tracker.ui_hint()
    if hint:
        lines.append(f"mlflow          {hint}")
    if sample is not None:
        prompt = repr(cfg.eval.sample_prompt) if cfg.eval.sample_prompt else "the start of a document"
        lines += ["-" * 72, f"sample ({cfg.eval.sample_tokens} tokens from {prompt}, temperature "
                  f"{SAMPLE_TEMPERATURE}, top-k {SAMPLE_TOP_K}, seed train.seed):", sample.rstrip("\n")]
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)
