"""Open a sharded dataset from its manifest URI: manifest -> verified shard bytes -> memory-mapped windows.

Use (normally through ``trainer.data.open_dataset``)::

    from trainer.data.shards import open_sharded
    ds = open_sharded("s3://bucket/ds", context=1024, cache_dir="/nvme/cache", prefetch_shards=4)
    val = open_sharded("s3://bucket/ds", context=1024, split="val")

``uri`` is the manifest (``.../manifest.json``) or the folder holding it. The manifest itself is read on
every open (it is small, and it is what says which shard bytes are valid). Where the shard bytes come
from is the read mode:

- ``direct`` (``file://`` datasets): shards are memory-mapped where they are, never copied; each is
  proven against the manifest before its first use (a seal in ``cache_dir`` lets the next run skip the
  hash while the file is unchanged).
- ``disk``: shards are downloaded once per node into the verified ``ShardCache`` in ``cache_dir`` (local
  NVMe), with a budget derived from that disk unless given.
- ``memory``: the same cache kept in RAM (``/dev/shm``), sized for the working set only. Used when
  reading through the node's Alluxio cache proxy, which already keeps the bytes on NVMe: a second NVMe
  copy would only cost disk.
- ``auto`` (default): ``direct`` for ``file://``, ``memory`` behind an Alluxio proxy endpoint, else ``disk``.

Over 400 lines because the three read modes share one verification and windowing path, which is what keeps their
batches identical.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gpu_train.spec.values import as_uri
from gpu_train.storage import (
    FileStore,
    ObjectNotFoundError,
    RetryPolicy,
    Store,
    StoreOptions,
    is_cache_proxy,
    open_store,
    retry_transient,
)
from trainer.data.cache import VERIFY_MODES, CacheRef, SealBook, ShardCache, disk_budget, sha256_file
from trainer.data.dataset import Dataset
from trainer.data.errors import DataError, ManifestError, ShardIntegrityError, ShardMissingError
from trainer.data.manifest import DTYPES, MANIFEST_NAME, SPLITS, Manifest, ShardInfo

log = logging.getLogger(__name__)

READ_MODES = ("auto", "direct", "disk", "memory")
CACHE_DIR_ENV = "TRAINER_CACHE_DIR"
MEMORY_DIR_ENV = "TRAINER_MEMORY_DIR"
DEFAULT_MEMORY_FRACTION = 0.25  # of /dev/shm, which NCCL and torch also use


def default_cache_dir() -> Path:
    """One cache per user shared by every run: env TRAINER_CACHE_DIR, else $XDG_CACHE_HOME/gpu-train/shards."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpu-train" / "shards"


def default_memory_dir() -> Path | None:
    """A RAM-backed directory for the memory read mode: env TRAINER_MEMORY_DIR, else /dev/shm if it exists."""
    if os.environ.get(MEMORY_DIR_ENV):
        return Path(os.environ[MEMORY_DIR_ENV])
    shm = Path("/dev/shm")
    return shm / "gpu-train-shards" if shm.is_dir() and os.access(shm, os.W_OK) else None


def split_manifest_uri(uri: str) -> tuple[str, str]:
    """("store root URI", "manifest key") for a manifest URI or its folder (or a plain path to either)."""
    stripped = as_uri(uri).rstrip("/")
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


def resolve_read_mode(mode: str, store: Store, endpoint: str | None) -> str:
    """The read mode ``auto`` stands for, given where the dataset is (see the module docstring)."""
    if mode not in READ_MODES:
        raise DataError(f"data read mode must be one of {', '.join(READ_MODES)} (got {mode!r})")
    if mode == "direct" and not isinstance(store, FileStore):
        raise DataError(f"read mode 'direct' needs a file:// dataset (got {store.uri})")
    if mode != "auto":
        return mode
    if isinstance(store, FileStore):
        return "direct"
    return "memory" if is_cache_proxy(endpoint) else "disk"


def _check_doc_starts(starts: np.ndarray, n_tokens: int, url: str) -> np.ndarray:
    if starts.size and (starts[0] < 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n_tokens):
        raise ManifestError(
            f"{url}: document offsets are not increasing within the shard's {n_tokens} tokens"
        )
    return starts


class CachedShardSource:
    """Shard arrays memory-mapped from a ShardCache, with background fetches of upcoming shards."""

    def __init__(
        self,
        store: Store,
        shards: Sequence[ShardInfo],
        dtype: np.dtype,
        cache: ShardCache,
        prefetch_shards: int,
        max_open: int = 16,
    ) -> None:
        self.store = store
        self.shards = list(shards)
        self.dtype = dtype
        self.cache = cache
        self.shard_tokens = [s.tokens for s in self.shards]
        self._max_open = max(1, max_open)
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        # Re-entrant: a future that is already done runs its done-callback (which takes this lock) at once,
        # inside prefetch(), which holds it.
        self._lock = threading.RLock()
        self._inflight: dict[int, Future[Path]] = {}
        # Shards fetch_ahead downloaded and pinned: they stay in the cache until the caller's horizon has
        # moved past them, so that a download for a later block never evicts one about to be read.
        self._ahead: set[int] = set()
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, prefetch_shards), thread_name_prefix="shard-prefetch"
        )
        self._closed = False

    def _ref(self, shard: int) -> CacheRef:
        info = self.shards[shard].data
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
        arr = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.shard_tokens[shard],))
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
        info = self.shards[shard].index
        if info.bytes == 0:
            return np.zeros(0, dtype=np.int64)
        ref = CacheRef(info.file, info.bytes, info.sha256)
        path = self.cache.acquire(self.store, ref)
        try:
            starts = np.fromfile(path, dtype="<u8").astype(np.int64)
        finally:
            self.cache.release(ref)
        return _check_doc_starts(starts, self.shard_tokens[shard], self.store.url_of(info.file))

    def prefetch(self, shards: Sequence[int]) -> None:
        with self._lock:
            if self._closed:
                return
            for s in shards:
                if s in self._open or s in self._inflight:
                    continue
                self._submit(s)

    def fetch_ahead(self, shards: Sequence[int]) -> None:
        with self._lock:
            if self._closed:
                return
            wanted = set(shards)
            for s in sorted(self._ahead - wanted):  # the horizon moved past it: it may be evicted now
                self._ahead.discard(s)
                self.cache.release(self._ref(s))
            if wanted:
                # The next steps read only the horizon: unmap the rest now rather than when 16 are open.
                for s in [s for s in self._open if s not in wanted]:
                    del self._open[s]
                    self.cache.release(self._ref(s))
            for s in shards:
                if s in self._inflight or s in self._ahead:
                    continue
                self._submit(s, pin=True)

    def _submit(self, shard: int, pin: bool = False) -> None:
        fetch = self.cache.acquire if pin else self.cache.fetch
        fut = self._pool.submit(fetch, self.store, self._ref(shard))
        self._inflight[shard] = fut
        fut.add_done_callback(lambda f, s=shard, p=pin: self._prefetched(s, f, p))

    def _prefetched(self, shard: int, fut: Future[Path], pinned: bool) -> None:
        ok = not fut.cancelled() and fut.exception() is None
        with self._lock:
            self._inflight.pop(shard, None)
            if ok and pinned:
                if self._closed or shard in self._ahead:
                    self.cache.release(self._ref(shard))
                else:
                    self._ahead.add(shard)
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
            while self._ahead:
                self.cache.release(self._ref(self._ahead.pop()))


class DirectShardSource:
    """Shards of a file:// dataset memory-mapped in place, each proven against the manifest first."""

    def __init__(
        self, store: FileStore, shards: Sequence[ShardInfo], dtype: np.dtype, seals: SealBook, verify: str
    ) -> None:
        self.store = store
        self.shards = list(shards)
        self.dtype = dtype
        self.seals = seals
        self.verify = verify
        self.shard_tokens = [s.tokens for s in self.shards]
        self._open: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.hashes = 0  # shards hashed by this source (the rest were proven by their seal)

    def prove(self, key: str, size: int, sha: str) -> Path:
        """The file's path once its size and sha256 match (by seal, or hashed); else a ShardError naming it."""
        path = self.store.root / key
        url = self.store.url_of(key)
        try:
            st = path.stat()
        except FileNotFoundError as exc:
            raise ShardMissingError(f"shard {key} is missing at {url}", shard=key, uri=url) from exc
        if st.st_size != size:
            raise ShardIntegrityError.mismatch(key, url, f"size {st.st_size} bytes", size)
        if self.verify == "seal" and self.seals.matches(path, sha, st):
            return path
        digest = sha256_file(path)
        self.hashes += 1
        if digest != sha:
            raise ShardIntegrityError.mismatch(key, url, f"sha256 {digest}", sha)
        if SealBook.identity(path.stat()) == SealBook.identity(st):
            self.seals.record(path, sha, st)
        return path

    def array(self, shard: int) -> np.ndarray:
        with self._lock:
            arr = self._open.get(shard)
            if arr is None:
                info = self.shards[shard].data
                path = self.prove(info.file, info.bytes, info.sha256)
                arr = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.shard_tokens[shard],))
                self._open[shard] = arr
        return arr

    def doc_starts(self, shard: int) -> np.ndarray:
        info = self.shards[shard].index
        if info.bytes == 0:
            return np.zeros(0, dtype=np.int64)
        path = self.prove(info.file, info.bytes, info.sha256)
        starts = np.fromfile(path, dtype="<u8").astype(np.int64)
        return _check_doc_starts(starts, self.shard_tokens[shard], self.store.url_of(info.file))

    def prefetch(self, shards: Sequence[int]) -> None:
        """Nothing to download: the shards are local files (the OS page cache does the read-ahead)."""

    def fetch_ahead(self, shards: Sequence[int]) -> None:
        """Nothing to download: the shards are local files (the OS page cache does the read-ahead)."""

    def close(self) -> None:
        with self._lock:
            self._open.clear()


def _shard_cache(where: Path, budget: int, shards: Sequence[ShardInfo], retry: RetryPolicy | None,
                 verify: str) -> ShardCache:
    """The shard cache at `where` with this byte budget; a budget under two of the largest shards is warned."""
    largest = max(s.data.bytes for s in shards)
    if budget < 2 * largest:
        log.warning(
            "shard cache %s: budget %.1f MB holds fewer than 2 shards of %.1f MB: expect re-downloads",
            where, budget / 1e6, largest / 1e6,
        )  # fmt: skip
    return ShardCache(where, budget, retry=retry, verify=verify)  # type: ignore[arg-type]


def open_sharded(
    uri: str,
    *,
    context: int,
    cache_dir: str | None = None,
    cache_max_bytes: int | None = None,
    prefetch_shards: int = 2,
    endpoint_url: str | None = None,
    packing: bool = True,
    split: str = "train",
    read_mode: str = "auto",
    verify: str = "seal",
    cache_disk_fraction: float = 0.5,
    memory_dir: str | None = None,
    max_open_shards: int = 16,
    store_options: StoreOptions | None = None,
    retry: RetryPolicy | None = None,
) -> Dataset:
    if split not in SPLITS:
        raise DataError(f"dataset split must be one of {', '.join(SPLITS)} (got {split!r})")
    if verify not in VERIFY_MODES:
        raise DataError(f"data verify mode must be one of {', '.join(VERIFY_MODES)} (got {verify!r})")
    if cache_max_bytes is not None and cache_max_bytes < 0:
        raise DataError(
            f"data cache_max_bytes must be >= 0 (got {cache_max_bytes}); 0 derives it from the disk"
        )
    if prefetch_shards < 0:
        raise DataError(f"data prefetch_shards must be >= 0 (got {prefetch_shards})")
    root, key = split_manifest_uri(uri)
    store = open_store(root, endpoint_url=endpoint_url, options=store_options)
    manifest, digest = read_manifest(store, key, retry)
    shards = manifest.split(split)
    if not shards and split == "val" and manifest.val_fraction > 0:
        raise ManifestError(
            f"{store.url_of(key)}: the dataset's validation split is empty: --val-fraction {manifest.val_fraction} "
            f"held out none of its {manifest.num_documents} documents; prepare it again with a larger --val-fraction "
            "or more documents"
        )
    if not shards:
        raise ManifestError(
            f"{store.url_of(key)}: the dataset has no {split} split (prepare it with --val-fraction > 0)"
        )
    endpoint = getattr(store, "endpoint", None)
    mode = resolve_read_mode(read_mode, store, endpoint)
    cache: ShardCache | None = None
    if mode == "direct":
        assert isinstance(store, FileStore)
        seals = SealBook(Path(cache_dir or default_cache_dir()) / "seals")
        source: CachedShardSource | DirectShardSource = DirectShardSource(
            store, shards, DTYPES[manifest.dtype], seals, verify
        )
    else:
        if mode == "memory" and not (memory_dir or default_memory_dir()):
            log.info("no /dev/shm here: reading %s through the disk cache instead of memory", uri)
            mode = "disk"
        if mode == "memory":
            where, fraction = Path(memory_dir) if memory_dir else default_memory_dir(), DEFAULT_MEMORY_FRACTION
        else:
            where, fraction = Path(cache_dir or default_cache_dir()), cache_disk_fraction
        cache = _shard_cache(where, cache_max_bytes or disk_budget(where, fraction), shards, retry, verify)
        source = CachedShardSource(
            store, shards, DTYPES[manifest.dtype], cache, prefetch_shards, max_open=max_open_shards
        )
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
            split=split,
            read_mode=mode,
        )
    except BaseException:
        source.close()
        raise
    return ds
