"""Turn text into a sharded token dataset in object storage (``python -m trainer.data prepare|synth``).

Use::

    python -m trainer.data prepare corpus/ --out s3://bucket/datasets/corpus --workers 8
    python -m trainer.data prepare a.txt b.jsonl --out file:///data/ds --tokenizer bpe --vocab-size 8192
    python -m trainer.data synth --out file:///tmp/synth --tokens 1048576 --seed 0

Every input file is one document, except ``.jsonl`` files, where each line's ``"text"`` field is one.
Files are tokenized in parallel worker processes (``multiprocessing``, ordered results, so the output is
the same for any worker count), packed into shards (``trainer.data.pack``), written to a local staging
folder, hashed, and uploaded; ``manifest.json`` goes up last so a reader never sees a half-written dataset.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from trainer.data.errors import DataError
from trainer.data.manifest import MANIFEST_NAME, FileRef, Manifest, ShardInfo, TokenizerInfo, dtype_for_vocab
from trainer.data.pack import pack_documents
from trainer.data.storage import Store, open_store
from trainer.data.synthetic import synthetic_shards
from trainer.data.tokenizer import TOKENIZER_FILE, BpeTokenizer, ByteTokenizer, Tokenizer, train_bpe

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 shards, large enough for full-speed GETs


def collect_files(inputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Input files, directories expanded recursively (hidden files skipped), in a stable sorted order."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files.extend(
                sorted(
                    f
                    for f in p.rglob("*")
                    if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
                )
            )
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist")
    if not files:
        raise DataError(f"no input files found in {[str(i) for i in inputs]}")
    return files


def read_documents(path: Path) -> list[bytes]:
    """One document per file, or one per line (its "text" field) for .jsonl."""
    raw = path.read_bytes()
    if path.suffix != ".jsonl":
        return [raw]
    docs = []
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{n}: expected a JSON object with a string 'text' field ({exc})") from exc
        if not isinstance(text, str):
            raise DataError(f"{path}:{n}: 'text' must be a string")
        docs.append(text.encode("utf-8"))
    return docs


_worker_tok: Tokenizer | None = None


def _init_worker(kind: str, tok_json: str) -> None:
    global _worker_tok
    _worker_tok = ByteTokenizer() if kind == "byte" else BpeTokenizer.from_json(tok_json)


def _encode_file(path: Path) -> list[np.ndarray]:
    assert _worker_tok is not None, "worker initializer did not run"
    return [_worker_tok.encode(doc) for doc in read_documents(path)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def write_dataset(
    shards: Iterable[tuple[np.ndarray, np.ndarray]],
    store: Store,
    tokenizer: TokenizerInfo,
    dtype: str,
    upload_threads: int = 4,
) -> Manifest:
    """Write (tokens, doc_starts) shards to ``store``; uploads overlap tokenizing; manifest last."""
    if store.exists(MANIFEST_NAME):
        # Readers of the old manifest would otherwise meet new shard bytes under old hashes.
        store.delete(MANIFEST_NAME)
    infos: list[ShardInfo] = []
    with (
        tempfile.TemporaryDirectory(prefix="gpu-train-prepare-") as staging,
        ThreadPoolExecutor(upload_threads) as pool,
    ):
        pending: list[Future[None]] = []

        def upload(path: Path, key: str) -> None:
            store.upload(path, key)
            path.unlink()

        for i, (tokens, starts) in enumerate(shards):
            data = Path(staging) / f"shard-{i:06d}.bin"
            index = Path(staging) / f"shard-{i:06d}.idx"
            tokens.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tofile(data)
            np.asarray(starts, dtype="<u8").tofile(index)
            infos.append(
                ShardInfo(
                    data=FileRef(data.name, data.stat().st_size, _sha256(data)),
                    tokens=int(tokens.size),
                    documents=int(len(starts)),
                    index=FileRef(index.name, index.stat().st_size, _sha256(index)),
                )
            )
            pending += [pool.submit(upload, data, data.name), pool.submit(upload, index, index.name)]
            # Bound the staging folder: wait for older uploads before producing more.
            while len([f for f in pending if not f.done()]) > 2 * upload_threads:
                next(f for f in pending if not f.done()).result()
        for f in pending:
            f.result()
    if not infos:
        raise DataError("no tokens to write: the inputs are empty")
    manifest = Manifest(tokenizer=tokenizer, dtype=dtype, shards=tuple(infos))
    store.put_bytes(MANIFEST_NAME, manifest.to_json())
    return manifest


def prepare(
    inputs: Iterable[str | os.PathLike[str]],
    out_uri: str,
    *,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    endpoint_url: str | None = None,
) -> Manifest:
    files = collect_files(inputs)
    store = open_store(out_uri, endpoint_url=endpoint_url)
    tok_file: FileRef | None = None
    if tokenizer == "byte":
        if vocab_size not in (None, ByteTokenizer.vocab_size):
            raise DataError(f"--vocab-size is fixed at {ByteTokenizer.vocab_size} for the byte tokenizer")
        tok: Tokenizer = ByteTokenizer()
        tok_json = ""
    elif tokenizer == "bpe":
        if vocab_size is None:
            raise DataError("--tokenizer bpe needs --vocab-size")
        texts = (d.decode("utf-8", errors="replace") for f in files for d in read_documents(f))
        bpe = train_bpe(texts, vocab_size)
        tok, tok_json = bpe, bpe.to_json()
        raw = tok_json.encode()
        store.put_bytes(TOKENIZER_FILE, raw)
        tok_file = FileRef(TOKENIZER_FILE, len(raw), hashlib.sha256(raw).hexdigest())
    else:
        raise DataError(f"--tokenizer must be 'byte' or 'bpe' (got {tokenizer!r})")
    dtype = dtype_for_vocab(tok.vocab_size)
    info = TokenizerInfo(tok.kind, tok.vocab_size, tok.eot_id, tok_file)
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(files)))
    # spawn, not fork: the caller may hold threads (boto3 pools, a test server) that fork would copy mid-flight.
    ctx = mp.get_context("spawn")
    with ctx.Pool(n_workers, initializer=_init_worker, initargs=(tok.kind, tok_json)) as pool:
        chunk = max(1, len(files) // (n_workers * 8))
        docs: Iterator[np.ndarray] = (d for ds in pool.imap(_encode_file, files, chunksize=chunk) for d in ds)
        return write_dataset(
            pack_documents(docs, eot_id=tok.eot_id, shard_tokens=shard_tokens, dtype=dtype),
            store,
            info,
            dtype,
        )


def synth(out_uri: str, *, tokens: int = 1 << 20, seed: int = 0, shard_tokens: int = 1 << 18,
          endpoint_url: str | None = None) -> Manifest:  # fmt: skip
    """The synthetic dataset of ``open_dataset("synthetic")``, written as real shards."""
    store = open_store(out_uri, endpoint_url=endpoint_url)
    info = TokenizerInfo(ByteTokenizer.kind, ByteTokenizer.vocab_size, ByteTokenizer.eot_id)
    return write_dataset(
        synthetic_shards(tokens, seed=seed, shard_tokens=shard_tokens), store, info, "uint16"
    )
