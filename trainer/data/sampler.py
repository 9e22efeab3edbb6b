"""Deterministic global sample order shared by every rank, shuffled in blocks of shards.

Use::

    sampler = GlobalSampler(ds.num_windows, global_batch=B, seed=S,
                            shard_windows=ds.shard_windows, block_shards=4)
    for step in range(sampler.next_step, steps):
        ds.fetch_ahead(sampler.upcoming_shards(step, 8, end_step=steps))  # this block and the next
        idx = sampler.rank_slice(step, rank, world)            # this rank's windows of the global batch
        ...
        save({"sampler": sampler.state_dict(), ...})

The global sample index ``p`` (0, 1, 2, ... over the whole run) decides everything: step ``s`` consumes
positions ``s*B .. s*B+B-1``; position ``p`` lies in epoch ``p // N`` at place ``p % N``. No rank count
appears in the order, so the union of the rank slices of a step is the same global batch for any world
size, which is what lets an elastic job resume after it shrank or grew.

Block shuffle (with ``shard_windows``): each epoch the shards are put in a keyed pseudo-random order and
cut into blocks of ``block_shards`` consecutive shards; the epoch visits the blocks one after the other and,
inside a block, the windows of its shards in a keyed pseudo-random order. A step therefore reads from at
most two blocks (``2 * block_shards`` shards) however large the dataset, so a node's shard cache needs
room for a few blocks, not for the whole dataset, and the shards of the next block are known long before
they are needed (``upcoming_shards``). This is the trade-off streaming loaders make with their shuffle
block size: a smaller block means a smaller working set and less mixing within a batch. Without
``shard_windows`` the whole dataset is one block over the window indices (a global shuffle).

Every permutation is a keyed pseudo-random permutation of ``[0, n)`` built from a balanced Feistel network
with cycle walking (Black & Rogaway, "Ciphers with Arbitrary Finite Domains", 2002,
https://web.cs.ucdavis.edu/~rogaway/papers/subset.pdf): any position maps to its window in O(1) time and
memory, so a billion-window dataset needs no billion-entry shuffle array.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.data.errors import SamplerStateError

_MASK64 = (1 << 64) - 1
_ROUNDS = 6
DEFAULT_BLOCK_SHARDS = 4
_STREAM_SHARD_ORDER = 1  # key stream of the per-epoch shard order; blocks use 2, 3, ...
_AHEAD_STEPS = 32  # rank_slice orders this many steps' windows at once


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser (a strong 64-bit mixer); uint64 arithmetic wraps on purpose."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int, stream: int = 0) -> list[np.uint64]:
    # stream 0 keeps the keys of the original whole-dataset shuffle, so its order is unchanged.
    state = np.array(
        [
            (seed * 0x100000001B3 + epoch * 0x9E3779B1 + stream * 0xD1B54A32D192ED03 + 0x5851F42D4C957F2D)
            & _MASK64
        ],
        np.uint64,
    )
    keys = []
    for _ in range(_ROUNDS):
        state = _splitmix64(state)
        keys.append(state[0])
    return keys


class FeistelPermutation:
    """A bijection of ``[0, n)`` chosen by ``(seed, epoch, stream)``; ``perm(positions)`` is vectorised."""

    def __init__(self, n: int, seed: int, epoch: int, stream: int = 0) -> None:
        if n < 1:
            raise ValueError(f"permutation domain must be >= 1 (got {n})")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2  # the network permutes [0, 4**half), at most 4n values
        self._mask = np.uint64((1 << self._half) - 1)
        self._keys = _round_keys(seed, epoch, stream)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_splitmix64(right ^ key) & self._mask)
        return (left << half) | right

    def __call__(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"position out of range [0, {self.n})")
        out = self._encrypt(pos.astype(np.uint64))
        # Cycle walking: re-encrypt values that fell outside [0, n); since the network is a bijection of
        # the larger domain, the first value inside [0, n) on each cycle is unique (Black & Rogaway, sec. 3).
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class _EpochLayout:
    """One epoch of the block shuffle: shard order, cumulative window counts and block boundaries."""

    def __init__(self, shard_windows: np.ndarray, block_shards: int, seed: int, epoch: int) -> None:
        n_shards = shard_windows.size
        self.order = FeistelPermutation(n_shards, seed, epoch, _STREAM_SHARD_ORDER)(np.arange(n_shards))
        self.cum = np.zeros(n_shards + 1, dtype=np.int64)
        np.cumsum(shard_windows[self.order], out=self.cum[1:])
        k = block_shards
        self.block_shards = k
        self.bounds = self.cum[np.append(np.arange(0, n_shards, k), n_shards)]  # windows at block starts
        self.n_blocks = self.bounds.size - 1

    def block_of(self, places: np.ndarray) -> np.ndarray:
        # side="right" skips blocks without windows: their start equals the next block's start.
        return np.searchsorted(self.bounds, places, side="right") - 1

    def shards_of_block(self, block: int) -> np.ndarray:
        return self.order[block * self.block_shards : (block + 1) * self.block_shards]


class GlobalSampler:
    """Global batches of window indices; ``state_dict`` records how far the run got.

    ``shard_windows`` (windows per shard, in shard order, summing to ``num_windows``) turns on the block
    shuffle; ``block_shards`` is the block size in shards (0: all shards in one block).
    """

    def __init__(
        self,
        num_windows: int,
        global_batch: int,
        seed: int = 0,
        *,
        shard_windows: Sequence[int] | np.ndarray | None = None,
        block_shards: int = DEFAULT_BLOCK_SHARDS,
    ) -> None:
        if num_windows < 1:
            raise ValueError(f"num_windows must be >= 1 (got {num_windows}): the dataset has no full window")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1 (got {global_batch})")
        self.num_windows = int(num_windows)
        self.global_batch_size = int(global_batch)
        self.seed = int(seed)
        self._index = 0  # global sample index of the next sample to hand out
        self._perms: OrderedDict[tuple[int, int], FeistelPermutation] = OrderedDict()
        self._layouts: OrderedDict[int, _EpochLayout] = OrderedDict()
        self._ahead: tuple[tuple[int, int, int] | None, np.ndarray] = (None, np.empty((0, 0), dtype=np.int64))
        self._shard_windows: np.ndarray | None = None
        self.block_shards = 0
        if shard_windows is not None:
            counts = np.asarray(shard_windows, dtype=np.int64)
            if counts.ndim != 1 or counts.size == 0 or (counts < 0).any():
                raise ValueError("shard_windows must be a non-empty list of window counts >= 0")
            if int(counts.sum()) != self.num_windows:
                raise ValueError(
                    f"shard_windows add up to {int(counts.sum())} windows but num_windows is {self.num_windows}"
                )
            if block_shards < 0:
                raise ValueError(f"block_shards must be >= 0 (got {block_shards}); 0 means one block")
            self._shard_windows = counts
            self.block_shards = int(block_shards) if 0 < block_shards < counts.size else int(counts.size)
            self._shard_start = np.zeros(counts.size + 1, dtype=np.int64)
            np.cumsum(counts, out=self._shard_start[1:])

    @property
    def num_shards(self) -> int:
        """Shards the order knows about (0: a shard-agnostic whole-dataset shuffle)."""
        return 0 if self._shard_windows is None else int(self._shard_windows.size)

    # -- order -------------------------------------------------------------------------------------
    def _perm(self, n: int, epoch: int, stream: int) -> FeistelPermutation:
        key = (epoch, stream)
        perm = self._perms.get(key)
        if perm is None or perm.n != n:
            perm = self._perms[key] = FeistelPermutation(n, self.seed, epoch, stream)
            while len(self._perms) > 64:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return perm

    def _layout(self, epoch: int) -> _EpochLayout:
        assert self._shard_windows is not None
        layout = self._layouts.get(epoch)
        if layout is None:
            layout = self._layouts[epoch] = _EpochLayout(
                self._shard_windows, self.block_shards, self.seed, epoch
            )
            while len(self._layouts) > 3:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(epoch)  # the least recently used goes first
        return layout

    def _windows_in_epoch(self, epoch: int, places: np.ndarray) -> np.ndarray:
        if self._shard_windows is None:
            return self._perm(self.num_windows, epoch, 0)(places)
        layout = self._layout(epoch)
        blocks = layout.block_of(places)
        within = np.empty_like(places)  # place inside the epoch's shard-ordered concatenation
        for block in np.unique(blocks):
            sel = blocks == block
            lo, hi = int(layout.bounds[block]), int(layout.bounds[block + 1])
            within[sel] = lo + self._perm(hi - lo, epoch, 2 + int(block))(places[sel] - lo)
        slot = np.searchsorted(layout.cum, within, side="right") - 1
        shards = layout.order[slot]
        return self._shard_start[shards] + (within - layout.cum[slot])

    def windows_at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Window indices read at the given global sample indices (any epochs)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and pos.min() < 0:
            raise IndexError("global sample index must be >= 0")
        epochs, places = np.divmod(pos, self.num_windows)
        out = np.empty_like(pos)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._windows_in_epoch(int(epoch), places[sel])
        return out

    def upcoming_shards(self, step: int, count: int, end_step: int | None = None) -> list[int]:
        """Up to ``count`` distinct shards in the order steps ``step, step+1, ...`` first read them.

        The current block's shards come first (they are read in an interleaved order, so all of them are
        needed now), then the next block's, crossing into the next epoch when needed; with ``end_step``
        (the run's last step + 1) nothing past the end of the run is listed. Cheap: it walks the block
        layout, not the windows.
        """
        if self._shard_windows is None:
            raise ValueError("this sampler was built without shard_windows: it does not know the shards")
        if step < 0 or count < 0:
            raise ValueError(f"step and count must be >= 0 (got {step}, {count})")
        # No more distinct shards than those with windows: the walk stops there, not an epoch or two later.
        count = min(count, int(np.count_nonzero(self._shard_windows)))
        out: dict[int, None] = {}
        end = None if end_step is None else end_step * self.global_batch_size  # first position not read
        epoch, place = divmod(step * self.global_batch_size, self.num_windows)
        if end is not None and step * self.global_batch_size >= end:
            return []
        layout = self._layout(epoch)
        block = int(layout.block_of(np.asarray([place]))[0])
        for _ in range(2 * layout.n_blocks + 1):  # at most one full epoch ahead
            if len(out) >= count:
                break
            if end is not None and epoch * self.num_windows + int(layout.bounds[block]) >= end:
                break
            for s in layout.shards_of_block(block).tolist():
                if self._shard_windows[s] > 0:
                    out.setdefault(int(s), None)
            block += 1
            if block >= layout.n_blocks:
                epoch, block = epoch + 1, 0
                layout = self._layout(epoch)
        return list(out)[:count]

    def global_batch(self, step: int) -> list[int]:
        """The B window indices of optimizer step ``step``; marks the step as handed out."""
        if step < 0:
            raise IndexError(f"step must be >= 0 (got {step})")
        start = step * self.global_batch_size
        out = self.windows_at(np.arange(start, start + self.global_batch_size, dtype=np.int64))
        self._index = start + self.global_batch_size
        return out.tolist()

    def rank_slice(self, step: int, rank: int, world: int) -> list[int]:
        """Rank ``rank``'s contiguous ``B // world`` windows of global batch ``step``."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of size {world}")
        if self.global_batch_size % world:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by world size {world}")
        if step < 0:
            raise IndexError(f"step must be >= 0 (got {step})")
        per = self.global_batch_size // world
        first = step - step % _AHEAD_STEPS
        key = (rank, world, first)
        # This rank's windows of _AHEAD_STEPS steps in one pass: one step's alone costs about as much as all of them
        # (numpy's per-call cost). Windows are a pure function of their positions, so the kept ones are exact.
        if self._ahead[0] != key:
            steps = np.arange(first, first + _AHEAD_STEPS, dtype=np.int64)[:, None] * self.global_batch_size
            positions = steps + rank * per + np.arange(per, dtype=np.int64)
            self._ahead = (key, self.windows_at(positions.ravel()).reshape(positions.shape))
        self._index = (step + 1) * self.global_batch_size
        return self._ahead[1][step - first].tolist()

    # -- resume ------------------------------------------------------------------------------------
    @property
    def index(self) -> int:
        """Global sample index of the next sample (= samples consumed so far)."""
        return self._index

    @property
    def epoch(self) -> int:
        return self._index // self.num_windows

    @property
    def next_step(self) -> int:
        """The step to run next after a resume (``index // global_batch``)."""
        return self._index // self.global_batch_size

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "index": self._index,
            "seed": self.seed,
            "num_windows": self.num_windows,
            "global_batch": self.global_batch_size,
            "num_shards": self.num_shards,
            "block_shards": self.block_shards,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()``; ``epoch`` and ``index`` are required, the rest is checked."""
        for key in ("epoch", "index"):
            if key not in state:
                raise SamplerStateError(f"sampler state is missing key {key!r} (got keys {sorted(state)})")
            if not isinstance(state[key], int | np.integer) or state[key] < 0:
                raise SamplerStateError(f"sampler state key {key!r} must be an int >= 0 (got {state[key]!r})")
        for key, mine in (
            ("seed", self.seed),
            ("num_windows", self.num_windows),
            ("num_shards", self.num_shards),
            ("block_shards", self.block_shards),
        ):
            if key in state and int(state[key]) != mine:
                raise SamplerStateError(
                    f"sampler state key {key!r} is {state[key]} but this run has {mine}: resuming would "
                    "replay a different sample order"
                )
        index, epoch = int(state["index"]), int(state["epoch"])
        if epoch != index // self.num_windows:
            raise SamplerStateError(
                f"sampler state key 'epoch' is {epoch} but index {index} over {self.num_windows} windows "
                f"is in epoch {index // self.num_windows}"
            )
        if index % self.global_batch_size:
            raise SamplerStateError(
                f"sampler state key 'index' ({index}) is not a multiple of global batch "
                f"{self.global_batch_size}: the global batch size changed mid-run"
            )
        self._index = index
