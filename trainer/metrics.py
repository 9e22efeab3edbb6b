"""Training metrics: a Prometheus endpoint per worker, a JSONL log and the loss-curve plot.

Usage:
    m = TrainerMetrics(port=9100 + local_rank, rank=global_rank)   # port 0: no HTTP endpoint, metrics still kept
    m.observe_step(step=..., loss=..., tokens=..., step_s=..., data_wait_s=..., fwd_bwd_s=..., optim_s=...,
                   ckpt_block_s=..., tokens_per_s=..., mfu=None)
    m.observe_rank(step_s=..., compute_s=..., data_wait_s=..., collective_wait_s=...)
    m.observe_eval(val_loss)
    m.observe_checkpoint(duration_s, finished_unix)
    clock = StepClock(device); clock.start(); ...; clock.grads_ready(); ...; clock.synced(); clock.split()
    log = JsonlLog(run_dir / "metrics.jsonl"); log.write({"step": 1, "loss": 5.5})
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")

The metric names are fixed (dashboards and alerts use them). Each rank is a separate endpoint and Prometheus
adds job/pod/instance; only the per-rank straggler gauges (`trainer_rank_*`) carry a label of their own,
`rank` (the global rank), so that a rule can compare ranks of one job across pods and restarts.

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

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("trainer.metrics")

# Step phases of a tiny CPU model take milliseconds, a 7B step on GPUs seconds to a minute.
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class TrainerMetrics:
    def __init__(self, port: int = 0, rank: int = 0) -> None:
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
        self.mfu.set(math.nan)
        self.val_loss.set(math.nan)
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
        import torch

        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self._cuda else []
        self._t: list[float | None] = [None, None, None]

    def _mark(self, i: int) -> None:
        self._t[i] = time.perf_counter()
        if self._cuda:
            self._events[i].record()

    def start(self) -> None:
        """Forward is about to start (the batch is on the device)."""
        self._t = [None, None, None]
        self._mark(0)

    def grads_ready(self) -> None:
        """Gradients reached the token embedding's output (called from a gradient hook; the last call wins)."""
        self._mark(1)

    def synced(self) -> None:
        """The step's synchronising all-reduce returned."""
        self._mark(2)

    def split(self) -> tuple[float, float]:
        """(forward/backward compute, collective wait) in seconds; call after the all-reduce's result was read."""
        t0, t1, t2 = self._t
        if t0 is None or t2 is None:
            return 0.0, 0.0
        if t1 is None:  # no hook (torch.compile): everything counts as compute
            return t2 - t0, 0.0
        if self._cuda:
            e0, e1, e2 = self._events
            return e0.elapsed_time(e1) / 1e3, e1.elapsed_time(e2) / 1e3
        return t1 - t0, t2 - t1


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
