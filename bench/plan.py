"""Plan time per stack: `python -m infra.plan` run as a user runs it, one process per stack.

Usage: `python -m bench --only plan` (every stack); with `--quick`, the first stack alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Figure

ROOT = Path(__file__).resolve().parent.parent


def run(quick: bool = False) -> list[Figure]:
    figures = []
    stacks = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))
    stacks = stacks[:1] if quick else stacks
    with tempfile.TemporaryDirectory() as out:
        for stack in stacks:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--out", out, "--quiet"],
                                  cwd=ROOT, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"planning {stack} failed:\n{proc.stderr[-2000:]}")
            n = len(json.loads(Path(proc.stdout.strip()).read_text())["resources"])
            figures.append(Figure("plan", f"plan {stack}", seconds, "s", target="< 30 s",
                                  meets_target=seconds < 30, notes=f"{n} resources"))
    return figures
