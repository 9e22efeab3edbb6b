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
    assert s.epoch_of(n // b + 1) == 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_reassemble_the_global_batch(world):
    n, b = 501, 12
    ref = GlobalSampler(n, global_batch=b, seed=9)
    for step in [0, 1, 41, 42, 43, 500]:  # 41..43 cross the first epoch boundary (501 / 12)
        per_rank = [GlobalSampler(n, global_batch=b, seed=9).rank_slice(step, r, world) for r in range(world)]
        assert all(len(p) == b // world for p in per_rank)
        assert [i for p in per_rank for i in p] == ref.global_batch(step)


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
