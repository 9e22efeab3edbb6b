"""A dataset several times larger than the shard cache, read through it epoch after epoch.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_scale.py -q``

The sampler and the dataset are driven the way the training loop drives them: every rank reads its slice
of each global batch and asks for the shards of the upcoming blocks in the background. GETs are counted on
the wire, at the HTTP proxy in front of the local S3 server.
"""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data import GlobalSampler, open_dataset
from trainer.data.prepare import synth
from trainer.data.synthetic import synthetic_shards

# Reads datasets larger than the cache from a local S3 server.
pytestmark = pytest.mark.integration

CONTEXT = 32
SHARD_TOKENS = 2048
TOKENS = 24 * SHARD_TOKENS
BATCH = 12


@pytest.fixture
def big_dataset(bucket: str, moto_endpoint: str) -> tuple[str, list[np.ndarray]]:
    uri = f"s3://{bucket}/big"
    m = synth(uri, tokens=TOKENS, seed=3, shard_tokens=SHARD_TOKENS, val_tokens=0, endpoint_url=moto_endpoint)
    assert len(m.shards) >= 24
    # The reference: the same token stream, generated in memory, never through storage or a cache.
    arrays = [t.astype(np.int64) for t, _ in synthetic_shards(TOKENS, seed=3, shard_tokens=SHARD_TOKENS)]
    return uri, arrays


def _reference_window(arrays: list[np.ndarray], i: int) -> np.ndarray:
    counts = np.array([(a.size - 1) // CONTEXT for a in arrays])
    s = int(np.searchsorted(np.cumsum(counts), i, side="right"))
    off = (i - int(np.concatenate([[0], np.cumsum(counts)])[s])) * CONTEXT
    return arrays[s][off : off + CONTEXT + 1]


def _open(uri: str, proxy, cache, budget: int):
    return open_dataset(uri, context=CONTEXT, cache_dir=str(cache), cache_max_bytes=budget, prefetch_shards=2,
                        endpoint_url=proxy.endpoint, read_mode="disk", max_open_shards=2)  # fmt: skip


def test_dataset_four_times_the_cache_downloads_each_shard_once_per_epoch(big_dataset, proxy, tmp_path):
    uri, arrays = big_dataset
    shard_bytes = max(a.size for a in arrays) * 2
    budget = 6 * shard_bytes  # the dataset is 24 shards: four times the budget
    block, epochs, world = 2, 2, 2
    with _open(uri, proxy, tmp_path / "cache", budget) as ds:
        assert ds.num_shards * shard_bytes >= 4 * budget
        sampler = GlobalSampler(ds.num_windows, global_batch=BATCH, seed=7,
                                shard_windows=ds.shard_windows, block_shards=block)  # fmt: skip
        n = ds.num_windows
        steps = -(-epochs * n // BATCH)  # the last one ends past the last epoch: only its head is read
        read: list[int] = []
        for step in range(steps):
            ds.fetch_ahead(sampler.upcoming_shards(step, 2 * block, end_step=steps - 1))
            for rank in range(world):
                idx = sampler.rank_slice(step, rank, world)
                first = step * BATCH + rank * (BATCH // world)
                idx = idx[: max(0, epochs * n - first)]
                batch = ds.batch(idx)
                for i, row in zip(idx, batch, strict=True):
                    np.testing.assert_array_equal(row, _reference_window(arrays, i))
                read += idx
            assert ds.cache.total_bytes() <= budget
        for e in range(epochs):  # every window of each epoch was read, once
            assert sorted(read[e * n : (e + 1) * n]) == list(range(n))
        files = [s.file for s in ds.manifest.shards]
    gets = {f: len(proxy.gets(f)) for f in files}
    assert all(1 <= g <= epochs for g in gets.values()), {f: g for f, g in gets.items() if g > epochs}
    assert sum(gets.values()) <= epochs * len(files)


def test_whole_dataset_shuffle_thrashes_the_same_cache(big_dataset, proxy, tmp_path):
    """The reference point: the same budget with the old global shuffle re-downloads constantly."""
    uri, _ = big_dataset
    with _open(uri, proxy, tmp_path / "cache", 6 * SHARD_TOKENS * 2) as ds:
        sampler = GlobalSampler(ds.num_windows, global_batch=BATCH, seed=7)
        steps = 8  # 96 of the ~1500 windows of an epoch
        for step in range(steps):
            ds.prefetch(sampler.global_batch(step + 1))
            ds.batch(sampler.global_batch(step))
        files = [s.file for s in ds.manifest.shards]
    total = sum(len(proxy.gets(f)) for f in files)
    assert total > 2 * len(files)  # > 2 downloads per shard in 1/16 of an epoch


def test_resume_on_fresh_nodes_with_another_world_size_reads_the_same_batches(big_dataset, proxy, tmp_path):
    uri, arrays = big_dataset
    budget = 6 * SHARD_TOKENS * 2
    with _open(uri, proxy, tmp_path / "a", budget) as ds:
        kw = dict(global_batch=BATCH, seed=7, shard_windows=ds.shard_windows, block_shards=2)
        total = ds.num_windows // BATCH + 30  # past the first epoch boundary
        ref = GlobalSampler(ds.num_windows, **kw)
        expected = [ref.global_batch(s) for s in range(total)]
        first = GlobalSampler(ds.num_windows, **kw)
        for step in range(total - 20):
            for rank in range(2):
                ds.batch(first.rank_slice(step, rank, 2))
        state = first.state_dict()
    # A new "node": an empty cache, three ranks, the sampler state from the checkpoint.
    with _open(uri, proxy, tmp_path / "b", budget) as ds:
        resumed = GlobalSampler(ds.num_windows, **kw)
        resumed.load_state_dict(state)
        for step in range(resumed.next_step, total):
            got = [i for rank in range(3) for i in resumed.rank_slice(step, rank, 3)]
            assert got == expected[step]
            rows = ds.batch(got)
            np.testing.assert_array_equal(rows, np.stack([_reference_window(arrays, i) for i in got]))
