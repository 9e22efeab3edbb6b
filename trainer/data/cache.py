"""Local (NVMe) shard cache shared by every worker process on a node.

Use::

    cache = ShardCache("/nvme/shards", max_bytes=500 << 30)
    path = cache.acquire(store, CacheRef("shard-000003.bin", size, sha256))   # pinned: never evicted
    ...                                                                       # np.memmap(path, ...)
    cache.release(ref)
    cache.fetch(store, ref)        # download only (prefetch), no pin

Guarantees, all of which hold across processes because they rest on the file system, not on memory:

- Content-addressed: ``objects/<sha256>``. A file appears there only by ``os.replace`` of a temp file
  whose size and sha256 matched the manifest, after fsync; a crash mid-download leaves at most a
  ``tmp/*.part`` file, which is never read and is deleted once its writer's pid is gone.
- One download per shard: a per-shard ``filelock`` (``locks/<sha256>.lock``) is held while checking and
  downloading, so a second process (or thread) waits and then finds the file.
- Size budget with LRU eviction: under the index lock (``locks/index.lock``), least recently used objects
  (by mtime, refreshed on every use) are deleted until the new shard fits. A shard pinned by a live
  process (``pins/<sha256>.<pid>``) or whose shard lock is held is never evicted. If only pinned shards
  remain, the cache goes over budget rather than failing the job, and says so in the log.
- Bad data: a size or sha256 mismatch raises ShardIntegrityError naming the shard and URI, and the bad
  bytes are deleted. Transient storage errors are retried (botocore first, then ``RetryPolicy`` around the
  whole shard with jittered backoff).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from trainer.data.errors import ShardError, ShardIntegrityError, ShardMissingError
from trainer.data.storage import ObjectNotFoundError, RetryPolicy, StorageError, Store, retry_transient

log = logging.getLogger(__name__)

_STALE_UNKNOWN_TMP_S = 3600.0
_TMP_NAME = re.compile(r"^\.?[0-9a-f]{64}\.(\d+)\.")


@dataclass(frozen=True)
class CacheRef:
    """An object to cache: its key in the store, expected size in bytes and sha256 hex digest."""

    key: str
    size: int
    sha256: str


@dataclass
class CacheStats:
    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    retries: int = 0
    evictions: int = 0
    integrity_failures: int = 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ShardCache:
    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        max_bytes: int | None = None,
        *,
        retry: RetryPolicy | None = None,
        lock_timeout_s: float = 3600.0,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0 (got {max_bytes}); 0 or None means no budget")
        self.root = Path(cache_dir)
        self.max_bytes = max_bytes or None
        self.retry = retry or RetryPolicy()
        self.lock_timeout_s = lock_timeout_s
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"
        self.pins = self.root / "pins"
        for d in (self.objects, self.tmp, self.locks, self.pins):
            d.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._pin_counts: dict[str, int] = {}
        self._pin_lock = threading.Lock()
        self.clean_stale()

    # -- paths / locks -------------------------------------------------------------------------------
    def path_of(self, ref: CacheRef) -> Path:
        return self.objects / ref.sha256

    def _shard_lock(self, sha: str, timeout: float | None = None) -> FileLock:
        return FileLock(
            self.locks / f"{sha}.lock", timeout=self.lock_timeout_s if timeout is None else timeout
        )

    def _index_lock(self) -> FileLock:
        return FileLock(self.locks / "index.lock", timeout=self.lock_timeout_s)

    def _count(self, **inc: int) -> None:
        with self._stats_lock:
            for name, n in inc.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- public API ----------------------------------------------------------------------------------
    def fetch(self, store: Store, ref: CacheRef) -> Path:
        """Make sure ``ref`` is cached (downloading and verifying it if needed); no pin."""
        return self._ensure(store, ref, pin=False)

    def acquire(self, store: Store, ref: CacheRef) -> Path:
        """Like fetch, and pin the shard so no process evicts it until ``release``."""
        return self._ensure(store, ref, pin=True)

    def release(self, ref: CacheRef) -> None:
        with self._pin_lock:
            n = self._pin_counts.get(ref.sha256, 0) - 1
            if n > 0:
                self._pin_counts[ref.sha256] = n
                return
            self._pin_counts.pop(ref.sha256, None)
            (self.pins / f"{ref.sha256}.{os.getpid()}").unlink(missing_ok=True)
        # Releasing counts as a use for LRU: a shard read for a long time is recent, not old.
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path_of(ref))

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.objects.iterdir() if p.is_file())

    def clean_stale(self) -> None:
        """Delete temp files of dead writers and pins of dead processes (after a crash)."""
        now = time.time()
        for p in self.tmp.iterdir():
            # Names start with the writer's "<sha256>.<pid>." (store and s3transfer temp names add suffixes).
            m = _TMP_NAME.match(p.name)
            pid = int(m.group(1)) if m else -1
            stale = (not _pid_alive(pid)) if pid > 0 else now - p.stat().st_mtime > _STALE_UNKNOWN_TMP_S
            if stale:
                p.unlink(missing_ok=True)
        for p in self.pins.iterdir():
            if not self._pin_live(p):
                p.unlink(missing_ok=True)

    # -- internals -----------------------------------------------------------------------------------
    def _pin(self, ref: CacheRef) -> None:
        with self._pin_lock:
            n = self._pin_counts.get(ref.sha256, 0)
            if n == 0:
                (self.pins / f"{ref.sha256}.{os.getpid()}").touch()
            self._pin_counts[ref.sha256] = n + 1

    @staticmethod
    def _pin_live(p: Path) -> bool:
        try:
            return _pid_alive(int(p.name.rsplit(".", 1)[1]))
        except (IndexError, ValueError):
            return False

    def _pinned(self, sha: str) -> bool:
        return any(self._pin_live(p) for p in self.pins.glob(f"{sha}.*"))

    def _ensure(self, store: Store, ref: CacheRef, pin: bool) -> Path:
        path = self.path_of(ref)
        with self._shard_lock(ref.sha256):
            # Pin under the shard lock: an evictor must take the same lock, so it cannot delete the
            # file between our existence check and our pin.
            if pin:
                self._pin(ref)
            try:
                if path.is_file() and path.stat().st_size == ref.size:
                    os.utime(path)
                    self._count(hits=1)
                    return path
                self._reserve(ref)
                self._download_verified(store, ref, path)
            except BaseException:
                if pin:
                    self.release(ref)
                raise
        return path

    def _download_verified(self, store: Store, ref: CacheRef, path: Path) -> None:
        url = store.url_of(ref.key)

        def once() -> None:
            tmp = self.tmp / f"{ref.sha256}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
            try:
                store.download(ref.key, tmp)
                size = tmp.stat().st_size
                if size != ref.size:
                    raise ShardIntegrityError(
                        f"shard {ref.key} at {url}: size {size} bytes, manifest says {ref.size}",
                        shard=ref.key,
                        uri=url,
                    )
                digest = sha256_file(tmp)
                if digest != ref.sha256:
                    raise ShardIntegrityError(
                        f"shard {ref.key} at {url}: sha256 {digest}, manifest says {ref.sha256}",
                        shard=ref.key,
                        uri=url,
                    )
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                dir_fd = os.open(self.objects, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
                self._count(downloads=1, bytes_downloaded=size)
            except ShardIntegrityError:
                self._count(integrity_failures=1)
                raise
            finally:
                tmp.unlink(missing_ok=True)

        def on_retry(exc: Exception) -> None:
            self._count(retries=1)
            log.warning("retrying shard %s after transient error: %s", ref.key, exc)

        try:
            retry_transient(once, self.retry, on_retry)
        except ObjectNotFoundError as exc:
            raise ShardMissingError(f"shard {ref.key} is missing at {url}", shard=ref.key, uri=url) from exc
        except StorageError as exc:
            raise ShardError(
                f"shard {ref.key} at {url}: download failed after {self.retry.attempts} attempts: {exc}",
                shard=ref.key,
                uri=url,
            ) from exc

    def _reserve(self, ref: CacheRef) -> None:
        """Evict least recently used, unpinned objects until ``ref`` fits in the budget."""
        if self.max_bytes is None:
            return
        with self._index_lock():
            entries = []
            for p in self.objects.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    entries.append((st.st_mtime, st.st_size, p))
            total = sum(size for _, size, _ in entries)
            if total + ref.size <= self.max_bytes:
                return
            for _, size, p in sorted(entries, key=lambda e: e[0]):
                if p.name == ref.sha256 or self._pinned(p.name):
                    continue
                lock = self._shard_lock(p.name, timeout=0)
                try:
                    lock.acquire()
                except Timeout:
                    continue  # being downloaded or opened right now
                try:
                    if self._pinned(p.name):
                        continue
                    p.unlink(missing_ok=True)
                    total -= size
                    self._count(evictions=1)
                finally:
                    lock.release()
                if total + ref.size <= self.max_bytes:
                    return
            log.warning(
                "shard cache %s over budget: %d bytes held by pinned shards + %d for %s > max %d",
                self.root,
                total,
                ref.size,
                ref.key,
                self.max_bytes,
            )
