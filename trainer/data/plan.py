"""The plan of a `prepare` job: which inputs, cut into which units, grouped into which tasks, under which settings
and tokenizer. Every task's output is a pure function of the plan and the task's index (trainer/data/tasks.py).

Use::

    inputs = describe_inputs(files)                              # path, size, content hash of each input, in order
    units = plan_units(files, inputs, skip_binary=True, stats=stats)
    plan = Plan(settings=..., inputs=inputs, units=units, bounds=task_bounds(units, weights, 16), tokenizer=None)
    plan = plan.with_tokenizer({...})                            # once the tokenizer is fixed (trained or loaded)
    raw = plan.to_json(); Plan.parse(raw, uri)                   # stored as prepare/plan.json next to the shards
    plan.units_of(3)                                             # the input ranges task 3 reads, in order

A unit is one text file (or a 64 MiB piece of one), a 32 MiB slice of a JSONL file at line breaks, or a Parquet row
group (trainer/data/inputs.py). A task is a contiguous run of units, cut where the running input bytes pass
``i / tasks`` of the total, so the cut depends on the inputs and the task count alone, never on how many workers run
them. ``recipe_sha256`` hashes everything but the tokenizer's own bytes (a trained tokenizer is learned from the
plan's sample, after planning); ``sha256`` hashes all of it, and every task's commit names it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from trainer.data.cache import sha256_file
from trainer.data.errors import DataError
from trainer.data.inputs import InputFile, PrepareStats, Task, plan_tasks

FORMAT = "gpu-train-prepare-plan"
VERSION = 1
PLAN_KEY = "prepare/plan.json"
COMMIT_PREFIX = "prepare/task-"
TASK_INPUT_BYTES = 8 << 20  # the default task count gives each task about this much input
MAX_DEFAULT_TASKS = 4096
# What a changed setting is called on the command line, for the one line that refuses a resume.
FLAGS = {
    "tokenizer": "--tokenizer", "vocab_size": "--vocab-size", "tokenizer_sha256": "--tokenizer-file",
    "shard_tokens": "--shard-tokens", "text_field": "--text-field", "val_fraction": "--val-fraction",
    "seed": "--seed", "skip_binary": "--keep-binary", "include": "--include", "exclude": "--exclude",
}  # fmt: skip


def commit_key(index: int) -> str:
    return f"{COMMIT_PREFIX}{index:06d}.json"


@dataclass(frozen=True)
class InputRef:
    """One input as the plan pins it: where (an absolute path, or an s3:// / gs:// URI), how big, and its content:
    ``sha256:<hex>`` of a local file's bytes, or ``etag:<etag>`` of an object (checked again before a task reads it)."""

    path: str
    size: int
    content: str
    fmt: str


@dataclass(frozen=True)
class Plan:
    settings: dict[str, Any]
    inputs: tuple[InputRef, ...]
    units: tuple[tuple[int, int, int], ...]  # (input index, start, end): a byte range, or row groups for Parquet
    bounds: tuple[int, ...]  # task i reads units[bounds[i]:bounds[i + 1]]
    tokenizer: dict[str, Any] | None = None  # kind, name, vocab_size, eot_id, sha256 (of tokenizer.json, or "")

    @property
    def tasks(self) -> int:
        return len(self.bounds) - 1

    def units_of(self, index: int) -> list[Task]:
        """The input ranges task ``index`` reads, in order."""
        if not 0 <= index < self.tasks:
            raise DataError(f"task {index} does not exist: the plan has tasks 0..{self.tasks - 1}")
        out = []
        for i, start, end in self.units[self.bounds[index] : self.bounds[index + 1]]:
            ref = self.inputs[i]
            out.append(Task(ref.path, ref.fmt, start, end))
        return out

    def with_tokenizer(self, tokenizer: dict[str, Any]) -> Plan:
        return replace(self, tokenizer=dict(tokenizer))

    def to_dict(self, *, with_tokenizer: bool = True) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "tasks": self.tasks, "settings": self.settings,
            "inputs": [{"path": r.path, "size": r.size, "content": r.content, "format": r.fmt} for r in self.inputs],
            "units": [list(u) for u in self.units], "bounds": list(self.bounds),
        }  # fmt: skip
        if with_tokenizer:
            doc["tokenizer"] = self.tokenizer
        return doc

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")) + "\n").encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json()).hexdigest()

    @property
    def recipe_sha256(self) -> str:
        raw = json.dumps(self.to_dict(with_tokenizer=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(raw.encode()).hexdigest()

    @classmethod
    def parse(cls, raw: bytes, uri: str) -> Plan:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise DataError(f"{uri}: not a {FORMAT} version {VERSION} document")
            inputs = tuple(InputRef(d["path"], int(d["size"]), d["content"], d["format"]) for d in doc["inputs"])
            units = tuple((int(a), int(b), int(c)) for a, b, c in doc["units"])
            plan = cls(doc["settings"], inputs, units, tuple(int(b) for b in doc["bounds"]), doc.get("tokenizer"))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{uri}: not a readable prepare plan ({type(exc).__name__}: {exc})") from exc
        if plan.tasks != doc["tasks"] or plan.bounds[0] != 0 or plan.bounds[-1] != len(units):
            raise DataError(f"{uri}: the plan's task bounds do not cover its {len(units)} units")
        return plan

    def difference(self, other: Plan) -> str:
        """What ``other`` changes against this plan, in a few words naming the flag or input (empty: nothing)."""
        if self.tasks != other.tasks:
            return f"--tasks {self.tasks} then, {other.tasks} now"
        for key in sorted(set(self.settings) | set(other.settings)):
            then, now = self.settings.get(key), other.settings.get(key)
            if then != now:
                return f"{FLAGS.get(key, key)} {then!r} then, {now!r} now"
        old = {r.path: r for r in self.inputs}
        new = {r.path: r for r in other.inputs}
        for path in sorted(old.keys() ^ new.keys()):
            return f"input {path} {'was read then and is not now' if path in old else 'is new'}"
        for path in sorted(old):
            if old[path] != new[path]:
                return f"input {path} changed (size {old[path].size} then, {new[path].size} now; content hash differs)"
        if self.recipe_sha256 != other.recipe_sha256:
            return "the inputs are read in another order or cut into other units"
        return ""


def describe_inputs(files: Sequence[InputFile], threads: int = 8) -> tuple[InputRef, ...]:
    """Each input's path, size and sha256, in the given order (hashed by a few threads: hashlib releases the GIL)."""

    def one(f: InputFile) -> InputRef:
        return InputRef(os.path.abspath(f.path), f.path.stat().st_size, "sha256:" + sha256_file(f.path), f.fmt)

    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        return tuple(pool.map(one, files))


def plan_units(files: Sequence[InputFile], inputs: Sequence[InputRef], *, skip_binary: bool, stats: PrepareStats,
               say: Callable[[str], None] | None = None) -> tuple[tuple[tuple[int, int, int], ...], list[int]]:
    """The units of the inputs in order, and each unit's weight in input bytes; binary and empty files are skipped,
    each with one line through ``say``."""
    index = {ref.path: i for i, ref in enumerate(inputs)}
    units = tuple((index[os.path.abspath(t.path)], t.start, t.end)
                  for t in plan_tasks(files, skip_binary=skip_binary, stats=stats, say=say))
    groups: dict[int, int] = {}  # a Parquet row group weighs its file's size over the file's row groups
    for i, _, _ in units:
        groups[i] = groups.get(i, 0) + 1
    weights = [end - start if inputs[i].fmt != "parquet" else inputs[i].size // groups[i] for i, start, end in units]
    return units, weights


def default_tasks(total_bytes: int) -> int:
    """About TASK_INPUT_BYTES of input per task (at least 1, at most MAX_DEFAULT_TASKS): a function of the inputs alone."""
    return max(1, min(MAX_DEFAULT_TASKS, math.ceil(total_bytes / TASK_INPUT_BYTES)))


def task_bounds(weights: Sequence[int], tasks: int) -> tuple[int, ...]:
    """Cut the units into ``tasks`` contiguous runs: task i starts at the first unit whose preceding input bytes
    reach i/tasks of the total. A task may be empty (fewer units than tasks); its commit then lists no shards."""
    if tasks < 1:
        raise DataError(f"--tasks must be >= 1 (got {tasks})")
    total = sum(weights)
    bounds, seen, u = [0], 0, 0
    for i in range(1, tasks):
        goal = total * i // tasks
        while u < len(weights) and seen < goal:
            seen += weights[u]
            u += 1
        bounds.append(u)
    bounds.append(len(weights))
    return tuple(bounds)
