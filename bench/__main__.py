"""Run the benchmarks, print one table, write build/bench/results.json.

Usage:
    python -m bench                      # every CPU section (make bench)
    python -m bench --only data,plan     # some sections
    python -m bench --quick              # smaller sizes, for a smoke run
    python -m bench --gpu                # add the CUDA section (needs a GPU)

Every figure is measured against its reference in the same run, and reported as a ratio; nothing
here is a pass/fail test. docs/performance.md records the figures of a full run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

SECTIONS = {
    "overhead": "bench.overhead",
    "data": "bench.data_path",
    "prepare": "bench.prepare",
    "checkpoint": "bench.checkpoint",
    "recovery": "bench.recovery",
    "elastic": "bench.elastic",
    "plan": "bench.plan",
    "serving": "bench.serving",
    "sweeps": "bench.sweeps",
}
GPU_SECTION = ("gpu", "bench.gpu")


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def print_table(figures) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="gpu-train benchmarks (measured side by side in this run)")
    for col in ("section", "figure", "value", "reference", "ratio", "target"):
        table.add_column(col, overflow="fold")
    for f in figures:
        mark = "" if f.meets_target is None else (" ✓" if f.meets_target else " ✗")
        ref = f"{_fmt(f.reference)} ({f.reference_name})" if f.reference is not None else ""
        # escape: the notes' brackets are text, not rich markup (which would drop them)
        table.add_row(f.section, escape(f.name + (f" [{f.notes}]" if f.notes else "")), f"{_fmt(f.value)} {f.unit}", ref,
                      _fmt(f.ratio), f.target + mark)
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(SECTIONS)}, gpu")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--gpu", action="store_true", help="also run the CUDA section")
    ap.add_argument("--out", type=Path, default=Path("build/bench/results.json"))
    args = ap.parse_args(argv)

    chosen = dict(SECTIONS)
    if args.gpu:
        chosen[GPU_SECTION[0]] = GPU_SECTION[1]
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {*SECTIONS, GPU_SECTION[0]}]
        if unknown:
            ap.error(f"unknown section(s) {unknown}; known: {', '.join([*SECTIONS, GPU_SECTION[0]])}")
        chosen = {n: (SECTIONS | dict([GPU_SECTION]))[n] for n in names}

    figures, timings = [], {}
    for name, module in chosen.items():
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        figures += importlib.import_module(module).run(quick=args.quick)
        timings[name] = round(time.perf_counter() - t0, 1)

    print_table(figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "cpu": platform.processor()
                    or platform.machine(), "cpus": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "quick": args.quick,
        "section_seconds": timings,
        "figures": [dataclasses.asdict(f) for f in figures],
    }
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
