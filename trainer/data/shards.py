"""Open a sharded dataset from its manifest URI: manifest -> shard cache -> memory-mapped shards.

Use (normally through ``trainer.data.open_dataset``)::

    from trainer.data.shards import open_sharded
    ds = open_sharded("s3://bucket/ds", context=1024, cache_dir="/nvme/cache", prefetch_shards=4)

``uri`` is the manifest (``.../manifest.json``) or the folder holding it. The manifest itself is read on
every open (it is small, and it is what says which shard bytes are valid); shards come from the cache.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from trainer.data.cache import CacheRef, ShardCache
from trainer.data.dataset import Dataset
from trainer.data.errors import DataError, ManifestError
from trainer.data.manifest import MANIFEST_NAME, Manifest
from trainer.data.storage import (
    ObjectNotFoundError,
    RetryPolicy,
    Store,
    StoreOptions,
    open_store,
    retry_transient,
)

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "gpu-train-shard-cache"


def split_manifest_uri(uri: str) -> tuple[str, str]:
    """("store root URI", "manifest key") for a manifest URI or its folder."""
    stripped = uri.rstrip("/")
    if stripped.endswith(".json"):
        root, _, name = stripped.rpartition("/")
        return root, name
    return stripped, MANIFEST_NAME


def read_manifest(store: Store, key: str, retry: RetryPolicy | None = None) -> tuple[Manifest, str]:
    """(parsed manifest, sha256 of its bytes); a missing manifest is a ManifestError naming the URI."""
    url = store.url_of(key)
    try:
        raw = retry_transient(lambda: store.get_bytes(key), retry or RetryPolicy())
    except ObjectNotFoundError as exc:
        raise ManifestError(f"{url}: dataset manifest not found") from exc
    return Manifest.parse(raw, uri=url), hashlib.sha256(raw).hexdigest()


class CachedShardSource:
    """Shard arrays memory-mapped from the local cache, with background prefetch of upcoming shards."""

    def __init__(
        self, store: Store, manifest: Manifest, cache: ShardCache, prefetch_shards: int, max_open: int = 16
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.cache = cache
        self.shard_tokens = [s.tokens for s in manifest.shards]
        self._max_open = max(max_open, prefetch_shards + 2)
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        # Re-entrant: a future that is already done runs its done-callback (which takes this lock) at once,
        # inside prefetch(), which holds it.
        self._lock = threading.RLock()
        self._inflight: dict[int, Future[Path]] = {}
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, prefetch_shards), thread_name_prefix="shard-prefetch"
        )
        self._closed = False

    def _ref(self, shard: int) -> CacheRef:
        info = self.manifest.shards[shard].data
        return CacheRef(info.file, info.bytes, info.sha256)

    def array(self, shard: int) -> np.ndarray:
        with self._lock:
            arr = self._open.get(shard)
            if arr is not None:
                self._open.move_to_end(shard)
                return arr
        if self._closed:
            raise DataError(f"dataset {self.store.uri} is closed")
        ref = self._ref(shard)
        path = self.cache.acquire(self.store, ref)
        arr = np.memmap(path, dtype=self.manifest.np_dtype, mode="r", shape=(self.shard_tokens[shard],))
        with self._lock:
            if shard in self._open:  # another thread opened it meanwhile: drop our extra pin
                self.cache.release(ref)
                return self._open[shard]
            self._open[shard] = arr
            while len(self._open) > self._max_open:
                old, _ = self._open.popitem(last=False)
                self.cache.release(self._ref(old))
        return arr

    def doc_starts(self, shard: int) -> np.ndarray:
        info = self.manifest.shards[shard].index
        if info.bytes == 0:
            return np.zeros(0, dtype=np.int64)
        ref = CacheRef(info.file, info.bytes, info.sha256)
        path = self.cache.acquire(self.store, ref)
        try:
            starts = np.fromfile(path, dtype="<u8").astype(np.int64)
        finally:
            self.cache.release(ref)
        if starts.size and (
            starts[0] < 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= self.shard_tokens[shard]
        ):
            url = self.store.url_of(info.file)
            raise ManifestError(
                f"{url}: document offsets are not increasing within the shard's {self.shard_tokens[shard]} tokens"
            )
        return starts

    def prefetch(self, shards: Sequence[int]) -> None:
        with self._lock:
            if self._closed:
                return
            for s in shards:
                if s in self._open or s in self._inflight:
                    continue
                fut = self._pool.submit(self.cache.fetch, self.store, self._ref(s))
                self._inflight[s] = fut
                fut.add_done_callback(lambda f, s=s: self._prefetched(s, f))

    def _prefetched(self, shard: int, fut: Future[Path]) -> None:
        with self._lock:
            self._inflight.pop(shard, None)
        if not fut.cancelled() and fut.exception() is not None:
            # The foreground read retries and raises with full context; a failed hint is only logged.
            log.warning("prefetch of shard %s failed: %s", self._ref(shard).key, fut.exception())

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            while self._open:
                shard, _ = self._open.popitem()
                self.cache.release(self._ref(shard))


def open_sharded(
    uri: str,
    *,
    context: int,
    cache_dir: str | None = None,
    cache_max_bytes: int | None = None,
    prefetch_shards: int = 2,
    endpoint_url: str | None = None,
    packing: bool = True,
    store_options: StoreOptions | None = None,
    retry: RetryPolicy | None = None,
) -> Dataset:
    root, key = split_manifest_uri(uri)
    store = open_store(root, endpoint_url=endpoint_url, options=store_options)
    manifest, digest = read_manifest(store, key, retry)
    cache = ShardCache(cache_dir or DEFAULT_CACHE_DIR, cache_max_bytes, retry=retry)
    source = CachedShardSource(store, manifest, cache, prefetch_shards)
    try:
        ds = Dataset(
            source,
            uri=store.url_of(key),
            context=context,
            packing=packing,
            vocab_size=manifest.tokenizer.vocab_size,
            eot_id=manifest.tokenizer.eot_id,
            manifest_sha256=digest,
            prefetch_shards=prefetch_shards,
            manifest=manifest,
            cache=cache,
        )
    except BaseException:
        source.close()
        raise
    return ds
