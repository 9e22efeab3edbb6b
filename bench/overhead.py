"""Framework overhead: steps/s of our training loop vs a bare PyTorch loop on the same model, batch
and precision, with no metrics, no checkpoints and no data path (bench/bare.py).

Usage: `python -m bench --only overhead`. Separate runs of one loop land up to 15% apart on a shared machine
(docs/performance.md), more than the 3% the target allows, however they alternate, and so do two loops running at
once on two cores. So the process rows run our loop (the launcher, torchrun and one worker, as `gpu-train run
--local` starts them) and the bare loop as two processes that take turns a step each on one core
(bench/turns.py); the figure is the median of the ratios of each of our steps to the bare step just before it. Two
more rows run both loops in one process, taking turns every step (bench/interleaved.py), the figure again the
median of the pairs' ratios. A last row sets the chunked output layer and loss (train.loss_chunk_tokens) beside
whole logits in the bare loop, alternating runs.
"""

from __future__ import annotations

import os
import statistics

from bench import turns
from bench.common import Figure, run_json
from bench.runs import QUIET

# A model big enough that a step is compute, not Python (about 0.1-0.3 s per step on one CPU core).
SMALL = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.context=128",
         "train.global_batch_tokens=8192", "train.micro_batch_size=16"]
NO_EXTRAS = ["checkpoint.every_steps=0", "metrics.log_every=10"]
FROM_STEP = 10


def taking_turns(preset: str, overrides: list[str], steps: int, repeats: int) -> tuple[list[float], list[float],
                                                                                       list[float]]:
    """Our loop and the bare loop in two processes taking turns a step each (bench/turns.py), both on one core (the
    next core every repeat): (our turns' seconds, the bare loop's, each of our turns' ratio to the bare turn just
    before it), pooled over the repeats, each run's first FROM_STEP turns left out."""
    cores = sorted(os.sched_getaffinity(0))
    ours, bare, ratios = [], [], []
    for repeat in range(repeats):
        o, b = turns.pair(preset, [*QUIET, *overrides, *NO_EXTRAS], steps, core=cores[repeat % len(cores)])
        pairs = list(zip(o, b, strict=False))[FROM_STEP:]  # the bare loop's turn i comes just before our turn i
        ours += [x for x, _ in pairs]
        bare += [y for _, y in pairs]
        ratios += [y / x for x, y in pairs]
    return ours, bare, ratios


# A vocabulary large enough that the output layer and loss weigh in the step (GPT-2's is 50,304).
BIG_VOCAB = ["model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.context=128", "model.vocab_size=8192",
             "train.global_batch_tokens=4096", "train.micro_batch_size=8"]


def _bare(preset: str, overrides: list[str], steps: int) -> float:
    """Seconds per step of the bare loop (bench/bare.py) after step FROM_STEP."""
    return run_json("bench.bare", ["--preset", preset, "--steps", str(steps), "--from-step", str(FROM_STEP),
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
    got = run_json("bench.interleaved", ["--preset", preset, "--blocks", str(blocks), "--block-steps",
                                         str(block_steps), *overrides])
    return got["ours_s"], got["bare_s"], statistics.median(got["ratios"])


def run(quick: bool = False) -> list[Figure]:
    repeats = 1 if quick else 2
    figures = []
    for label, preset, overrides, steps in (("small GPT (4x128, ctx 128), CPU fp32", "tiny", SMALL, 60),
                                            ("tiny preset, CPU fp32", "tiny", [], 240)):
        if quick:
            steps //= 2
        ours, bare, ratios = taking_turns(preset, overrides, steps, repeats)
        o, b, r = statistics.median(ours), statistics.median(bare), statistics.median(ratios)
        figures.append(Figure("overhead", f"our loop vs bare loop, separate processes taking turns: {label}", 1 / o,
                              "steps/s", 1 / b, "bare PyTorch loop", r, ">= 0.97", r >= 0.97,
                              notes=f"median of {len(ratios)} turns' ratios ({repeats} run{'s' * (repeats > 1)} of {steps} "
                                    f"steps, one core), ratio of the medians {b / o:.3f}, 1 worker"))
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
