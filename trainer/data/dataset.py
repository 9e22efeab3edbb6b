"""Windows of ``context + 1`` tokens over a sharded (or in-memory) token stream.

Use::

    from trainer.data import open_dataset
    ds = open_dataset("s3://bucket/ds/manifest.json", context=1024, cache_dir="/nvme/cache")
    w = ds.window(i)            # int64 array (context+1,): x = w[:-1], y = w[1:]
    xy = ds.batch([i, j, k])    # int64 array (3, context+1)
    ds.prefetch(upcoming)       # background download of the shards those windows live in
    ds.fetch_ahead([7, 2, 9])   # background download of these shards, in this order
    ds.shard_windows            # windows per shard: what GlobalSampler's block shuffle needs
    ds.close()

Window ``i`` is a pair (shard, offset). Packed (default): documents are concatenated with an EOT token
between them and shard ``s`` of ``n`` tokens holds ``(n - 1) // T`` windows at offsets ``0, T, 2T, ...``;
consecutive windows share one token so every token is a target exactly once. Non-packed: the same tiling
restarted at each document start, so no window crosses a document boundary; a document's short tail is
dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from trainer.data.errors import DataError, DatasetTooShortError

if TYPE_CHECKING:
    from trainer.data.cache import ShardCache
    from trainer.data.manifest import Manifest


class ShardSource(Protocol):
    """Where a Dataset gets token arrays from (memory, or the local shard cache)."""

    shard_tokens: Sequence[int]

    def array(self, shard: int) -> np.ndarray: ...

    def doc_starts(self, shard: int) -> np.ndarray: ...

    def prefetch(self, shards: Sequence[int]) -> None: ...

    def fetch_ahead(self, shards: Sequence[int]) -> None: ...

    def close(self) -> None: ...


class Dataset:
    """Random access to token windows; what ``open_dataset`` returns."""

    def __init__(
        self,
        source: ShardSource,
        *,
        uri: str,
        context: int,
        packing: bool,
        vocab_size: int,
        eot_id: int,
        manifest_sha256: str,
        prefetch_shards: int,
        manifest: Manifest | None = None,
        cache: ShardCache | None = None,
        split: str = "train",
        read_mode: str = "memory",
    ) -> None:
        if context < 1:
            raise DataError(f"context must be >= 1 (got {context})")
        self.uri = uri
        self.split = split
        self.read_mode = read_mode  # "direct", "disk", "memory" (see trainer.data.shards)
        self.context = context
        self.packing = packing
        self.vocab_size = vocab_size
        self.eot_id = eot_id
        self.manifest_sha256 = manifest_sha256
        self.prefetch_shards = prefetch_shards
        self.manifest = manifest  # None for the in-memory synthetic dataset
        self.cache = cache
        self._source = source
        self._offsets: list[np.ndarray | None] = []
        counts = []
        for s, n in enumerate(source.shard_tokens):
            if packing:
                counts.append(max(0, (n - 1) // context))
                self._offsets.append(None)
            else:
                offs = _unpacked_offsets(source.doc_starts(s), n, context)
                counts.append(len(offs))
                self._offsets.append(offs)
        self._cum = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(np.asarray(counts, dtype=np.int64), out=self._cum[1:])
        self._closed = False
        if self.num_windows == 0:
            longest = max(source.shard_tokens, default=0)
            raise DatasetTooShortError(
                f"dataset {uri} ({split} split): no window of context + 1 = {context + 1} tokens fits "
                f"(its longest shard has {longest} tokens"
                + ("" if packing else "; with packing off a window must also fit inside one document")
                + "): use a shorter model.context or more data"
            )

    @property
    def num_windows(self) -> int:
        return int(self._cum[-1])

    @property
    def num_shards(self) -> int:
        return len(self._cum) - 1

    @property
    def shard_windows(self) -> np.ndarray:
        """Windows in each shard, in shard order (sums to ``num_windows``)."""
        return np.diff(self._cum)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, token offset) of window ``i``."""
        shards, starts = self._locate([i])
        return int(shards[0]), int(starts[0])

    def _locate(self, indices: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """(shard, token offset) of each window, as two int64 arrays; an index out of range raises, naming it."""
        idx = np.fromiter(indices, dtype=np.int64)
        bad = idx[(idx < 0) | (idx >= self.num_windows)]
        if bad.size:
            raise IndexError(f"window {int(bad[0])} out of range [0, {self.num_windows}) of {self.uri}")
        shards = np.searchsorted(self._cum, idx, side="right") - 1
        starts = (idx - self._cum[shards]) * self.context  # packed: windows tile the shard
        for s in np.unique(shards).tolist():
            offs = self._offsets[s]
            if offs is not None:  # unpacked: each window's own start
                rows = shards == s
                starts[rows] = offs[idx[rows] - self._cum[s]]
        return shards, starts

    def window(self, i: int) -> np.ndarray:
        s, off = self.locate(int(i))
        arr = self._source.array(s)
        return np.array(arr[off : off + self.context + 1], dtype=np.int64)

    def batch(self, indices: Iterable[int]) -> np.ndarray:
        """Windows stacked into an int64 array of shape (len(indices), context + 1): one gather per shard, as
        many rows as `window` reads one by one (a step's batch is read on the step's path)."""
        shards, starts = self._locate(indices)
        out = np.empty((shards.size, self.context + 1), dtype=np.int64)
        span = np.arange(self.context + 1)
        for s in np.unique(shards).tolist():
            rows = shards == s
            out[rows] = self._source.array(s)[starts[rows][:, None] + span]
        return out

    def shards_of(self, indices: Iterable[int]) -> list[int]:
        """Distinct shards holding the given windows, in first-use order."""
        return list(dict.fromkeys(self._locate(indices)[0].tolist()))

    def prefetch(self, indices: Iterable[int]) -> None:
        """Hint: these windows are needed soon; fetch up to ``prefetch_shards`` of their shards."""
        if self.prefetch_shards <= 0 or self._closed:
            return
        self._source.prefetch(self.shards_of(indices)[: self.prefetch_shards])

    def fetch_ahead(self, shards: Sequence[int]) -> None:
        """Hint: these shards are read next, in this order (``GlobalSampler.upcoming_shards``).

        Shards not open or on their way yet are fetched in the background, ``prefetch_shards`` at a time.
        """
        if self._closed:
            return
        bad = [s for s in shards if not 0 <= int(s) < self.num_shards]
        if bad:
            raise IndexError(f"shards {bad} out of range [0, {self.num_shards}) of {self.uri}")
        self._source.fetch_ahead([int(s) for s in shards])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._source.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unpacked_offsets(starts: np.ndarray, n_tokens: int, context: int) -> np.ndarray:
    """Window start offsets that tile each document [start, next start) with no window crossing its end."""
    starts = np.asarray(starts, dtype=np.int64)
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.append(starts[1:], n_tokens)
    counts = np.maximum(0, (ends - starts - 1) // context)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    doc_of = np.repeat(np.arange(starts.size), counts)
    first = np.zeros(starts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    k = np.arange(total, dtype=np.int64) - first[doc_of]
    return starts[doc_of] + k * context


class MemorySource:
    """Token arrays already in memory (the "synthetic" dataset)."""

    def __init__(self, arrays: Sequence[np.ndarray], doc_starts: Sequence[np.ndarray]) -> None:
        self._arrays = list(arrays)
        self._starts = list(doc_starts)
        self.shard_tokens = [int(a.size) for a in self._arrays]
        self._lock = threading.Lock()

    def array(self, shard: int) -> np.ndarray:
        return self._arrays[shard]

    def doc_starts(self, shard: int) -> np.ndarray:
        return self._starts[shard]

    def prefetch(self, shards: Sequence[int]) -> None:
        """Nothing to fetch: every shard is already in memory."""

    def fetch_ahead(self, shards: Sequence[int]) -> None:
        """Nothing to fetch: every shard is already in memory."""

    def close(self) -> None:
        self._arrays = []
