"""Stack files planned beside stacks/: each dev stack with serving enabled (examples/serving.yaml's block added).

Usage:
    python -m tools.variants --out build/variants      # writes Pulumi.<stack>-serving.yaml, prints their paths
    serving_stack_file("aws-dev-serving", out_dir)     # one of them (tests/conftest.py plans them)

`make schemas` plans these too, so the serving charts' snapshots record what they render for a stack that
serves (tools/validation/refresh.py); the tests check their plans with the charts, CRDs, policies and admission
rules, like the stacks' own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVING_BLOCK = ROOT / "examples" / "serving.yaml"
SERVING = {"aws-dev-serving": "aws-dev", "gcp-dev-serving": "gcp-dev"}


def serving_stack_file(name: str, out_dir: Path) -> Path:
    """stacks/Pulumi.<base>.yaml with examples/serving.yaml's settings, as Pulumi.<name>.yaml in out_dir."""
    doc = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{SERVING[name]}.yaml").read_text())
    doc["config"].update(yaml.safe_load(SERVING_BLOCK.read_text()))
    path = out_dir / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.variants", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in SERVING:
        print(serving_stack_file(name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
