"""A corpus for prepare's task tests, made by the test: about 60 inputs of uneven sizes (empty files, a file larger
than a shard, non-UTF-8 bytes, JSONL, Parquet with several row groups), and a fingerprint of a dataset's bytes.

Usage: ``corpus = make_corpus(tmp_path / "in")``; ``tree_sha(tmp_path / "ds")`` -> {relative path: sha256}.
tests/trainer/data/conftest.py makes them the module fixtures `corpus` and `reference`.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARD_TOKENS = 4096  # the big file (10 kB) is larger than a shard
TASKS = 7
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def make_corpus(root: Path) -> Path:
    rng = random.Random(1234)
    root.mkdir(parents=True)
    for i in range(40):
        (root / f"text-{i:02d}.txt").write_text(_text(rng, rng.choice([3, 20, 90, 400])))
    for i in range(3):
        (root / f"empty-{i}.txt").write_bytes(b"")
    (root / "big.txt").write_text(_text(rng, 1800))  # ~10 kB of bytes: more than SHARD_TOKENS
    (root / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1"))
    (root / "broken.txt").write_bytes(b"valid start \xff\xfe then more text\n")
    for i in range(7):
        lines = [json.dumps({"text": _text(rng, rng.randint(1, 60)), "n": j}) for j in range(rng.randint(1, 30))]
        (root / f"docs-{i}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "empty.jsonl").write_bytes(b"")
    for i in range(5):
        rows = [_text(rng, rng.randint(1, 40)) for _ in range(rng.randint(3, 25))]
        pq.write_table(pa.table({"text": rows}), root / f"rows-{i}.parquet", row_group_size=4)
    return root


def tree_sha(root: Path) -> dict[str, str]:
    """Every file below ``root`` (shards, indexes, manifest, plan, commits) by relative path -> sha256."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip

