"""Command line of the trainer.

Run:
    python -m trainer --preset tiny --run-dir runs/dev train.steps=50          # one process (world 1)
    torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 \\
        --max-restarts=3 -m trainer --preset tiny --run-dir runs/dev             # elastic, 2 workers
    python -m trainer --help                                                   # every key with its default

Overrides are `section.key=value`; an unknown key or a value of the wrong type exits with code 2 and a message
naming the key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.config import PRESETS, ConfigError, build_config, reference


def _parser() -> argparse.ArgumentParser:
    keys = "\n".join(f"  {key:<36} {typ:<22} default {default!r}" for key, typ, default in reference())
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a GPT decoder with DDP or FSDP2; elastic under torchrun; resumes from the newest "
        "verified checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"overrides (section.key=value; values of the preset shown for tiny):\n{keys}\n\n"
        "See docs/trainer.md.",
    )
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="named configuration (default tiny)")
    p.add_argument("--config", type=Path, default=None, help="YAML file with the same sections as the overrides")
    p.add_argument("--run-dir", type=Path, default=Path("runs/default"),
                   help="outputs: summary.json, metrics.jsonl, loss.png, config.json, checkpoints/")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cfg = build_config(args.preset, args.config, args.overrides)
    except ConfigError as exc:
        parser.exit(2, f"python -m trainer: config error: {exc}\n")
    from trainer.train import train

    try:
        train(cfg, args.run_dir)
    except ConfigError as exc:
        print(f"python -m trainer: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
