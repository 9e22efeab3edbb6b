"""Training metrics: one processor that fans each record out to every sink (the console or a tqdm bar, a
Prometheus endpoint per worker, metrics.jsonl, MLflow), the step clock that splits compute from collective
wait, and the loss-curve plot.

Usage:
    prom = TrainerMetrics(port=9100 + local_rank, rank=global_rank)  # port 0: no HTTP endpoint, gauges still kept
    metrics = MetricsProcessor(prometheus=prom, jsonl=JsonlLog(run_dir / "metrics.jsonl") if rank == 0 else None,
                               tracker=tracker, total_steps=1000, tokens_per_step=B * T, console=rank == 0, ...)
    metrics.log(step, {"loss": ..., "lr": ..., "tokens": ..., "step_s": ..., "data_wait_s": ...,
                       "forward_backward_s": ..., "optimizer_s": ..., "compute_s": ..., "collective_wait_s": ...,
                       "checkpoint_block_s": ..., "checkpoint_age_s": ...})       # once per step, every rank
    metrics.log(step, {"event": "eval", "val_loss": ..., "best_val_loss": ..., ...})  # once per evaluation
    metrics.log_checkpoint(step, uri, duration_s, finished_unix)
    metrics.close()
    clock = StepClock(device); clock.start(); ...; clock.grads_ready(); ...; clock.synced(); clock.split()
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")

What goes where: every rank's Prometheus endpoint gets every step (the job-global loss and throughput, and its
own rank's straggler gauges); rank 0 alone writes metrics.jsonl (every step and evaluation), sends MLflow every
`tracking_every` steps and the last one (the tracker ignores calls on other ranks), and prints a line every
`log_every` steps with the time left at the launch's pace (ETA) when stdout is not a terminal, else a tqdm bar.
The processor adds `tokens_per_s`, `mfu` and `time` to a step record.

The metric names are fixed (dashboards and alerts use them). Each rank is a separate endpoint and Prometheus
adds job/pod/instance; only the per-rank straggler gauges (`trainer_rank_*`) carry a label of their own,
`rank` (the global rank), so that a rule can compare ranks of one job across pods and restarts.

Over 400 lines because the processor, its sinks and the step clock share one record format and one set of metric
names; split, each piece would re-declare them.

Straggler signals (`StepClock`): per step and rank, `compute` is this rank's own forward/backward and optimizer
work and `collective wait` the time it then spent blocked until the slowest rank caught up. The step's
synchronising collectives are DDP's gradient all-reduce, which completes at the end of the last micro batch's
backward pass, and the step's all-reduce of loss and flags right after it. The clock takes three readings: the
start of forward (after the batch is on the device), the moment gradients reach the token embedding in the
last backward pass (a gradient hook on the output of `tok_emb`: every block and the output head are done,
only the embedding's own small scatter-add remains), and the end of the step's all-reduce. compute = first to second
(plus the optimizer phase), collective wait = second to third.
- CPU (gloo): host clocks (`time.perf_counter`); backward runs on the calling thread and gloo's waits block it.
- CUDA: the host runs ahead of the GPU, so the readings are CUDA events on the current stream, read after the
  all-reduce's result has been copied to the host (which waits for them anyway); the hook runs on autograd's
  device thread with the stream of the forward pass, so its event marks when this rank's gradients were
  computed, and DDP makes that stream wait for the gradient all-reduce before the next event. The optimizer
  part is host time (its kernels are asynchronous; the gradient-norm clip reads a value back, which syncs).
- FSDP2: the parameter all-gathers and gradient reduce-scatters inside forward and backward also wait for the
  slowest rank; that waiting cannot be told apart from compute here and lands in compute. torch.compile: the
  hook is not installed (hooks added inside a compiled region break its graph), so compute includes the wait.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from trainer import flops

log = logging.getLogger("trainer.metrics")
console_log = logging.getLogger("trainer")  # the run's own lines, under the same name as the loop's

# Step phases of a tiny CPU model take milliseconds, a 7B step on GPUs seconds to a minute.
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class TrainerMetrics:
    """This worker's Prometheus metrics, served on `port` (0: kept, not served); `rank` labels the per-rank
    gauges; `restarts` and `val_loss` are the starting values of trainer_restarts_total and trainer_val_loss.
    `log_every`: a loop of its own that calls record_step gets a loss line on rank 0 every this many steps (0:
    none); the bundled trainer's MetricsProcessor prints its own."""

    def __init__(self, port: int = 0, rank: int = 0, *, restarts: int = 0, val_loss: float | None = None,
                 log_every: int = 10) -> None:
        if log_every < 0:
            raise ValueError(f"log_every must be >= 0 (got {log_every})")
        self.log_every = log_every  # record_step's loss line on rank 0 every this many steps (0: none)
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("trainer_step", "Last completed optimizer step", registry=r)
        self.loss = Gauge("trainer_loss", "Training loss of the last step (mean over the global batch)", registry=r)
        self.tokens_per_second = Gauge(
            "trainer_tokens_per_second", "Global training throughput in tokens per second", registry=r
        )
        self.mfu = Gauge("trainer_mfu", "Model FLOPs utilisation (0..1); NaN where the GPU peak is unknown",
                         registry=r)
        # prometheus_client appends _total to counters itself.
        self.tokens = Counter("trainer_tokens", "Tokens trained on since this process started (global)",
                              registry=r)
        self.step_seconds = Histogram("trainer_step_seconds", "Wall time of one optimizer step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.data_wait = Histogram("trainer_data_wait_seconds", "Time per step spent waiting for input batches",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.fwd_bwd = Histogram("trainer_forward_backward_seconds", "Forward + backward time per step",
                                 buckets=_STEP_BUCKETS, registry=r)
        self.optimizer = Histogram("trainer_optimizer_seconds", "Gradient clipping + optimizer step time",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.ckpt_blocking = Histogram(
            "trainer_checkpoint_blocking_seconds", "Time training was blocked by a checkpoint save",
            buckets=_STEP_BUCKETS, registry=r,
        )
        self.ckpt_duration = Gauge("trainer_checkpoint_duration_seconds",
                                   "Duration of the last complete checkpoint save (incl. background write)",
                                   registry=r)
        self.ckpt_last_success = Gauge("trainer_checkpoint_last_success_timestamp_seconds",
                                       "Unix time of the last successful checkpoint", registry=r)
        self.restarts = Gauge("trainer_restarts_total", "Restarts of the worker group so far (torchrun)",
                              registry=r)
        self.last_step_ts = Gauge("trainer_last_step_timestamp_seconds", "Unix time of the last completed step",
                                  registry=r)
        self.val_loss = Gauge("trainer_val_loss", "Validation loss of the last evaluation (mean over the fixed "
                              "held-out windows); NaN before the first", registry=r)
        # Per-rank straggler signals, labelled with the global rank (see the module docstring).
        self.rank = str(rank)
        labels = ["rank"]
        self.rank_step = Gauge("trainer_rank_step_seconds", "Wall time of the last step on this rank", labels,
                               registry=r).labels(rank=self.rank)
        self.rank_compute = Gauge(
            "trainer_rank_compute_seconds", "This rank's own forward/backward/optimizer work in the last step, "
            "without the time blocked waiting for other ranks", labels, registry=r).labels(rank=self.rank)
        self.rank_data_wait = Gauge("trainer_rank_data_wait_seconds", "Time this rank waited for its input batch "
                                    "in the last step", labels, registry=r).labels(rank=self.rank)
        self.rank_collective_wait = Gauge(
            "trainer_rank_collective_wait_seconds", "Time this rank was blocked in the last step's synchronising "
            "collectives waiting for the slowest rank", labels, registry=r).labels(rank=self.rank)
        # No value before the first step: a 0 would read as a loss of 0 (status, dashboards).
        for unknown in (self.mfu, self.loss, self.tokens_per_second):
            unknown.set(math.nan)
        self.val_loss.set(math.nan if val_loss is None else val_loss)
        self.restarts.set(restarts)
        self.server = None
        if port:
            try:
                self.server, _thread = start_http_server(port, registry=r)
            except OSError as exc:  # a busy port costs the scrape target, never the training run
                log.warning("metrics.port: cannot serve Prometheus metrics on port %d: %s", port, exc)

    def observe_step(
        self, *, step: int, loss: float, tokens: int, step_s: float, data_wait_s: float, fwd_bwd_s: float,
        optim_s: float, ckpt_block_s: float, tokens_per_s: float, mfu: float | None, now: float,
    ) -> None:
        self.step.set(step)
        self.loss.set(loss)
        self.tokens.inc(tokens)
        self.step_seconds.observe(step_s)
        self.data_wait.observe(data_wait_s)
        self.fwd_bwd.observe(fwd_bwd_s)
        self.optimizer.observe(optim_s)
        self.ckpt_blocking.observe(ckpt_block_s)
        self.tokens_per_second.set(tokens_per_s)
        self.mfu.set(math.nan if mfu is None else mfu)
        self.last_step_ts.set(now)

    def record_step(self, *, step: int, loss: float, tokens: int, step_s: float, now: float | None = None) -> None:
        """What a loop of a team's own sets after each step (docs/your-code.md): the step, its loss, the tokens it
        trained on (global), its wall time and so the throughput; the dashboards' step, loss and tokens/s panels and
        the stalled-job alert read these. The breakdowns of the bundled trainer's steps stay unset."""
        self.step.set(step)
        self.loss.set(loss)
        self.tokens.inc(tokens)
        self.step_seconds.observe(step_s)
        self.tokens_per_second.set(tokens / step_s if step_s > 0 else math.nan)
        self.last_step_ts.set(time.time() if now is None else now)
        if self.log_every and self.rank == "0" and step % self.log_every == 0:
            console_log.info("step %d: loss %.4f, %.3f s, %.0f tokens/s", step, loss, step_s,
                             tokens / step_s if step_s > 0 else math.nan)

    def observe_rank(self, *, step_s: float, compute_s: float, data_wait_s: float, collective_wait_s: float) -> None:
        self.rank_step.set(step_s)
        self.rank_compute.set(compute_s)
        self.rank_data_wait.set(data_wait_s)
        self.rank_collective_wait.set(collective_wait_s)

    def observe_eval(self, val_loss: float) -> None:
        self.val_loss.set(val_loss)

    def observe_checkpoint(self, duration_s: float, finished_unix: float) -> None:
        self.ckpt_duration.set(duration_s)
        self.ckpt_last_success.set(finished_unix)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class StepClock:
    """Splits a step into this rank's compute and its wait for the slowest rank (module docstring: how)."""

    def __init__(self, device: Any) -> None:
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._events: list[Any] = []
        self._t: list[float | None] = [None, None, None]

    def _mark(self, i: int) -> None:
        self._t[i] = time.perf_counter()
        if self._cuda:
            self._events[i].record()

    def start(self) -> None:
        """Forward is about to start (the batch is on the device). New lists (and events) each step, so that a
        copy taken after `synced()` (copy.copy) still splits its own step once the next one has started: the
        trainer reads a step's split one step later, when its events have completed."""
        self._t = [None, None, None]
        if self._cuda:
            import torch

            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self._mark(0)

    def grads_ready(self) -> None:
        """Gradients reached the token embedding's output (called from a gradient hook; the last call wins)."""
        self._mark(1)

    def synced(self) -> None:
        """The step's synchronising all-reduce returned."""
        self._mark(2)

    def split(self) -> tuple[float, float]:
        """(forward/backward compute, collective wait) in seconds; call once the all-reduce's result was read (on
        CUDA its events must have completed)."""
        t0, t1, t2 = self._t
        if t0 is None or t2 is None:
            return 0.0, 0.0
        if t1 is None:  # no hook (torch.compile): everything counts as compute
            return t2 - t0, 0.0
        if self._cuda:
            e0, e1, e2 = self._events
            return e0.elapsed_time(e1) / 1e3, e1.elapsed_time(e2) / 1e3
        return t1 - t0, t2 - t1


# What MLflow gets of a step record (docs/tracking.md); None values (mfu on CPU) are left out by the tracker.
MLFLOW_STEP_KEYS = ("loss", "lr", "tokens_per_s", "mfu", "step_s", "data_wait_s", "forward_backward_s",
                    "optimizer_s", "checkpoint_block_s", "tokens")
MLFLOW_EVAL_KEYS = ("val_loss", "best_val_loss")


class MetricsProcessor:
    """Fans each step or evaluation record out to every sink (module docstring); one per worker.

    prometheus: this worker's TrainerMetrics. jsonl: the metrics.jsonl writer, None except on rank 0.
    tracker: a trainer.tracking.Tracker (its calls do nothing on ranks other than 0), or None.
    total_steps: train.steps, for the console and the ETA. tokens_per_step: the global batch in tokens.
    flops_per_token, peak_flops, world_size: for MFU (None where the GPU peak is unknown).
    log_every: steps between console lines. tracking_every: steps between MLflow points (the last step always).
    console: print (rank 0). progress: a tqdm bar instead of lines; default: when stdout is a terminal.
    """

    def __init__(self, *, prometheus: TrainerMetrics, jsonl: JsonlLog | None, tracker: Any | None,
                 total_steps: int, tokens_per_step: int, flops_per_token: float = 0.0,
                 peak_flops: float | None = None, world_size: int = 1, log_every: int = 10,
                 tracking_every: int = 10, console: bool = True, progress: bool | None = None,
                 start_step: int = 0) -> None:
        self.flops_per_token, self.peak_flops, self.world_size = flops_per_token, peak_flops, world_size
        self.prometheus, self.jsonl, self.tracker = prometheus, jsonl, tracker
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.log_every, self.tracking_every, self.console = log_every, tracking_every, console
        self._bar = None
        if console and (progress if progress is not None else sys.stdout.isatty()):
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        self._since = (start_step, time.monotonic())  # the ETA runs at this launch's pace, evaluations included

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation at this throughput; None where the GPU peak is unknown (CPU)."""
        return flops.mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.world_size)

    def tracked(self, step: int) -> bool:
        """Whether MLflow gets step `step`'s record: every tracking_every steps and the last."""
        return self.tracker is not None and (step == self.total_steps or step % self.tracking_every == 0)

    def log(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        """Send one record to every sink; returns it as written to metrics.jsonl. `record["event"]` is "step"
        (the default), "eval", or anything else (such as "start"), which only metrics.jsonl gets."""
        event = record.get("event", "step")
        if event == "eval":
            return self._log_eval(step, record)
        if event != "step":
            record = {**record, "step": step, "time": time.time()}
            if self.jsonl is not None:
                self.jsonl.write(record)
            return record
        tps = self.tokens_per_step / record["step_s"]
        # "time": when the step ended, if the caller says (the trainer writes a step's record once the host has
        # read its flags, up to one step later), else now.
        record = {"event": "step", "step": step, **record, "tokens_per_s": tps, "mfu": self.mfu(tps),
                  "time": record.get("time", time.time())}
        self.prometheus.observe_step(
            step=step, loss=record["loss"], tokens=self.tokens_per_step, step_s=record["step_s"],
            data_wait_s=record["data_wait_s"], fwd_bwd_s=record["forward_backward_s"],
            optim_s=record["optimizer_s"], ckpt_block_s=record["checkpoint_block_s"], tokens_per_s=tps,
            mfu=record["mfu"], now=record["time"])
        self.prometheus.observe_rank(step_s=record["step_s"], compute_s=record["compute_s"],
                                     data_wait_s=record["data_wait_s"],
                                     collective_wait_s=record["collective_wait_s"])
        if self.jsonl is not None:
            self.jsonl.write(record)
        last = step == self.total_steps
        if self.tracked(step):
            self.tracker.log_metrics({k: record[k] for k in MLFLOW_STEP_KEYS}, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}")
        elif self.console and (last or step % self.log_every == 0):
            console_log.info("step %d/%d loss %.4f lr %.2e %.0f tok/s mfu %s ETA %s", step, self.total_steps,
                     record["loss"], record["lr"], tps, flops.format_mfu(record["mfu"]), self.eta(step))
        return record

    def _log_eval(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        record = {**record, "step": step, "time": time.time()}
        self.prometheus.observe_eval(record["val_loss"])
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.tracker is not None:
            self.tracker.log_metrics({k: record[k] for k in MLFLOW_EVAL_KEYS}, step=step)
        if self.console:
            best = record["best_val_loss"]
            console_log.info("step %d validation loss %.4f (best %.4f at step %s, %.1fs)", step, record["val_loss"],
                     best if best is not None else math.nan, record["best_val_step"], record["eval_s"])
        return record

    def eta(self, step: int) -> str:
        """Time left to train.steps at the pace of this launch so far ("0:05:31"), "?" before any step."""
        first, t0 = self._since
        if step <= first:
            return "?"
        left = (self.total_steps - step) * (time.monotonic() - t0) / (step - first)
        return str(datetime.timedelta(seconds=round(max(0.0, left))))

    def log_checkpoint(self, step: int, uri: str, duration_s: float, finished_unix: float) -> None:
        """A checkpoint finished (in the background or not): the Prometheus gauges and the MLflow record."""
        self.prometheus.observe_checkpoint(duration_s, finished_unix)
        if self.tracker is not None:
            self.tracker.log_checkpoint(step, uri)

    def close(self) -> None:
        """Stop the bar, the jsonl file and the endpoint (the tracker is closed by its owner)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.jsonl is not None:
            self.jsonl.close()
        self.prometheus.close()


def batch_hash(indices: Sequence[int]) -> str:
    """sha256 of a global batch's window indices (metrics.batch_hash: the elasticity checks compare them)."""
    return hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()


class JsonlLog:
    """Append-only JSON lines, flushed per line so a killed run keeps everything up to its last step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL log; a line cut short by a kill is ignored."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_loss(metrics_path: Path, out_path: Path) -> Path:
    """Loss against step from metrics.jsonl (the last value per step wins after a resume)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step: dict[int, float] = {}
    for rec in read_jsonl(metrics_path):
        if rec.get("event") == "step" and "loss" in rec:
            by_step[int(rec["step"])] = float(rec["loss"])
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, [by_step[s] for s in steps], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out_path.with_name(out_path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out_path)
    return out_path
