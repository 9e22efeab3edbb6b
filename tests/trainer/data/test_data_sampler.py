"""GlobalSampler: a permutation per epoch, identical global batches for any world size, exact resume.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_sampler.py -q``
"""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data import GlobalSampler, SamplerStateError
from trainer.data.sampler import FeistelPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_feistel_is_a_permutation(n):
    out = FeistelPermutation(n, seed=3, epoch=1)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_order_depends_on_seed_and_epoch_only():
    n = 1000
    a = FeistelPermutation(n, seed=1, epoch=0)(np.arange(n))
    assert np.array_equal(a, FeistelPermutation(n, seed=1, epoch=0)(np.arange(n)))
    assert not np.array_equal(a, FeistelPermutation(n, seed=1, epoch=1)(np.arange(n)))
    assert not np.array_equal(a, FeistelPermutation(n, seed=2, epoch=0)(np.arange(n)))
    # A shuffle, not a near-identity: few fixed points and neighbours mostly separated.
    assert (a == np.arange(n)).sum() < 10
    assert np.abs(np.diff(a)).mean() > n / 10


def test_every_epoch_visits_every_window_once():
    n, b = 103, 8  # batches straddle epoch boundaries
    s = GlobalSampler(n, global_batch=b, seed=5)
    seen = [i for step in range(3 * n // b + 1) for i in s.global_batch(step)]
    for epoch in range(3):
        assert sorted(seen[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert seen[:n] != seen[n : 2 * n]
    # Steps 0..38 handed out 39 * 8 = 312 positions: the next one is in epoch 312 // 103 = 3.
    assert s.index == 312 and s.epoch == 3 and s.state_dict()["epoch"] == 3


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_reassemble_the_global_batch(world):
    n, b = 501, 12
    ref = GlobalSampler(n, global_batch=b, seed=9)
    for step in [0, 1, 41, 42, 43, 500]:  # 41..43 cross the first epoch boundary (501 / 12)
        per_rank = [GlobalSampler(n, global_batch=b, seed=9).rank_slice(step, r, world) for r in range(world)]
        assert all(len(p) == b // world for p in per_rank)
        assert [i for p in per_rank for i in p] == ref.global_batch(step)


def test_one_samplers_rank_slices_step_after_step_are_its_global_batches():
    """A rank's sampler orders several steps' windows at once: called step after step (across those groups and
    epoch boundaries), after a jump back, and for another rank or world size, it still returns each step's part
    of the global batch."""
    counts, batch = [7, 13, 0, 21, 5, 9, 30, 2], 12
    kw = dict(global_batch=batch, seed=5, shard_windows=counts, block_shards=3)
    ref, s = GlobalSampler(sum(counts), **kw), GlobalSampler(sum(counts), **kw)
    for step, rank, world in [*((k, 1, 2) for k in range(80)), (3, 1, 2), (3, 0, 2), (70, 2, 3), (31, 0, 1)]:
        per = batch // world
        assert s.rank_slice(step, rank, world) == ref.global_batch(step)[rank * per:(rank + 1) * per]
        assert s.next_step == step + 1


def test_rank_slice_rejects_indivisible_batch_and_bad_rank():
    s = GlobalSampler(100, global_batch=10, seed=0)
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        s.rank_slice(0, 0, 3)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        s.rank_slice(0, 2, 2)


def test_state_dict_resume_continues_the_same_order_with_another_world_size():
    n, b = 257, 16
    a = GlobalSampler(n, global_batch=b, seed=11)
    for step in range(37):
        a.rank_slice(step, 0, 4)
    state = a.state_dict()
    assert state["index"] == 37 * b and state["epoch"] == 37 * b // n
    b2 = GlobalSampler(n, global_batch=b, seed=11)
    b2.load_state_dict({"epoch": state["epoch"], "index": state["index"]})
    step = b2.next_step
    assert step == 37
    resumed = [i for r in range(2) for i in b2.rank_slice(step, r, 2)]
    assert resumed == GlobalSampler(n, global_batch=b, seed=11).global_batch(37)
    assert b2.state_dict()["index"] == 38 * b


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ({"index": 0}, "missing key 'epoch'"),
        ({"epoch": 0, "index": -1}, "'index' must be an int >= 0"),
        ({"epoch": 0, "index": 0, "seed": 2}, "'seed' is 2 but this run has 1"),
        ({"epoch": 0, "index": 0, "num_windows": 99}, "'num_windows' is 99"),
        ({"epoch": 1, "index": 16}, "'epoch' is 1 but index 16"),
        ({"epoch": 0, "index": 12}, "not a multiple of global batch 8"),
    ],
)
def test_bad_state_is_rejected_naming_the_key(state, needle):
    with pytest.raises(SamplerStateError, match=needle):
        GlobalSampler(100, global_batch=8, seed=1).load_state_dict(state)


# -- block shuffle ------------------------------------------------------------------------------------------
def _shard_of(counts: list[int], windows: list[int]) -> np.ndarray:
    """Shard of each window index, from the per-shard window counts (an independent reference)."""
    return np.searchsorted(np.cumsum(counts), np.asarray(windows), side="right")


@pytest.mark.parametrize(
    ("counts", "block"), [([5, 0, 7, 3, 9, 1, 4], 2), ([10] * 12, 3), ([1], 1), ([3, 4, 5], 0), ([2, 9], 5)]
)
def test_block_shuffle_visits_every_window_once_per_epoch(counts, block):
    n = sum(counts)
    s = GlobalSampler(n, global_batch=1, seed=3, shard_windows=counts, block_shards=block)
    for epoch in range(3):
        seen = s.windows_at(np.arange(epoch * n, (epoch + 1) * n)).tolist()
        assert sorted(seen) == list(range(n))


def test_block_shuffle_touches_a_bounded_set_of_shards_per_step():
    counts, block, batch = [40] * 50, 4, 32  # 50 shards; a block holds 160 windows, more than a batch
    n = sum(counts)
    blocked = GlobalSampler(n, global_batch=batch, seed=1, shard_windows=counts, block_shards=block)
    flat = GlobalSampler(n, global_batch=batch, seed=1)
    steps = range(2 * n // batch)  # two epochs
    per_step = [len(set(_shard_of(counts, blocked.global_batch(s)))) for s in steps]
    assert max(per_step) <= 2 * block  # a batch spans at most two consecutive blocks
    # Within a block the windows are mixed: a batch draws from several of its shards, not from one.
    assert np.mean(per_step) >= block * 0.75
    # The whole-dataset shuffle reads from far more shards per step: what thrashed the cache.
    flat_per_step = [len(set(_shard_of(counts, flat.global_batch(s)))) for s in steps]
    assert np.mean(flat_per_step) > 3 * np.mean(per_step)


def test_block_order_depends_on_seed_epoch_and_block_size_only():
    counts = [30] * 20
    n = sum(counts)

    def order(seed, block, epoch=0):
        s = GlobalSampler(n, global_batch=1, seed=seed, shard_windows=counts, block_shards=block)
        return s.windows_at(np.arange(epoch * n, (epoch + 1) * n))

    a = order(1, 4)
    assert np.array_equal(a, order(1, 4))
    assert not np.array_equal(a, order(2, 4))
    assert not np.array_equal(a, order(1, 4, epoch=1))
    assert not np.array_equal(a, order(1, 5))
    # The shard order changes between epochs, so blocks are regrouped rather than replayed.
    first_block = lambda o: set(_shard_of(counts, o[: 4 * 30]).tolist())  # noqa: E731
    assert first_block(a) != first_block(order(1, 4, epoch=1))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_block_rank_slices_reassemble_the_global_batch_and_resume_at_another_world_size(world):
    counts, batch = [7, 13, 0, 21, 5, 9, 30, 2], 12
    n = sum(counts)
    kw = dict(global_batch=batch, seed=5, shard_windows=counts, block_shards=3)
    ref = GlobalSampler(n, **kw)
    for step in [0, 1, 6, 7, 8, 40]:  # 7 crosses the first epoch boundary (87 windows / 12)
        parts = [GlobalSampler(n, **kw).rank_slice(step, r, world) for r in range(world)]
        assert [i for p in parts for i in p] == ref.global_batch(step)
    first = GlobalSampler(n, **kw)
    for step in range(9):
        first.rank_slice(step, 0, 2)
    resumed = GlobalSampler(n, **kw)
    resumed.load_state_dict(first.state_dict())
    step = resumed.next_step
    assert step == 9
    got = [i for r in range(world) for i in resumed.rank_slice(step, r, world)]
    assert got == GlobalSampler(n, **kw).global_batch(9)


def test_upcoming_shards_lists_the_current_block_then_the_next_across_epochs():
    counts, block, batch = [25] * 10, 2, 10  # 5 blocks of 50 windows: 5 steps per block
    n = sum(counts)
    s = GlobalSampler(n, global_batch=batch, seed=8, shard_windows=counts, block_shards=block)
    for step in range(3 * n // batch):
        ahead = s.upcoming_shards(step, 2 * block)
        assert len(ahead) == 2 * block and len(set(ahead)) == 2 * block
        now = set(_shard_of(counts, s.global_batch(step)).tolist())
        assert now <= set(ahead[:block])  # what this step reads is in the first block listed
        nxt = set(_shard_of(counts, s.global_batch(step + 5)).tolist())
        assert nxt <= set(ahead)  # five steps on (the next block) is covered too
    # Shards without windows are never listed.
    z = GlobalSampler(20, global_batch=4, seed=0, shard_windows=[10, 0, 10], block_shards=1)
    assert sorted(z.upcoming_shards(0, 10)) == [0, 2]
    with pytest.raises(ValueError, match="without shard_windows"):
        GlobalSampler(20, global_batch=4).upcoming_shards(0, 2)


def test_a_run_builds_each_epochs_layout_once(monkeypatch):
    """The trainer's steps (rank_slice, then upcoming_shards for two blocks) over three epochs of 5 shards in one
    block, the tiny preset's shape: asking for more shards than there are stops the walk at the 5 there are, so
    each epoch's block layout is built once (not again every step, as a walk into the epochs after it would); the
    walk past an epoch's last block looks at the next epoch's layout, so epoch 3's is built too."""
    from trainer.data import sampler as sampler_module

    built = []

    class Counted(sampler_module._EpochLayout):
        def __init__(self, shard_windows, block_shards, seed, epoch):
            built.append(epoch)
            super().__init__(shard_windows, block_shards, seed, epoch)

    monkeypatch.setattr(sampler_module, "_EpochLayout", Counted)
    counts = [40, 40, 40, 40, 4]
    s = GlobalSampler(sum(counts), global_batch=8, seed=2, shard_windows=counts, block_shards=8)
    for step in range(3 * sum(counts) // 8):
        s.rank_slice(step, 0, 1)
        assert sorted(s.upcoming_shards(step, 16)) == [0, 1, 2, 3, 4]
    assert built == [0, 1, 2, 3]


def test_whole_dataset_shuffle_is_the_keyed_permutation_of_window_indices():
    n = 1000
    s = GlobalSampler(n, global_batch=10, seed=4)
    assert np.array_equal(s.windows_at(np.arange(n, 2 * n)), FeistelPermutation(n, 4, 1)(np.arange(n)))


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ({"epoch": 0, "index": 0, "block_shards": 2}, "'block_shards' is 2 but this run has 3"),
        ({"epoch": 0, "index": 0, "num_shards": 0}, "'num_shards' is 0 but this run has 4"),
    ],
)
def test_block_layout_change_is_rejected_on_resume(state, needle):
    s = GlobalSampler(40, global_batch=8, seed=1, shard_windows=[10] * 4, block_shards=3)
    with pytest.raises(SamplerStateError, match=needle):
        s.load_state_dict(state)


def test_shard_windows_must_add_up():
    with pytest.raises(ValueError, match="add up to 9 windows but num_windows is 10"):
        GlobalSampler(10, global_batch=2, shard_windows=[4, 5])
