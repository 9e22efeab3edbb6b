"""Writing a token dataset: shards of both splits staged locally, hashed, uploaded in the background while more are
produced, and `manifest.json` written last, so a reader never sees a half-written dataset (trainer/data/prepare.py
and `synth` write through it).

Usage:
    writer = DatasetWriter(store, "uint16")
    writer.add("train", (tokens, doc_starts)); writer.add("val", ...)
    manifest = writer.finish(tokenizer_info, val_fraction=0.01, source={...})   # or writer.abort()
    manifest = write_dataset(shards, store, tokenizer_info, "uint16", val_shards=...)   # all at once
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gpu_train.storage import Store
from trainer.data.cache import sha256_file
from trainer.data.errors import DataError
from trainer.data.manifest import MANIFEST_NAME, FileRef, Manifest, ShardInfo, TokenizerInfo
from trainer.data.pack import Shard


class DatasetWriter:
    """Stage shards of both splits locally, upload them in the background, write the manifest last."""

    NAMES = {"train": "shard", "val": "val-shard"}

    def __init__(self, store: Store, dtype: str, upload_threads: int = 4) -> None:
        self.store = store
        self.dtype = dtype
        self.infos: dict[str, list[ShardInfo]] = {"train": [], "val": []}
        self._staging = tempfile.TemporaryDirectory(prefix="gpu-train-prepare-")
        self._pool = ThreadPoolExecutor(upload_threads)
        self._threads = upload_threads
        self._pending: list[Future[None]] = []
        if store.exists(MANIFEST_NAME):
            # Readers of the old manifest would otherwise meet new shard bytes under old hashes.
            store.delete(MANIFEST_NAME)

    def _upload(self, path: Path, key: str) -> None:
        self.store.upload(path, key)
        path.unlink()

    def add(self, split: str, shard: Shard) -> None:
        tokens, starts = shard
        i = len(self.infos[split])
        base = Path(self._staging.name) / f"{self.NAMES[split]}-{i:06d}"
        data, index = base.with_suffix(".bin"), base.with_suffix(".idx")
        tokens.astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tofile(data)
        np.asarray(starts, dtype="<u8").tofile(index)
        self.infos[split].append(
            ShardInfo(
                data=FileRef(data.name, data.stat().st_size, sha256_file(data)),
                tokens=int(tokens.size),
                documents=int(len(starts)),
                index=FileRef(index.name, index.stat().st_size, sha256_file(index)),
            )
        )
        self._pending += [self._pool.submit(self._upload, p, p.name) for p in (data, index)]
        # Bound the staging folder: wait for older uploads before producing more.
        while len([f for f in self._pending if not f.done()]) > 2 * self._threads:
            next(f for f in self._pending if not f.done()).result()
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]

    def finish(
        self, tokenizer: TokenizerInfo, *, val_fraction: float = 0.0, source: dict[str, Any] | None = None
    ) -> Manifest:
        try:
            for f in self._pending:
                f.result()
        finally:
            self._pool.shutdown(wait=True)
            self._staging.cleanup()
        if not self.infos["train"]:
            raise DataError(
                "no tokens to write: the inputs are empty (or every document went to the val split)"
            )
        manifest = Manifest(
            tokenizer=tokenizer,
            dtype=self.dtype,
            shards=tuple(self.infos["train"]),
            val_shards=tuple(self.infos["val"]),
            val_fraction=val_fraction,
            source=source,
        )
        self.store.put_bytes(MANIFEST_NAME, manifest.to_json())
        return manifest

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._staging.cleanup()


def write_dataset(
    shards: Iterable[Shard], store: Store, tokenizer: TokenizerInfo, dtype: str, *,
    val_shards: Iterable[Shard] = (), val_fraction: float = 0.0,
) -> Manifest:  # fmt: skip
    """Write ready (tokens, doc_starts) shards to ``store``; uploads overlap producing; manifest last."""
    writer = DatasetWriter(store, dtype)
    try:
        for shard in shards:
            writer.add("train", shard)
        for shard in val_shards:
            writer.add("val", shard)
    except BaseException:
        writer.abort()
        raise
    return writer.finish(tokenizer, val_fraction=val_fraction)
