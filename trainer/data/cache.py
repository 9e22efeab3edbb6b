"""Local shard cache shared by every worker process on a node (NVMe, or RAM under /dev/shm).

Use::

    cache = ShardCache("/nvme/shards", max_bytes=500 << 30)
    path = cache.acquire(store, CacheRef("shard-000003.bin", size, sha256))   # pinned: never evicted
    ...                                                                       # np.memmap(path, ...)
    cache.release(ref)
    cache.fetch(store, ref)        # download only (prefetch), no pin
    cache.check(ref)               # "ok" / "missing" / "corrupt" (hashes the bytes; drops a bad copy)

Guarantees, all of which hold across processes because they rest on the file system, not on memory:

- Content-addressed: ``objects/<sha256>``. A file appears there only by ``os.replace`` of a temp file
  whose size and sha256 matched the manifest, after fsync; a crash mid-download leaves at most a
  ``tmp/*.part`` file, which is never read and is deleted once its writer's pid is gone.
- Trusted only when proven: every process proves a cached object before its first use. The object was
  hashed against the manifest when it was written, and a seal (``seals/``) records the identity the file
  had then (device, inode, size, mtime and ctime in ns). Any write to the file changes its ctime, which no
  user-space call can set back, so a seal that still matches proves the bytes were not modified through
  the file system since they were hashed; otherwise (or always, with ``verify="full"``) the object is
  hashed again. A copy whose hash differs is logged as a warning naming the shard, deleted and
  downloaded again. Recency for LRU lives in ``used/`` marker files so that using an object never
  touches its own timestamps.
- One download per shard: a per-shard ``filelock`` (``locks/<sha256>.lock``) is held while checking and
  downloading, so a second process (or thread) waits and then finds the file.
- Size budget with LRU eviction: under the index lock (``locks/index.lock``), least recently used objects
  are deleted until the new shard fits. A shard pinned by a live process (``pins/<sha256>.<pid>``) or
  whose shard lock is held is never evicted. If only pinned shards remain, the cache goes over budget
  rather than failing the job, and says so in the log. ``disk_budget`` derives a budget from the size of
  the file system the cache lives on.
- Bad data: a size or sha256 mismatch raises ShardIntegrityError naming the shard and URI, and the bad
  bytes are deleted. Transient storage errors are retried (botocore first, then ``RetryPolicy`` around the
  whole shard with jittered backoff).

Written here rather than taken from a library: the verified, content-addressed, multi-process cache with
pins is the part the streaming loaders (MosaicML streaming, webdataset) implement inside their own
dataset formats, not as a reusable piece; ``filelock`` provides the cross-process locks.

Over 400 lines because the cache is one cross-process state machine (seals, pins, reservations, LRU eviction) whose
invariants hold only together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from filelock import FileLock, Timeout

from gpu_train.storage import ObjectNotFoundError, RetryPolicy, StorageError, Store, retry_transient
from trainer.data.errors import DataError, ShardError, ShardIntegrityError, ShardMissingError

log = logging.getLogger(__name__)

_STALE_UNKNOWN_TMP_S = 3600.0
_TMP_NAME = re.compile(r"^\.?[0-9a-f]{64}\.(\d+)\.")
VerifyMode = Literal["seal", "full"]
VERIFY_MODES = ("seal", "full")


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
    seal_hits: int = 0  # cached objects proven by their seal (a stat), not re-hashed
    hashes: int = 0  # cached objects hashed again before use
    bytes_hashed: int = 0
    corrupt_dropped: int = 0  # cached objects whose bytes no longer matched: deleted and fetched again


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


def _dir_bytes(folder: Path) -> int:
    """Bytes of the files in ``folder``; files evicted while it is listed (by another process) count 0."""
    total = 0
    if not folder.is_dir():
        return 0
    for p in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


def budget_from_disk(*, total: int, free: int, cached: int, fraction: float, reserve: int) -> int:
    """Cache budget in bytes: ``fraction`` of the file system, but never more than what the cache holds
    now plus what is free minus ``reserve`` (the rest of the node's users: checkpoints, logs, Alluxio)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"cache disk fraction must be in (0, 1] (got {fraction})")
    return max(0, min(int(total * fraction), cached + free - reserve))


def disk_budget(cache_dir: str | os.PathLike[str], fraction: float = 0.5) -> int:
    """``budget_from_disk`` for the file system holding ``cache_dir`` (which may not exist yet)."""
    p = Path(cache_dir).absolute()
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    cached = _dir_bytes(Path(cache_dir) / "objects")
    # Keep 5% of the file system (at least 1 GiB) for everything else on the disk.
    reserve = max(1 << 30, total // 20)
    return budget_from_disk(total=total, free=free, cached=cached, fraction=fraction, reserve=reserve)


class SealBook:
    """Records that a file's bytes hashed to a sha256, and proves it again with one ``stat``.

    A seal is ``seals/<sha256>-<hash of the path>.json`` holding the file's identity when it was hashed.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.dir = Path(root)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(
                f"seal directory {self.dir}: not a writable directory ({exc.strerror or exc})"
            ) from exc

    @staticmethod
    def identity(st: os.stat_result) -> list[int]:
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def _seal_path(self, path: Path, sha: str) -> Path:
        tag = hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:16]
        return self.dir / f"{sha}-{tag}.json"

    def matches(self, path: Path, sha: str, st: os.stat_result) -> bool:
        try:
            doc = json.loads(self._seal_path(path, sha).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("identity") == self.identity(st)

    def record(self, path: Path, sha: str, st: os.stat_result) -> None:
        seal = self._seal_path(path, sha)
        tmp = seal.with_name(f".{seal.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"path": str(path.absolute()), "identity": self.identity(st)}))
        os.replace(tmp, seal)

    def forget(self, path: Path, sha: str) -> None:
        self._seal_path(path, sha).unlink(missing_ok=True)


class ShardCache:
    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        max_bytes: int | None = None,
        *,
        retry: RetryPolicy | None = None,
        lock_timeout_s: float = 3600.0,
        verify: VerifyMode = "seal",
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0 (got {max_bytes}); 0 or None means no budget")
        if verify not in VERIFY_MODES:
            raise ValueError(f"cache verify mode must be one of {VERIFY_MODES} (got {verify!r})")
        self.root = Path(cache_dir)
        self.max_bytes = max_bytes or None
        self.retry = retry or RetryPolicy()
        self.lock_timeout_s = lock_timeout_s
        self.verify = verify
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"
        self.pins = self.root / "pins"
        self.used = self.root / "used"
        self.reserved = self.root / "reserved"
        try:
            for d in (self.objects, self.tmp, self.locks, self.pins, self.used, self.reserved):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(
                f"shard cache {self.root}: not a writable directory ({exc.strerror or exc})"
            ) from exc
        self.seals = SealBook(self.root / "seals")
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._pin_counts: dict[str, int] = {}
        self._pin_lock = threading.Lock()
        # sha256 -> identity of the object this process proved (by hash or seal); a changed identity
        # (rewritten, replaced) is proven again.
        self._proven: dict[str, list[int]] = {}
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

    def _touch_used(self, sha: str) -> None:
        # An explicit fine-grained time: "now" as the kernel stamps it is coarse (a few ms), which would
        # make uses in quick succession tie.
        marker = self.used / sha
        marker.touch()
        now = time.time_ns()
        os.utime(marker, ns=(now, now))

    # -- public API ----------------------------------------------------------------------------------
    def fetch(self, store: Store, ref: CacheRef) -> Path:
        """Make sure ``ref`` is cached and proven (downloading and verifying it if needed); no pin."""
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
        self._touch_used(ref.sha256)

    def check(self, ref: CacheRef) -> Literal["ok", "missing", "corrupt"]:
        """Hash the cached copy of ``ref`` (whatever its seal says); a corrupt copy is dropped."""
        path = self.path_of(ref)
        with self._shard_lock(ref.sha256):
            try:
                st = path.stat()
            except FileNotFoundError:
                return "missing"
            digest = sha256_file(path) if st.st_size == ref.size else f"(size {st.st_size})"
            self._count(hashes=1, bytes_hashed=st.st_size)
            if digest == ref.sha256:
                self.seals.record(path, ref.sha256, st)
                self._proven[ref.sha256] = SealBook.identity(st)
                return "ok"
            self._drop(ref, path, digest)
            return "corrupt"

    def total_bytes(self) -> int:
        return _dir_bytes(self.objects)

    def clean_stale(self) -> None:
        """Delete temp files of dead writers and pins of dead processes (after a crash)."""
        now = time.time()
        for p in self.tmp.iterdir():
            # Names start with the writer's "<sha256>.<pid>." (store and s3transfer temp names add suffixes).
            m = _TMP_NAME.match(p.name)
            pid = int(m.group(1)) if m else -1
            with contextlib.suppress(FileNotFoundError):  # its writer may finish meanwhile
                stale = (not _pid_alive(pid)) if pid > 0 else now - p.stat().st_mtime > _STALE_UNKNOWN_TMP_S
                if stale:
                    p.unlink(missing_ok=True)
        for p in self.pins.iterdir():
            if not self._pin_live(p):
                p.unlink(missing_ok=True)
        for p in self.reserved.iterdir():  # <sha256>.<pid>.<thread>
            parts = p.name.split(".")
            if len(parts) != 3 or not parts[1].isdigit() or not _pid_alive(int(parts[1])):
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

    def _drop(self, ref: CacheRef, path: Path, digest: str) -> None:
        """Delete a cached copy that failed verification (caller holds the shard lock)."""
        path.unlink(missing_ok=True)
        self.seals.forget(path, ref.sha256)
        self._proven.pop(ref.sha256, None)
        self._count(corrupt_dropped=1)
        log.warning(
            "cached shard %s at %s failed verification (sha256 %s, manifest says %s): dropped it",
            ref.key, path, digest, ref.sha256,
        )  # fmt: skip

    def _proven_now(self, ref: CacheRef, path: Path) -> tuple[bool, list[int], str]:
        """(proven, identity, digest or "") for the cached object: memo, then seal, then a full hash."""
        st = path.stat()
        ident = SealBook.identity(st)
        if self._proven.get(ref.sha256) == ident:
            return True, ident, ""
        if self.verify == "seal" and self.seals.matches(path, ref.sha256, st):
            self._proven[ref.sha256] = ident
            self._count(seal_hits=1)
            return True, ident, ""
        digest = sha256_file(path)
        self._count(hashes=1, bytes_hashed=st.st_size)
        if digest != ref.sha256:
            return False, ident, digest
        if SealBook.identity(path.stat()) == ident:  # unchanged while we hashed it
            self.seals.record(path, ref.sha256, st)
            self._proven[ref.sha256] = ident
        return True, ident, ""

    def _ensure(self, store: Store, ref: CacheRef, pin: bool) -> Path:
        path = self.path_of(ref)
        for _ in range(3):
            with self._shard_lock(ref.sha256):
                # Pin under the shard lock: an evictor must take the same lock, so it cannot delete the
                # file between our existence check and our pin.
                if pin:
                    self._pin(ref)
                try:
                    try:
                        hit = path.stat().st_size == ref.size
                    except FileNotFoundError:
                        hit = False
                    if not hit:
                        self._reserve(ref)
                        try:
                            self._download_verified(store, ref, path)
                        finally:
                            self._unreserve(ref)
                        self._touch_used(ref.sha256)
                        return path
                except BaseException:
                    if pin:
                        self.release(ref)
                    raise
            # A hit: prove it outside the lock, so that processes sharing the cache hash in parallel.
            # A pinned object cannot be evicted meanwhile; an unpinned one being evicted only wastes the hash.
            try:
                ok, ident, digest = self._proven_now(ref, path)
            except FileNotFoundError:
                ok, ident, digest = False, [], ""
            except BaseException:
                if pin:
                    self.release(ref)
                raise
            if ok:
                self._count(hits=1)
                self._touch_used(ref.sha256)
                return path
            with self._shard_lock(ref.sha256), contextlib.suppress(FileNotFoundError):
                if digest and SealBook.identity(path.stat()) == ident:  # nobody replaced it meanwhile
                    self._drop(ref, path, digest)
            if pin:
                self.release(ref)
        raise ShardIntegrityError(
            f"shard {ref.key}: cached copy at {path} keeps failing verification", shard=ref.key, uri=str(path)
        )

    def _download_verified(self, store: Store, ref: CacheRef, path: Path) -> None:
        url = store.url_of(ref.key)

        def once() -> None:
            tmp = self.tmp / f"{ref.sha256}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
            try:
                store.download(ref.key, tmp)
                size = tmp.stat().st_size
                if size != ref.size:
                    raise ShardIntegrityError.mismatch(ref.key, url, f"size {size} bytes", ref.size)
                digest = sha256_file(tmp)
                if digest != ref.sha256:
                    raise ShardIntegrityError.mismatch(ref.key, url, f"sha256 {digest}", ref.sha256)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                dir_fd = os.open(self.objects, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
                st = path.stat()  # after the rename, which sets the ctime the seal must record
                self.seals.record(path, ref.sha256, st)
                self._proven[ref.sha256] = SealBook.identity(st)
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

    def _last_used(self, p: Path, st: os.stat_result) -> int:
        try:
            return (self.used / p.name).stat().st_mtime_ns
        except FileNotFoundError:
            return st.st_mtime_ns

    def _reservation(self, ref: CacheRef) -> Path:
        return self.reserved / f"{ref.sha256}.{os.getpid()}.{threading.get_ident()}"

    def _unreserve(self, ref: CacheRef) -> None:
        if self.max_bytes is not None:
            self._reservation(ref).unlink(missing_ok=True)

    def _reserved_bytes(self) -> int:
        """Space promised to downloads in flight (any live process), which are not in objects/ yet."""
        total = 0
        for p in self.reserved.iterdir():
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                if _pid_alive(int(p.name.split(".")[1])):
                    total += int(p.read_text() or 0)
        return total

    def _reserve(self, ref: CacheRef) -> None:
        """Evict least recently used, unpinned objects until ``ref`` fits in the budget.

        The reservation stays recorded (``reserved/``) until the download ends, so that concurrent
        downloads, in this process or another, do not all count the same free space.
        """
        if self.max_bytes is None:
            return
        with self._index_lock():
            # Reservations first, then the objects: a download in flight moves its file into objects/ before it
            # drops its reservation, so read in this order it is counted once or twice, never missed (read the
            # other way, one that finishes between the two reads is in neither, and the cache overshoots).
            reserved = self._reserved_bytes()
            entries = []
            for p in self.objects.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    entries.append((self._last_used(p, st), st.st_size, p))
            total = sum(size for _, size, _ in entries) + reserved
            self._reservation(ref).write_text(str(ref.size))
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
                    self.seals.forget(p, p.name)
                    (self.used / p.name).unlink(missing_ok=True)
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
