"""Framework overhead: steps/s of our training loop vs a bare PyTorch loop on the same model, batch
and precision, with no metrics, no checkpoints and no data path (bench/bare.py).

Usage: `python -m bench --only overhead`. Separate runs of one loop land up to 15% apart on a shared machine
(docs/performance.md), more than the 3% the target allows, however they alternate. So the process rows run our
loop (the launcher, torchrun and one worker, as `gpu-train run --local` starts them) and the bare loop at the same
time, each on a core of its own, and time both over the same seconds; the figure is the median of the pairs'
ratios, each run's seconds per step kept in the figure's `extra`. Two more rows run both loops in one process,
taking turns every step (bench/interleaved.py), the figure again the median of the pairs' ratios. A last row sets the chunked output layer and loss
(train.loss_chunk_tokens) beside whole logits in the bare loop, alternating runs.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import Figure, launch_local
from bench.runs import QUIET, ROOT
from trainer.distributed import free_port

log = logging.getLogger("bench.overhead")

# A model big enough that a step is compute, not Python (about 0.1-0.3 s per step on one CPU core).
SMALL = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.context=128",
         "train.global_batch_tokens=8192", "train.micro_batch_size=16"]
NO_EXTRAS = ["checkpoint.every_steps=0", "metrics.log_every=10"]
FROM_STEP = 10


def side_by_side(preset: str, overrides: list[str], steps: int, repeats: int) -> list[tuple[float, float]]:
    """(seconds/step of our loop, of the bare loop) per repeat, both running at once, each on a core of its own (which
    core flips every repeat), timed over the same wall-clock window: the steps both ended while the other was
    stepping. A machine slowing down or speeding up slows or speeds both alike."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        log.warning("overhead: %d CPU core available, so both loops share it unpinned", len(cores))
    pairs = []
    for repeat in range(repeats):
        ours_core, bare_core = (cores[repeat % 2], cores[1 - repeat % 2]) if len(cores) >= 2 else (None, None)
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            cmd, env = launch_local(run_dir, preset, [*QUIET, *overrides, *NO_EXTRAS, f"train.steps={steps}"],
                                    port=free_port())
            with (Path(tmp) / "ours.log").open("wb") as out:
                ours = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        preexec_fn=_pinned(ours_core))
            try:
                bare = _run_json("bench.bare", ["--preset", preset, "--steps", str(steps), "--from-step",
                                                str(FROM_STEP), "--ends", *overrides, f"train.steps={steps}"],
                                 core=bare_core)["ends"]
            finally:
                if ours.wait() != 0:
                    raise RuntimeError(f"trainer failed ({ours.returncode}):\n"
                                       f"{(Path(tmp) / 'ours.log').read_text()[-3000:]}")
            # The last step's record follows the final checkpoint's save: it is left out.
            pairs.append(_over_the_same_window(_step_ends(run_dir)[FROM_STEP - 1:-1], bare))
    return pairs


def _step_ends(run_dir: Path) -> list[float]:
    """When each step of the trainer's metrics log ended, in step order."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [e["time"] for e in sorted((e for e in events if e.get("event") == "step"), key=lambda e: e["step"])]


def _over_the_same_window(ours: list[float], bare: list[float]) -> tuple[float, float]:
    """Seconds per step of each loop over the steps that ended while both were stepping."""
    lo, hi = max(ours[0], bare[0]), min(ours[-1], bare[-1])
    spans = []
    for ends in (ours, bare):
        inside = [t for t in ends if lo <= t <= hi]
        if len(inside) < 10:
            raise RuntimeError(f"the two loops stepped together for {len(inside)} steps, too few to compare: "
                               f"raise the steps")
        spans.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return spans[0], spans[1]


def _pinned(core: int | None) -> Callable[[], None] | None:
    """A subprocess's preexec_fn that keeps it, and every process it starts, on `core`."""
    return None if core is None else lambda: os.sched_setaffinity(0, {core})


# A vocabulary large enough that the output layer and loss weigh in the step (GPT-2's is 50,304).
BIG_VOCAB = ["model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.context=128", "model.vocab_size=8192",
             "train.global_batch_tokens=4096", "train.micro_batch_size=8"]


def _run_json(module: str, args: list[str], core: int | None = None) -> dict:
    """`python -m <module> args...` on one thread (on `core`, if given), from the repository root; the JSON line it
    prints last."""
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
                         preexec_fn=_pinned(core))
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bare(preset: str, overrides: list[str], steps: int) -> float:
    """Seconds per step of the bare loop (bench/bare.py) after step FROM_STEP."""
    return _run_json("bench.bare", ["--preset", preset, "--steps", str(steps), "--from-step", str(FROM_STEP),
                                    *overrides])["seconds_per_step"]


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


def interleaved(preset: str, overrides: list[str], blocks: int, block_steps: int) -> tuple[float, float, float]:
    """(median seconds/step of our loop, of the bare loop, median of the pairs' ratios) from bench/interleaved.py:
    both loops in one process, alternating blocks of steps."""
    got = _run_json("bench.interleaved", ["--preset", preset, "--blocks", str(blocks), "--block-steps",
                                          str(block_steps), *overrides])
    return got["ours_s"], got["bare_s"], statistics.median(got["ratios"])


def run(quick: bool = False) -> list[Figure]:
    repeats = 2 if quick else 4
    figures = []
    for label, preset, overrides, steps in (("small GPT (4x128, ctx 128), CPU fp32", "tiny", SMALL, 60),
                                            ("tiny preset, CPU fp32", "tiny", [], 240)):
        if quick:
            steps //= 2
        pairs = side_by_side(preset, overrides, steps, repeats)
        ours, bare = (statistics.median(side) for side in zip(*pairs, strict=True))
        r = statistics.median(b / o for o, b in pairs)  # steps/s ours over steps/s bare, each pair at one time
        figures.append(Figure("overhead", f"our loop vs bare loop, separate processes at once: {label}", 1 / ours,
                              "steps/s", 1 / bare, "bare PyTorch loop", r, ">= 0.97", r >= 0.97,
                              notes=f"median of {repeats} pairs' ratios, each pair at once on its own core over the "
                                    f"same seconds, {steps} steps, 1 worker",
                              extra={"ours_s": [o for o, _ in pairs], "bare_s": [b for _, b in pairs]}))
    # The same loops in one process, taking turns every step (bench/interleaved.py): the loop's own per-step cost.
    # One-step turns: the pairs' ratios of `tiny` spread less than with 5-step blocks (median pair ratio 0.974-0.976
    # in three runs of 200 pairs, against 0.961-0.977 in three of 40 pairs of 5 steps), for the same steps.
    for label, overrides, blocks in (("small GPT (4x128, ctx 128), CPU fp32", SMALL, 24),
                                     ("tiny preset, CPU fp32", [], 200)):
        block_steps = 1
        if quick:
            blocks //= 6
        ours, bare, r = interleaved("tiny", overrides, blocks, block_steps)
        figures.append(Figure("overhead", f"our loop vs bare loop, one process, alternating: {label}", 1 / ours,
                              "steps/s", 1 / bare, "bare PyTorch loop", r, ">= 0.97", r >= 0.97,
                              notes=f"median of {blocks} pairs' ratios ({block_steps}-step turns); ratio of the "
                                    f"medians {bare / ours:.3f}"))
    figures.append(chunked_loss(quick))
    return figures
