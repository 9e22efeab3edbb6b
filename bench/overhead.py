"""Framework overhead: steps/s of our training loop vs a bare PyTorch loop on the same model, batch
and precision, with no metrics, no checkpoints and no data path (bench/bare.py).

Usage: `python -m bench --only overhead`. Runs alternate ours/bare so machine noise hits both; the
figure is the ratio of medians. A last row sets the chunked output layer and loss (train.loss_chunk_tokens)
beside whole logits in the bare loop, the same way.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Figure
from bench.runs import ROOT, run_trainer, seconds_per_step

# A model big enough that a step is compute, not Python (about 0.1-0.3 s per step on one CPU core).
SMALL = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.context=128",
         "train.global_batch_tokens=8192", "train.micro_batch_size=16"]
NO_EXTRAS = ["checkpoint.every_steps=0", "metrics.log_every=10"]
FROM_STEP = 10


def measure(preset: str, overrides: list[str], steps: int, repeats: int) -> tuple[float, float]:
    """(median seconds/step of our loop, of the bare loop)."""
    ours, bare = [], []
    args = [*overrides, f"train.steps={steps}"]
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            events = run_trainer(Path(tmp) / "run", preset, [*args, *NO_EXTRAS])
            ours.append(seconds_per_step(events, FROM_STEP))
        out = subprocess.run([sys.executable, "-m", "bench.bare", "--preset", preset, "--steps", str(steps),
                              "--from-step", str(FROM_STEP), *args], cwd=ROOT, capture_output=True, text=True,
                             check=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        bare.append(json.loads(out.stdout.strip().splitlines()[-1])["seconds_per_step"])
    return statistics.median(ours), statistics.median(bare)


# A vocabulary large enough that the output layer and loss weigh in the step (GPT-2's is 50,304).
BIG_VOCAB = ["model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.context=128", "model.vocab_size=8192",
             "train.global_batch_tokens=4096", "train.micro_batch_size=8"]


def _bare(preset: str, overrides: list[str], steps: int) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.bare", "--preset", preset, "--steps", str(steps),
                          "--from-step", str(FROM_STEP), *overrides], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds_per_step"]


def chunked_loss(quick: bool = False) -> Figure:
    """The bare loop with train.loss_chunk_tokens=512 against whole logits (0), alternating runs, on a model whose
    vocabulary is 8,192: whether the default chunking costs time where its memory saving matters."""
    steps, repeats = (30, 1) if quick else (40, 3)
    chunked, whole = [], []
    for _ in range(repeats):
        chunked.append(_bare("tiny", [*BIG_VOCAB, "train.loss_chunk_tokens=512", f"train.steps={steps}"], steps))
        whole.append(_bare("tiny", [*BIG_VOCAB, "train.loss_chunk_tokens=0", f"train.steps={steps}"], steps))
    c, w = statistics.median(chunked), statistics.median(whole)
    return Figure("overhead", "chunked loss (512 tokens) vs whole logits: bare loop, vocab 8,192, CPU fp32", 1 / c,
                  "steps/s", 1 / w, "whole logits", w / c, ">= 0.97", w / c >= 0.97,
                  notes=f"median of {repeats}, steps {FROM_STEP}-{steps}, 1 thread")


def run(quick: bool = False) -> list[Figure]:
    steps = 30 if quick else 60
    repeats = 1 if quick else 3
    figures = []
    for label, preset, overrides in (("small GPT (4x128, ctx 128), CPU fp32", "tiny", SMALL),
                                     ("tiny preset, CPU fp32", "tiny", [])):
        ours, bare = measure(preset, overrides, steps, repeats)
        r = bare / ours  # steps/s ours over steps/s bare
        figures.append(Figure("overhead", f"our loop vs bare loop: {label}", 1 / ours, "steps/s", 1 / bare,
                              "bare PyTorch loop", r, ">= 0.97", r >= 0.97,
                              notes=f"median of {repeats}, steps {FROM_STEP}-{steps}, 1 worker"))
    figures.append(chunked_loss(quick))
    return figures
