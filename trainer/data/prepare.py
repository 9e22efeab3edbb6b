"""Turn text into a sharded token dataset in object storage (``python -m trainer.data prepare|synth``).

Use::

    python -m trainer.data prepare corpus/ --out s3://bucket/datasets/corpus --workers 8
    python -m trainer.data prepare src/ --include '*.py' --exclude 'site-packages/' --out file:///data/py
    python -m trainer.data prepare web.parquet --text-field content --tokenizer gpt2 \\
        --tokenizer-file ~/gpt2 --out gs://bucket/web
    python -m trainer.data synth --out file:///tmp/synth --tokens 1048576 --seed 0

Inputs (found and read by trainer/data/inputs.py): files and directories (walked recursively, hidden files and ``DEFAULT_EXCLUDES`` skipped,
``--include`` / ``--exclude`` gitignore-style patterns matched against the path below the directory,
binary files skipped as git does: a NUL byte in the first 8000 bytes). Formats by suffix: ``.jsonl``
(``.jsonl.gz``): one document per line, its ``--text-field``; ``.parquet``: one document per row of the
``--text-field`` column, read row group by row group; anything else is plain text, one document per file
(a file over 64 MiB is cut at line breaks into documents of at most 64 MiB).

Work is split into tasks (a text file, a 32 MiB slice of a JSONL file, a Parquet row group), read and
tokenized by ``--workers`` threads (see ``_encoded`` for why threads) and consumed in task order, so the
output is byte-identical for any worker count. Each document goes to the training split or, with probability
``--val-fraction`` decided by a hash of its bytes, to the held-out validation split (deterministic, and a
document repeated in the corpus lands in the same split every time). Shards are staged locally, hashed
and uploaded while tokenizing continues; ``manifest.json`` goes up last so a reader never sees a
half-written dataset. The manifest records a fingerprint of the inputs and settings: running the same
``prepare`` again finds it and returns at once (``--force`` redoes it).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_train.storage import StorageError, Store, open_store
from trainer.data.errors import DataError, ManifestError
from trainer.data.inputs import (
    DEFAULT_EXCLUDES,
    InputFile,
    PrepareStats,
    Task,
    collect_files,
    plan_tasks,
    read_documents,
)
from trainer.data.manifest import MANIFEST_NAME, FileRef, Manifest, TokenizerInfo, dtype_for_vocab
from trainer.data.pack import Packer
from trainer.data.synthetic import VAL_STREAM, synthetic_shards
from trainer.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    load_gpt2,
    train_bpe,
)
from trainer.data.writer import DatasetWriter, write_dataset

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 shards, large enough for full-speed GETs
DEFAULT_VAL_FRACTION = 0.01
BPE_TRAIN_BYTES = 1 << 30  # a trained BPE learns from the first GiB of text
TOKENIZERS = ("byte", "bpe", "gpt2")
_VAL_SALT = b"gpu-train:val:"


class Progress:
    """What `prepare` says while it works, on `stream` (stderr by default): phases (the BPE training), one line per
    fallback (a skipped file, an empty split), and its progress through the input: files, tokens, tokens/s and
    the time left at the pace so far. On a terminal the progress line is redrawn in place (at most 5 times a
    second); otherwise a line is printed every `every_s` seconds, and once at the end."""

    def __init__(self, stream: Any = None, *, every_s: float = 10.0, tty: bool | None = None) -> None:
        import sys

        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = 0.2 if self.tty else every_s
        self.total_bytes = self.total_files = 0
        self.bytes = self.files = self.tokens = 0
        self._t0 = self._last = 0.0
        self._drawn = False
        self._shown = -1  # the bytes read at the last line drawn

    def say(self, text: str) -> None:
        """One line of its own (ending an in-place progress line first)."""
        self._end_line()
        print(f"prepare: {text}", file=self.stream, flush=True)

    def warn(self, text: str) -> None:
        self.say(f"warning: {text}")

    def start(self, total_bytes: int, total_files: int) -> None:
        import time

        self.total_bytes, self.total_files = max(total_bytes, 1), total_files
        self._t0 = self._last = time.monotonic()

    def advance(self, nbytes: int, tokens: int, files: int) -> None:
        import time

        self.bytes, self.tokens, self.files = self.bytes + nbytes, self.tokens + tokens, self.files + files
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._draw(now)

    def finish(self) -> None:
        import time

        if self.total_files and self._shown != self.bytes:
            self._draw(time.monotonic())
        self._end_line()

    def line(self, now: float) -> str:
        elapsed = max(now - self._t0, 1e-9)
        done = self.bytes / self.total_bytes
        left = elapsed * (1 - done) / done if done > 0 else None
        eta = "?" if left is None else f"{int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
        return (f"{self.files}/{self.total_files} files, {self.tokens:,} tokens, {self.tokens / elapsed:,.0f} "
                f"tokens/s, {100 * done:.0f}% of {self.total_bytes / 1e6:,.1f} MB read, ETA {eta}")

    def _draw(self, now: float) -> None:
        self._shown = self.bytes
        if self.tty:
            print(f"\rprepare: {self.line(now)}\x1b[K", end="", file=self.stream, flush=True)
            self._drawn = True
        else:
            print(f"prepare: {self.line(now)}", file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._drawn:
            print(file=self.stream, flush=True)
            self._drawn = False


def is_val(doc: bytes, fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a keyed hash of its bytes below ``fraction``."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(_VAL_SALT + doc).digest()[:8], "big")
    return h < fraction * 2.0**64


# -- encoding ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Encoder:
    tok: Tokenizer
    kind: str
    text_field: str
    val_fraction: float
    dtype: str

    def __call__(self, task: Task) -> tuple[list[np.ndarray], list[bool]]:
        docs = read_documents(task, self.text_field)
        flags = [is_val(d, self.val_fraction) for d in docs]
        if self.kind == "byte":  # uint8 here, widened to the shard dtype when packed
            return [np.frombuffer(d, dtype=np.uint8) for d in docs], flags
        return [ids.astype(self.dtype, copy=False) for ids in self.tok.encode_batch(docs)], flags


# -- writing ----------------------------------------------------------------------------------------------
# -- prepare ----------------------------------------------------------------------------------------------
def _fingerprint(files: Sequence[InputFile], settings: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for f in files:
        st = f.path.stat()
        h.update(f"{f.path.absolute()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _up_to_date(store: Store, fingerprint: str) -> Manifest | None:
    """The manifest already at the destination, if it was written from the same inputs and settings."""
    try:
        if not store.exists(MANIFEST_NAME):
            return None
        manifest = Manifest.parse(store.get_bytes(MANIFEST_NAME), uri=store.url_of(MANIFEST_NAME))
    except (ManifestError, StorageError):
        return None
    if (manifest.source or {}).get("fingerprint") != fingerprint:
        return None
    for s in (*manifest.shards, *manifest.val_shards):
        if not store.exists(s.data.file):
            return None
    return manifest


def _bpe_training_texts(tasks: Sequence[Task], text_field: str, limit: int) -> Iterator[str]:
    seen = 0
    for task in tasks:
        for doc in read_documents(task, text_field):
            yield doc.decode("utf-8", errors="replace")
            seen += len(doc)
            if seen >= limit:
                return


def _encoded(
    tasks: Sequence[Task], encode: _Encoder, workers: int
) -> Iterator[tuple[list[np.ndarray], list[bool]]]:
    """Encoded documents task by task, in task order, from ``workers`` threads.

    Threads, not processes: the BPE encoder runs in Rust without the GIL (``tokenizers`` releases it in
    ``encode_batch_fast``), file reads release it too, so threads scale the expensive part without
    starting interpreters, copying the tokenizer or pickling token arrays between processes. Each call
    stays on one thread (TOKENIZERS_PARALLELISM=false) so that ``workers`` is the number of cores used.
    """
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        if workers <= 1:
            for task in tasks:
                yield encode(task)
            return
        pool = ThreadPoolExecutor(workers, thread_name_prefix="prepare")
        try:
            # Ordered results keep the output independent of the worker count; a bounded window of tasks
            # in flight keeps every thread busy without holding the whole corpus in memory.
            ahead = iter(tasks)
            pending = deque(pool.submit(encode, t) for t in itertools.islice(ahead, 4 * workers))
            while pending:
                done = pending.popleft().result()
                for t in itertools.islice(ahead, 1):
                    pending.append(pool.submit(encode, t))
                yield done
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def prepare(
    inputs: Iterable[str | os.PathLike[str]],
    out_uri: str,
    *,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    tokenizer_file: str | os.PathLike[str] | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    endpoint_url: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = DEFAULT_EXCLUDES,
    skip_binary: bool = True,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    force: bool = False,
    stats: PrepareStats | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Tokenize ``inputs`` into a dataset at ``out_uri`` (a URI or a plain path); see the module docstring.
    `progress` is told what happens (python -m trainer.data prepare passes one); without it prepare is silent
    but for its warnings, which go to the `trainer.data` logger."""
    if tokenizer not in TOKENIZERS:
        raise DataError(f"--tokenizer must be one of {', '.join(TOKENIZERS)} (got {tokenizer!r})")
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if shard_tokens < 2:
        raise DataError(f"--shard-tokens must be >= 2 (got {shard_tokens})")
    stats = stats if stats is not None else PrepareStats()
    if tokenizer == "gpt2" and tokenizer_file is None:
        raise DataError("--tokenizer gpt2 needs --tokenizer-file: GPT-2's vocab.json + merges.txt folder")
    files = collect_files(inputs, include, exclude, stats)
    store = open_store(out_uri, endpoint_url=endpoint_url)
    tok_sha = ""
    if tokenizer == "gpt2":
        assert tokenizer_file is not None
        tok: Tokenizer = load_gpt2(tokenizer_file)
        tok_sha = hashlib.sha256(tok.to_json().encode()).hexdigest()  # type: ignore[attr-defined]
    elif tokenizer == "bpe" and vocab_size is None:
        raise DataError("--tokenizer bpe needs --vocab-size")
    elif tokenizer == "byte" and vocab_size not in (None, ByteTokenizer.vocab_size):
        raise DataError(f"--vocab-size is fixed at {ByteTokenizer.vocab_size} for the byte tokenizer")
    settings = {
        "tokenizer": tokenizer, "vocab_size": vocab_size, "tokenizer_sha256": tok_sha,
        "shard_tokens": shard_tokens, "include": list(include), "exclude": list(exclude),
        "skip_binary": skip_binary, "text_field": text_field, "val_fraction": val_fraction,
    }  # fmt: skip
    fingerprint = _fingerprint(files, settings)
    if not force:
        existing = _up_to_date(store, fingerprint)
        if existing is not None:
            stats.files = len(files)
            stats.documents = {"train": existing.num_documents, "val": existing.val_documents}
            stats.reused = True
            return existing
    tasks = plan_tasks(files, skip_binary=skip_binary, stats=stats, say=progress.say if progress is not None else None)
    if not tasks:
        raise DataError(f"no text to tokenize in {[str(i) for i in inputs]}: every file was empty or binary")

    if tokenizer != "gpt2":
        tok = _byte_or_trained(tokenizer, vocab_size, tasks, text_field, progress)
    tok_file = None
    if tokenizer != "byte":
        raw = tok.to_json().encode()  # type: ignore[attr-defined]
        store.put_bytes(TOKENIZER_FILE, raw)
        tok_file = FileRef(TOKENIZER_FILE, len(raw), hashlib.sha256(raw).hexdigest())
    dtype = dtype_for_vocab(tok.vocab_size)
    info = TokenizerInfo(tok.kind, tok.vocab_size, tok.eot_id, tok_file, getattr(tok, "name", ""))
    writer = DatasetWriter(store, dtype)
    try:
        _write_shards(tasks, _Encoder(tok, tok.kind, text_field, val_fraction, dtype), writer,
                      workers=max(1, min(workers or os.cpu_count() or 1, len(tasks))),
                      packers={s: Packer(eot_id=tok.eot_id, shard_tokens=shard_tokens, dtype=dtype)
                               for s in ("train", "val")}, stats=stats, progress=progress)
    except BaseException:
        writer.abort()
        raise
    if val_fraction > 0 and not writer.infos["val"] and writer.infos["train"]:
        text = (f"--val-fraction {val_fraction} held out none of the {stats.documents['train']} documents: the "
                "validation split is empty, and a run with eval.every_steps will refuse this dataset; use a larger "
                "--val-fraction or more documents")
        if progress is not None:
            progress.warn(text)
        else:
            logging.getLogger("trainer.data").warning("%s", text)
    source = {"fingerprint": fingerprint, "files": stats.files, "skipped_binary": stats.skipped_binary}
    return writer.finish(info, val_fraction=val_fraction, source=source)


def _byte_or_trained(kind: str, vocab_size: int | None, tasks: Sequence[Task], text_field: str,
                     progress: Progress | None) -> Tokenizer:
    """The byte tokenizer, or a BPE tokenizer trained on the first BPE_TRAIN_BYTES of the input."""
    if kind == "byte":
        return ByteTokenizer()
    assert vocab_size is not None
    if progress is not None:
        progress.say(f"training a BPE tokenizer of {vocab_size} ids on the first "
                     f"{min(BPE_TRAIN_BYTES, _task_bytes(tasks)) / 1e6:,.1f} MB of the input ...")
    t0 = time.monotonic()
    tok = train_bpe(_bpe_training_texts(tasks, text_field, BPE_TRAIN_BYTES), vocab_size)
    if progress is not None:
        progress.say(f"trained the BPE tokenizer in {time.monotonic() - t0:.1f}s")
    return tok


def _task_bytes(tasks: Sequence[Task]) -> int:
    return sum(_weight(t) for t in tasks)


def _weight(task: Task) -> int:
    """A task's share of the input in bytes (a Parquet row group counts as its file's size over its groups)."""
    return task.end - task.start if task.fmt != "parquet" else _row_group_bytes(task.path)


@functools.lru_cache(maxsize=1024)
def _row_group_bytes(path: str) -> int:
    import pyarrow.parquet as pq

    return os.path.getsize(path) // max(1, pq.ParquetFile(path).metadata.num_row_groups)


def _write_shards(tasks: list[Task], encoder: _Encoder, writer: DatasetWriter, *, workers: int,
                  packers: dict[str, Packer], stats: PrepareStats, progress: Progress | None = None) -> None:
    """Encode the documents (in `workers` threads), pack each split's into shards and hand them to writer."""
    weights = [_weight(t) for t in tasks] if progress is not None else []
    last_of_file = {t.path: i for i, t in enumerate(tasks)}
    if progress is not None:
        progress.start(sum(weights), len(last_of_file))
    for i, (docs, flags) in enumerate(_encoded(tasks, encoder, workers)):
        for doc, val in zip(docs, flags, strict=True):
            split = "val" if val else "train"
            stats.documents[split] += 1
            for shard in packers[split].add(doc):
                writer.add(split, shard)
        if progress is not None:
            progress.advance(weights[i], sum(len(d) + 1 for d in docs), int(last_of_file[tasks[i].path] == i))
    for split, packer in packers.items():
        for shard in packer.finish():
            writer.add(split, shard)
    if progress is not None:
        progress.finish()


def synth(out_uri: str, *, tokens: int = 1 << 20, seed: int = 0, shard_tokens: int = 1 << 18,
          val_tokens: int = 1 << 16, endpoint_url: str | None = None) -> Manifest:  # fmt: skip
    """The synthetic dataset of ``open_dataset("synthetic")`` (both splits), written as real shards."""
    store = open_store(out_uri, endpoint_url=endpoint_url)
    info = TokenizerInfo(ByteTokenizer.kind, ByteTokenizer.vocab_size, ByteTokenizer.eot_id)
    val = (
        synthetic_shards(val_tokens, seed=seed, shard_tokens=shard_tokens, stream=VAL_STREAM)
        if val_tokens
        else []
    )
    return write_dataset(
        synthetic_shards(tokens, seed=seed, shard_tokens=shard_tokens), store, info, "uint16", val_shards=val
    )
