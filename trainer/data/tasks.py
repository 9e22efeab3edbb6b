"""One `prepare` task, the unit every runner schedules, and the merge that turns the tasks' commits into the dataset.

Use::

    commit = run_task(plan, 3, store, tokenizer)      # tokenize task 3's units, upload its shards, commit them
    outcome = attempt(plan_json, 3, endpoint_url)    # the same from a plain picklable call (what runners ship)
    manifest = merge(plan, store, tokenizer_info)    # every commit -> manifest.json, in task order

or from a shell, for any scheduler that can start a process (a cluster's Indexed Job, a batch array)::

    python -m trainer.data prepare-task s3://bucket/ds --index 3 --index 4

Contract. Task ``i`` of a plan (trainer/data/plan.py) reads its units in order, sends each document to the training
or validation split by a keyed hash of its bytes, packs each split into shards of ``shard_tokens``, and writes them
as ``shard-IIIIII-KKKKKK.bin/.idx`` and ``val-shard-IIIIII-KKKKKK.bin/.idx`` (task ``I``, its ``K``-th shard), each
object in one create-only upload (``Store.put_if_absent``: ``If-None-Match: *`` on S3, exclusive create on a file
system). Then it creates ``prepare/task-IIIIII.json``, its commit: the plan's sha256 and every shard with its size,
sha256, tokens and documents. The bytes depend on the plan and ``i`` alone, so:

- an attempt that finds the commit verifies it (same plan, every shard present) and does nothing else;
- an attempt that finds a shard already uploaded (an earlier attempt died before committing, or another attempt is
  running) checks that the object holds its own bytes, and stops with a line naming it if not: nothing that
  differs is ever overwritten;
- of two attempts racing to commit, one creates the commit and the other finds the same bytes there;
- a worker killed mid-upload leaves at most complete shard objects and no commit, and the merge reads only commits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu_train.storage import ObjectNotFoundError, StorageError, Store, open_store
from trainer.data.cache import sha256_file
from trainer.data.errors import DataError, ManifestError
from trainer.data.inputs import Task, read_documents
from trainer.data.manifest import (
    MANIFEST_NAME,
    FileRef,
    Manifest,
    ShardInfo,
    TokenizerInfo,
    parse_shards,
    shard_doc,
)
from trainer.data.pack import Packer, Shard
from trainer.data.plan import PLAN_KEY, InputRef, Plan, commit_key
from trainer.data.remote import check_etag, is_remote, read_remote_documents
from trainer.data.tokenizer import TOKENIZER_FILE, BpeTokenizer, ByteTokenizer, Tokenizer

COMMIT_FORMAT = "gpu-train-prepare-commit"
NAMES = {"train": "shard", "val": "val-shard"}
_VAL_SALT = b"gpu-train:val:"


def is_val(doc: bytes, fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a keyed hash of its bytes below ``fraction``."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(_VAL_SALT + doc).digest()[:8], "big")
    return h < fraction * 2.0**64


@dataclass(frozen=True)
class Commit:
    """What one task produced: its shards per split and its notes (one line each, e.g. an undecodable file)."""

    plan: str
    task: int
    train: tuple[ShardInfo, ...]
    val: tuple[ShardInfo, ...]
    notes: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in (*self.train, *self.val))

    def to_json(self) -> bytes:
        doc = {"format": COMMIT_FORMAT, "version": 1, "plan": self.plan, "task": self.task,
               "train": [shard_doc(s) for s in self.train],
               "val": [shard_doc(s) for s in self.val], "notes": list(self.notes)}  # fmt: skip
        return (json.dumps(doc, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, uri: str, dtype: str) -> Commit:
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{uri}: task commit is not valid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != COMMIT_FORMAT:
            raise ManifestError(f"{uri}: not a {COMMIT_FORMAT} document")
        names: set[str] = set()
        try:
            return cls(str(doc["plan"]), int(doc["task"]), parse_shards(doc["train"], uri, "train", dtype, names),
                       parse_shards(doc["val"], uri, "val", dtype, names), tuple(str(n) for n in doc.get("notes", ())))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{uri}: task commit lacks or mistypes {exc}") from exc


def load_task_tokenizer(plan: Plan, store: Store) -> Tokenizer:
    """The plan's tokenizer: the byte tokenizer, or ``tokenizer.json`` from the store, checked against the plan."""
    info = plan.tokenizer or {}
    if info.get("kind") == "byte":
        return ByteTokenizer()
    raw = store.get_bytes(TOKENIZER_FILE)
    if hashlib.sha256(raw).hexdigest() != info.get("sha256"):
        raise DataError(f"{store.url_of(TOKENIZER_FILE)}: sha256 differs from the plan's {info.get('sha256')}")
    return BpeTokenizer.from_json(raw.decode(), info.get("name") or "trained")


def _undecodable(doc: bytes, path: str, offset: int, kind: str) -> str | None:
    try:
        doc.decode("utf-8")
    except UnicodeDecodeError as exc:
        kept = "kept as raw bytes" if kind == "byte" else "each bad byte read as U+FFFD"
        return f"{path}: not valid UTF-8 at byte {offset + exc.start} ({exc.reason}): {kept}"
    return None


def _read_commit(plan: Plan, store: Store, index: int) -> Commit | None:
    key = commit_key(index)
    try:
        raw = store.get_bytes(key)
    except ObjectNotFoundError:
        return None
    return Commit.parse(raw, store.url_of(key), plan.settings["dtype"])


def verify_commit(commit: Commit, plan: Plan, store: Store, present: set[str] | None = None) -> None:
    """A commit belongs to this plan and task and its shards are in the store (``present``: keys listed already)."""
    url = store.url_of(commit_key(commit.task))
    if commit.plan != plan.sha256:
        raise DataError(f"{url}: committed by another plan (sha256 {commit.plan[:12]}, this one {plan.sha256[:12]})")
    for s in (*commit.train, *commit.val):
        for ref in (s.data, s.index):
            if (ref.file not in present) if present is not None else not store.exists(ref.file):
                raise DataError(f"{url}: lists {ref.file}, which is missing at {store.url_of(ref.file)}")


def _put_once(store: Store, path: Path, key: str, sha: str) -> None:
    """Create ``key`` from ``path``; if it exists already it must hold the same bytes (else: a line naming it)."""
    if store.put_if_absent(key, path):
        return
    with tempfile.TemporaryDirectory(prefix="gpu-train-check-") as tmp:
        store.download(key, Path(tmp) / "x")
        theirs = sha256_file(Path(tmp) / "x")
    if theirs != sha:
        raise DataError(f"{store.url_of(key)} already holds other bytes (sha256 {theirs[:12]}, this task makes "
                        f"{sha[:12]}): left as it is; prepare again with --force to start over")


def _stage(store: Store, staging: Path, split: str, index: int, k: int, shard: Shard, dtype: str) -> ShardInfo:
    tokens, starts = shard
    base = staging / f"{NAMES[split]}-{index:06d}-{k:06d}"
    data, idx = base.with_suffix(".bin"), base.with_suffix(".idx")
    tokens.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tofile(data)
    np.asarray(starts, dtype="<u8").tofile(idx)
    info = ShardInfo(data=FileRef(data.name, data.stat().st_size, sha256_file(data)), tokens=int(tokens.size),
                     documents=int(len(starts)), index=FileRef(idx.name, idx.stat().st_size, sha256_file(idx)))
    for path, ref in ((data, info.data), (idx, info.index)):
        _put_once(store, path, ref.file, ref.sha256)
        path.unlink()
    return info


def unit_documents(unit: Task, text_field: str, endpoint_url: str | None = None) -> list[bytes]:
    """The documents of one unit, from a local file or an object (s3://, gs://, read with ``endpoint_url``)."""
    if is_remote(unit.path):
        return read_remote_documents(unit, text_field, endpoint_url)
    return read_documents(unit, text_field)


def _check_input(ref: InputRef, endpoint_url: str | None) -> None:
    """The input is still the one planned: an object's ETag, a local file's size (hashing it again would double the
    reading); else a DataError naming it."""
    if is_remote(ref.path):
        check_etag(ref.path, ref.content, endpoint_url)
    elif os.path.getsize(ref.path) != ref.size:
        raise DataError(f"{ref.path} changed after the plan was made (size {ref.size} then, "
                        f"{os.path.getsize(ref.path)} now): prepare again with --force to start over")


def run_task(plan: Plan, index: int, store: Store, tok: Tokenizer, endpoint_url: str | None = None) -> Commit:
    """Task ``index`` of ``plan``, start to commit (see the module docstring); returns its commit. ``endpoint_url``
    is the S3 endpoint of inputs in object storage."""
    found = _read_commit(plan, store, index)
    if found is not None:
        verify_commit(found, plan, store)
        return found
    st = plan.settings
    dtype, fraction = st["dtype"], st["val_fraction"]
    packers = {s: Packer(eot_id=tok.eot_id, shard_tokens=st["shard_tokens"], dtype=dtype) for s in NAMES}
    shards: dict[str, list[ShardInfo]] = {s: [] for s in NAMES}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-train-task-") as tmp:

        def emit(split: str, done: list[Shard]) -> None:
            for shard in done:
                shards[split].append(_stage(store, Path(tmp), split, index, len(shards[split]), shard, dtype))

        refs = {r.path: r for r in plan.inputs}
        checked: set[str] = set()
        for unit in plan.units_of(index):
            if unit.path not in checked:
                _check_input(refs[unit.path], endpoint_url)
                checked.add(unit.path)
            docs = unit_documents(unit, st["text_field"], endpoint_url)
            if unit.fmt == "text" and docs and (note := _undecodable(docs[0], unit.path, unit.start, tok.kind)):
                notes.append(note)
            if tok.kind == "byte":
                encoded = [np.frombuffer(d, dtype=np.uint8) for d in docs]
            else:
                encoded = [ids.astype(dtype, copy=False) for ids in tok.encode_batch(docs)]
            for doc, ids in zip(docs, encoded, strict=True):
                split = "val" if is_val(doc, fraction) else "train"
                emit(split, packers[split].add(ids))
        for split, packer in packers.items():
            emit(split, packer.finish())
    commit = Commit(plan.sha256, index, tuple(shards["train"]), tuple(shards["val"]), tuple(notes))
    body = commit.to_json()
    key = commit_key(index)
    if not store.put_if_absent(key, body) and store.get_bytes(key) != body:
        raise DataError(f"{store.url_of(key)}: another attempt committed other bytes for task {index}")
    return commit


# -- what a runner ships to its workers ----------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _context(plan_json: bytes, endpoint_url: str | None, out_uri: str) -> tuple[Plan, Store, Tokenizer]:
    """Per worker process, once per plan: the parsed plan, the store and the tokenizer."""
    store = open_store(out_uri, endpoint_url=endpoint_url)
    plan = Plan.parse(plan_json, store.url_of(PLAN_KEY))
    return plan, store, load_task_tokenizer(plan, store)


def attempt(plan_json: bytes, index: int, out_uri: str, endpoint_url: str | None = None) -> dict[str, Any]:
    """Run one task and report it as plain data, so that any runner can ship it (pickled to a process, a Ray task, a
    Spark partition): ``{"index", "ok", "commit" (bytes) | "error" (one line), "retryable"}``. A bad input (a
    DataError other than a transient storage error) is not worth another attempt; anything else is."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task: the runner decides how many run at once
    try:
        plan, store, tok = _context(plan_json, endpoint_url, out_uri)
        commit = run_task(plan, index, store, tok, endpoint_url)
    except DataError as exc:
        transient = isinstance(exc, StorageError) and exc.transient
        return {"index": index, "ok": False, "error": str(exc), "retryable": transient}
    except Exception as exc:  # noqa: BLE001 (reported to the driver, which retries and then names it)
        return {"index": index, "ok": False, "error": f"{type(exc).__name__}: {exc}", "retryable": True}
    return {"index": index, "ok": True, "commit": commit.to_json(), "retryable": False}


def merge(plan: Plan, store: Store, tokenizer: TokenizerInfo, source: dict[str, Any]) -> Manifest:
    """Read every task's commit, check it against the plan and the store's listing, and write ``manifest.json``
    listing their shards in task order (the only shards a reader trusts)."""
    present = set(store.list("shard-")) | set(store.list("val-shard-"))
    train: list[ShardInfo] = []
    val: list[ShardInfo] = []
    for i in range(plan.tasks):
        commit = _read_commit(plan, store, i)
        if commit is None:
            raise DataError(f"{store.url_of(commit_key(i))}: task {i} has no commit: run prepare again to finish it")
        verify_commit(commit, plan, store, present)
        train += commit.train
        val += commit.val
    if not train:
        raise DataError("no tokens to write: the inputs are empty (or every document went to the val split)")
    manifest = Manifest(tokenizer=tokenizer, dtype=plan.settings["dtype"], shards=tuple(train), val_shards=tuple(val),
                        val_fraction=plan.settings["val_fraction"], source=source)  # fmt: skip
    store.put_bytes(MANIFEST_NAME, manifest.to_json())
    return manifest
