"""Preparation throughput: ``prepare`` on the local runner and on Ray with 1, 2 and 4 workers, side by side.

Usage: `python -m bench --only prepare` (`--quick` for a smaller corpus).

The corpus is the Python standard library's own source (``*.py`` without tests, site-packages and idlelib), tokenized
with a BPE of 8,192 ids trained on it once beforehand and passed as a tokenizer file, so encoding is what is timed.
Every run has the same 16 tasks, so every run writes the same bytes (checked: the manifests' sha256 must agree).
Figures: MB of text per second for each runner and worker count, its ratio to one worker of the same runner, and
Ray's overhead against local processes at the same worker count; the Ray start-up (``ray.init`` in process) is
reported apart and not counted in the runs. Byte-level tokens against BPE, both with 2 local workers, show how much
of the cost is the encoding.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

from bench.common import Figure, ratio
from bench.data_path import _stdlib_corpus
from trainer.data.inputs import PrepareStats, collect_files, plan_tasks, read_documents
from trainer.data.prepare import prepare
from trainer.data.tokenizer import train_bpe

TASKS = 16
WORKERS = (1, 2, 4)


def _timed(corpus: Path, out: Path, size: int, **kw) -> tuple[float, str]:
    """(MB/s of text, sha256 of the manifest) of one prepare run."""
    t0 = time.perf_counter()
    prepare([corpus], f"file://{out}", tasks=TASKS, val_fraction=0, **kw)
    return size / (time.perf_counter() - t0) / 1e6, hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()


def run(quick: bool = False) -> list[Figure]:
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    corpus, size = _stdlib_corpus(tmp, (2 << 20) if quick else (8 << 20))
    units = plan_tasks(collect_files([corpus]), skip_binary=True, stats=PrepareStats())
    bpe = train_bpe((d.decode("utf-8", "replace") for u in units for d in read_documents(u)), 8192)
    (tmp / "bpe.json").write_text(bpe.to_json())
    tok = {"tokenizer": "gpt2", "tokenizer_file": tmp / "bpe.json"}
    rates: dict[tuple[str, int], float] = {}
    digests: set[str] = set()
    for w in WORKERS:
        rates["local", w], sha = _timed(corpus, tmp / f"local{w}", size, workers=w, **tok)
        digests.add(sha)
    byte_rate, _ = _timed(corpus, tmp / "byte", size, workers=2)
    t0 = time.perf_counter()
    ray.init(num_cpus=max(WORKERS), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}})  # fmt: skip
    ray_start = time.perf_counter() - t0
    try:
        for w in WORKERS:
            rates["ray", w], sha = _timed(corpus, tmp / f"ray{w}", size, engine="ray", workers=w, **tok)
            digests.add(sha)
    finally:
        ray.shutdown()
    same = "the same manifest sha256 in every run" if len(digests) == 1 else f"{len(digests)} DIFFERENT manifests"
    notes = f"{size / 1e6:.1f} MB of stdlib *.py, BPE 8192, {TASKS} tasks, {os.cpu_count()} CPUs; {same}"
    figures = []
    for engine in ("local", "ray"):
        for w in WORKERS:
            figures.append(Figure("prepare", f"{engine} runner, {w} worker{'s' if w > 1 else ''} vs 1",
                                  rates[engine, w], "MB/s of text", rates[engine, 1], "1 worker",
                                  ratio(rates[engine, w], rates[engine, 1]), notes=notes if w == 1 else ""))
    for w in WORKERS:
        figures.append(Figure("prepare", f"Ray vs local processes, {w} worker{'s' if w > 1 else ''}", rates["ray", w],
                              "MB/s of text", rates["local", w], "local runner", ratio(rates["ray", w], rates["local", w]),
                              notes=f"ray.init in process took {ray_start:.1f}s, not counted" if w == 1 else ""))
    figures.append(Figure("prepare", "byte-level vs BPE, 2 local workers", byte_rate, "MB/s of text",
                          rates["local", 2], "BPE", ratio(byte_rate, rates["local", 2])))
    return figures
