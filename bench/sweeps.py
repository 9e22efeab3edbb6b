"""ASHA with pause and promote against random search, on a CPU proxy task: the sweep controller
(gpu_train.sweeps.controller) drives trials that train a small MLP classifier in this process.

Usage: `python -m bench --only sweeps`.

The proxy: a teacher network labels 4,096 random points in 10 classes; each trial trains a student MLP with SGD
(momentum) on them, batch 64, and reports the loss on 1,024 held-out points. Its settings are the learning rate
(log-uniform) and the momentum. A "token" here is one training example, so the budget and the rungs mean what
they mean for the trainer. A paused trial keeps its model and optimizer in memory (its checkpoint) and goes on
from there when promoted.

Both sweeps use the same random sampler and seed, so they try the same settings in the same order: random search
runs every trial to the end (early stopping none), ASHA (eta 3) pauses and promotes. Figures: the best validation
loss each reaches and the examples each trains; target: ASHA within 1% of random search's best loss for at most
40% of its compute.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import Figure, ratio
from gpu_train.spec.sweep import parse_sweep
from gpu_train.sweeps.controller import Controller

BATCH = 64


def spec(early: str, trials: int, steps: int) -> dict[str, Any]:
    return {
        "name": f"proxy-{early}",
        "trialTemplate": {"name": "proxy", "team": "local", "pool": "local", "preset": "tiny", "nodes": "1:1",
                          "steps": steps, "globalBatchTokens": BATCH},
        "searchSpace": {"train.lr": {"distribution": "logUniform", "min": 1e-4, "max": 3.0},
                        "train.momentum": {"distribution": "uniform", "min": 0.0, "max": 0.95}},
        "algorithm": {"name": "random", "seed": 11,
                      "earlyStopping": {"name": early, "minTokens": steps * BATCH // 27, "reductionFactor": 3}},
        "trialConfig": {"numTrials": trials, "parallelTrials": 3},
    }


class Proxy:
    """The task's data, made once (module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
        with torch.no_grad():
            for p in teacher.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            x = torch.randn(5120, 32, generator=g)
            y = teacher(x).argmax(dim=1)
        self.x, self.y, self.vx, self.vy = x[:4096], y[:4096], x[4096:], y[4096:]


class ProxyBackend:
    """Trials trained in this process: each pass trains a running trial up to its budget (module docstring)."""

    poll_s = 0.0

    def __init__(self, sweep, proxy: Proxy) -> None:
        self.sweep, self.proxy = sweep, proxy
        self.state: dict[str, dict[str, Any]] = {}
        self.running: set[str] = set()
        self.budget: dict[str, int] = {}
        self.trained = 0

    def settings(self, t) -> dict[str, Any]:
        return {}

    def write_budget(self, t, tokens: int) -> None:
        self.budget[t.id] = tokens

    def launch(self, t, job) -> None:
        if t.id not in self.state:
            torch.manual_seed(t.number)
            model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
            opt = torch.optim.SGD(model.parameters(), lr=job.overrides["train.lr"],
                                  momentum=job.overrides["train.momentum"])
            self.state[t.id] = {"model": model, "opt": opt, "tokens": 0}
        self.state[t.id]["evals"] = []
        self.running.add(t.id)

    def pause(self, t) -> None:
        self.running.discard(t.id)

    stop = pause

    def ended(self, t) -> str | None:
        return None if t.id in self.running else "preempted"

    def _val_loss(self, model) -> float:
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(self.proxy.vx), self.proxy.vy).item()
        return loss if loss == loss and loss < 1e6 else 1e6  # a diverged trial reports a large finite loss

    def read_status(self, t) -> dict[str, Any] | None:
        if t.id not in self.running:
            return None
        s, x, y = self.state[t.id], self.proxy.x, self.proxy.y
        end = self.sweep.max_tokens
        while s["tokens"] < self.budget[t.id]:
            i = (s["tokens"] // BATCH * BATCH) % len(x)
            loss = torch.nn.functional.cross_entropy(s["model"](x[i:i + BATCH]), y[i:i + BATCH])
            s["opt"].zero_grad()
            loss.backward()
            s["opt"].step()
            s["tokens"] += BATCH
            self.trained += BATCH
        value = self._val_loss(s["model"])
        s["evals"].append({"tokens": s["tokens"], "val_loss": value})
        return {"state": "completed" if s["tokens"] >= end else "held", "tokens": s["tokens"], "evals": s["evals"],
                "val_loss": value}


def sweep_result(early: str, trials: int, steps: int, proxy: Proxy) -> tuple[float, int]:
    sweep = parse_sweep(spec(early, trials, steps), "bench/sweeps.py")
    backend = ProxyBackend(sweep, proxy)
    with tempfile.TemporaryDirectory() as d:
        best = Controller(sweep, Path(d), backend, out=io.StringIO()).run()
    return best.value, backend.trained


def run(quick: bool = False) -> list[Figure]:
    torch.set_num_threads(1)
    trials, steps = (9, 81) if quick else (27, 270)
    proxy = Proxy()
    asha_loss, asha_tokens = sweep_result("asha", trials, steps, proxy)
    random_loss, random_tokens = sweep_result("none", trials, steps, proxy)
    compute = ratio(asha_tokens, random_tokens)
    loss_ratio = ratio(asha_loss, random_loss)
    notes = f"{trials} trials, {steps * BATCH:,} examples each at most, eta 3"
    return [
        Figure("sweeps", "ASHA best val loss", asha_loss, "nats", reference=random_loss,
               reference_name="random search, all trials to the end", ratio=loss_ratio, target="ratio <= 1.01",
               meets_target=loss_ratio is not None and loss_ratio <= 1.01, notes=notes),
        Figure("sweeps", "ASHA examples trained", float(asha_tokens), "examples", reference=float(random_tokens),
               reference_name="random search", ratio=compute, target="ratio <= 0.40",
               meets_target=compute is not None and compute <= 0.40, notes=notes),
    ]
