"""The trainer's loop and the bare loop in one process, in alternating blocks of steps: the per-step cost of the
loop itself, with the machine's drift taken out.

Usage: `python -m bench.interleaved --preset tiny --blocks 12 --block-steps 5 model.n_layer=4 ...` prints one JSON
line, {"ours_s": ..., "bare_s": ..., "ratios": [...], "trainer_steps": ..., ...}: the median seconds per step of each
side, each pair of blocks' bare/ours ratio, and the steps each loop trained (warm-up included).

Why. On a shared 2-core machine, separate runs of the same loop land up to 15% apart (docs/performance.md), more
than the 3% the overhead target allows, however they alternate. Here the bundled trainer (trainer/train.py,
`Trainer.advance()`: the step with its data read, flags, clipping, optimizer, step record, and the evaluation and
checkpoint decisions, on one worker with synthetic data) and the bare loop (bench/bare.py's `BareLoop`, the same
model, optimizer, schedule, clipping, accumulation and batch) take turns every `block_steps` steps, the order
flipped every pair, after warm-up steps of both. What a separate process adds (torchrun, imports, the final
checkpoint) is outside a step and is what bench/overhead.py's process rows include.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.bare import BareLoop
from gpu_train.spec import trainer_config as tcfg
from trainer.distributed import init_distributed, shutdown
from trainer.train import Trainer

# No checkpoint at all (train.steps is never reached, so not even the final one), no evaluation, no metrics
# endpoint, no tracking.
QUIET = ["metrics.port=0", "tracking.enabled=false", "checkpoint.every_steps=0", "eval.every_steps=0",
         "metrics.log_every=10", "train.steps=1000000"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.interleaved")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--blocks", type=int, default=12, help="pairs of blocks (one of each loop)")
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="steps of each loop before timing")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = tcfg.build_config(args.preset, None, [*args.overrides, *QUIET])
    env = init_distributed()
    try:
        with tempfile.TemporaryDirectory() as tmp, Trainer(cfg, Path(tmp) / "run", env) as trainer:
            bare = BareLoop(cfg)
            trainer.watchdog.start()
            trainer.runner.train()
            step = 0

            def ours() -> None:
                trainer.advance()

            def theirs() -> None:
                nonlocal step
                step += 1
                bare.step(step)

            def block(run: Callable[[], None]) -> float:
                t0 = time.perf_counter()
                for _ in range(args.block_steps):
                    run()
                return (time.perf_counter() - t0) / args.block_steps

            for _ in range(args.warmup):
                ours()
                theirs()
            ours_s, bare_s, ratios = [], [], []
            for pair in range(args.blocks):
                first, second = (ours, theirs) if pair % 2 == 0 else (theirs, ours)
                a, b = block(first), block(second)
                o, t = (a, b) if first is ours else (b, a)
                ours_s.append(o)
                bare_s.append(t)
                ratios.append(t / o)
            trainer.settle()
            steps = {"trainer_steps": trainer.step, "bare_steps": step}
    finally:
        shutdown()
    print(json.dumps({"ours_s": statistics.median(ours_s), "bare_s": statistics.median(bare_s), "ratios": ratios,
                      "blocks": args.blocks, "block_steps": args.block_steps, **steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
