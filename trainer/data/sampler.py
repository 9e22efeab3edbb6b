"""Deterministic global sample order shared by every rank.

Use::

    sampler = GlobalSampler(ds.num_windows, global_batch=B, seed=S)
    for step in range(sampler.next_step, steps):
        idx = sampler.rank_slice(step, rank, world)     # this rank's windows of the global batch
        ...
        save({"sampler": sampler.state_dict(), ...})

The global sample index ``p`` (0, 1, 2, ... over the whole run) decides everything: step ``s`` consumes
positions ``s*B .. s*B+B-1``; position ``p`` lies in epoch ``p // N`` at place ``p % N`` and reads window
``perm(seed, epoch)[p % N]``. No rank count appears in that formula, so the union of the rank slices of a
step is the same global batch for any world size, which is what lets an elastic job resume after it shrank
or grew.

``perm`` is a keyed pseudo-random permutation of ``[0, N)`` built from a balanced Feistel network with
cycle walking (Black & Rogaway, "Ciphers with Arbitrary Finite Domains", 2002,
https://web.cs.ucdavis.edu/~rogaway/papers/subset.pdf): any position maps to its window in O(1) time and
memory, so a billion-window dataset needs no billion-entry shuffle array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.data.errors import SamplerStateError

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser (a strong 64-bit mixer); uint64 arithmetic wraps on purpose."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    state = np.array([(seed * 0x100000001B3 + epoch * 0x9E3779B1 + 0x5851F42D4C957F2D) & _MASK64], np.uint64)
    keys = []
    for _ in range(_ROUNDS):
        state = _splitmix64(state)
        keys.append(state[0])
    return keys


class FeistelPermutation:
    """A bijection of ``[0, n)`` chosen by ``(seed, epoch)``; ``perm(positions)`` is vectorised."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"permutation domain must be >= 1 (got {n})")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2  # the network permutes [0, 4**half), at most 4n values
        self._mask = np.uint64((1 << self._half) - 1)
        self._keys = _round_keys(seed, epoch)

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


class GlobalSampler:
    """Global batches of window indices; ``state_dict`` records how far the run got."""

    def __init__(self, num_windows: int, global_batch: int, seed: int = 0) -> None:
        if num_windows < 1:
            raise ValueError(f"num_windows must be >= 1 (got {num_windows}): the dataset has no full window")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1 (got {global_batch})")
        self.num_windows = int(num_windows)
        self.global_batch_size = int(global_batch)
        self.seed = int(seed)
        self._index = 0  # global sample index of the next sample to hand out
        self._perms: dict[int, FeistelPermutation] = {}

    # -- order -------------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> FeistelPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 4:
                self._perms.clear()
            perm = self._perms[epoch] = FeistelPermutation(self.num_windows, self.seed, epoch)
        return perm

    def windows_at(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Window indices read at the given global sample indices (any epochs)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and pos.min() < 0:
            raise IndexError("global sample index must be >= 0")
        epochs, places = np.divmod(pos, self.num_windows)
        out = np.empty_like(pos)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._perm(int(epoch))(places[sel])
        return out

    def epoch_of(self, step: int) -> int:
        return step * self.global_batch_size // self.num_windows

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
        per = self.global_batch_size // world
        start = step * self.global_batch_size + rank * per
        if step < 0:
            raise IndexError(f"step must be >= 0 (got {step})")
        out = self.windows_at(np.arange(start, start + per, dtype=np.int64))
        self._index = (step + 1) * self.global_batch_size
        return out.tolist()

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
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()``; ``epoch`` and ``index`` are required, the rest is checked."""
        for key in ("epoch", "index"):
            if key not in state:
                raise SamplerStateError(f"sampler state is missing key {key!r} (got keys {sorted(state)})")
            if not isinstance(state[key], int | np.integer) or state[key] < 0:
                raise SamplerStateError(f"sampler state key {key!r} must be an int >= 0 (got {state[key]!r})")
        for key, mine in (("seed", self.seed), ("num_windows", self.num_windows)):
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
