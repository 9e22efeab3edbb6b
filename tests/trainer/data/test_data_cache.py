"""Cached bytes are trusted only when proven: in-place corruption, seals, ``verify --cache-dir``, budgets.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_cache.py -q``
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest

from gpu_train.storage import open_store
from trainer.data import DataError, ShardIntegrityError, open_dataset
from trainer.data.__main__ import main as cli
from trainer.data.cache import CacheRef, SealBook, ShardCache, budget_from_disk, disk_budget
from trainer.data.prepare import synth

CONTEXT = 32
TOKENS, SHARD = 1 << 14, 1 << 12


@pytest.fixture
def s3_dataset(bucket: str, moto_endpoint: str) -> str:
    uri = f"s3://{bucket}/ds"
    synth(uri, tokens=TOKENS, seed=5, shard_tokens=SHARD, val_tokens=0, endpoint_url=moto_endpoint)
    return uri


def _open(uri: str, proxy, cache: Path, **kw):
    kw.setdefault("read_mode", "disk")
    return open_dataset(uri, context=CONTEXT, cache_dir=str(cache), endpoint_url=proxy.endpoint, **kw)


def _flip_one_byte(path: Path, offset: int = 10) -> None:
    """In-place corruption that keeps the size: what a bad disk or a stray writer does."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_in_place_corruption_is_detected_dropped_and_fetched_again(s3_dataset, proxy, tmp_path, caplog):
    cache = tmp_path / "cache"
    with _open(s3_dataset, proxy, cache) as ds:
        expected = ds.batch(range(ds.num_windows))
        victim = ds.manifest.shards[1]
        window = next(i for i in range(ds.num_windows) if ds.locate(i)[0] == 1)
    obj = cache / "objects" / victim.data.sha256
    size = obj.stat().st_size
    _flip_one_byte(obj)
    assert obj.stat().st_size == size
    proxy.reset()
    caplog.set_level(logging.WARNING, logger="trainer.data.cache")
    with _open(s3_dataset, proxy, cache) as ds:  # a new process's first use of the cached copy
        np.testing.assert_array_equal(ds.window(window), expected[window])
        assert ds.cache.stats.corrupt_dropped == 1
        np.testing.assert_array_equal(ds.batch(range(ds.num_windows)), expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(victim.data.file in w and "failed verification" in w for w in warnings), warnings
    assert len(proxy.gets(victim.data.file)) == 1  # fetched again, once
    assert sum(len(proxy.gets(s.data.file)) for s in ds.manifest.shards) == 1  # the others were trusted


def test_verify_hashes_the_cache_and_fails_on_a_corrupt_copy(s3_dataset, proxy, tmp_path, capsys):
    cache = tmp_path / "cache"
    args = ["--endpoint-url", proxy.endpoint, "verify", s3_dataset, "--cache-dir", str(cache)]
    assert cli(args) == 0
    assert "ok:" in capsys.readouterr().out
    victim = sorted((cache / "objects").iterdir())[0]
    _flip_one_byte(victim)
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert str(victim) in err and "did not match its sha256" in err and "failed verification" in err
    assert len(err.strip().splitlines()) == 2  # one line for the shard, one summary line
    assert cli(args) == 0  # the bad copy was dropped and fetched again
    assert "ok:" in capsys.readouterr().out


def test_unchanged_cache_is_proven_by_seals_without_hashing(s3_dataset, proxy, tmp_path):
    cache = tmp_path / "cache"
    with _open(s3_dataset, proxy, cache) as ds:
        ds.batch(range(ds.num_windows))
        n = ds.num_shards
        assert ds.cache.stats.downloads == n
    with _open(s3_dataset, proxy, cache) as ds:
        ds.batch(range(ds.num_windows))
        assert (ds.cache.stats.seal_hits, ds.cache.stats.hashes) == (n, 0)
    with _open(s3_dataset, proxy, cache, verify="full") as ds:
        ds.batch(range(ds.num_windows))
        assert (ds.cache.stats.seal_hits, ds.cache.stats.hashes) == (0, n)


def test_full_verification_catches_what_a_forged_seal_hides(s3_dataset, proxy, tmp_path):
    """Seals prove 'not written since hashed'; only a full hash catches bytes changed behind the file
    system's back. Simulated by corrupting a copy and re-sealing it with its new identity."""
    cache = tmp_path / "cache"
    with _open(s3_dataset, proxy, cache) as ds:
        expected = ds.window(0)
        sha = ds.manifest.shards[0].data.sha256
    obj = cache / "objects" / sha
    _flip_one_byte(obj, offset=2)  # inside window 0
    SealBook(cache / "seals").record(obj, sha, obj.stat())
    with _open(s3_dataset, proxy, cache) as ds:
        assert not np.array_equal(ds.window(0), expected)  # the documented limit of the cheap check
    with _open(s3_dataset, proxy, cache, verify="full") as ds:
        np.testing.assert_array_equal(ds.window(0), expected)
        assert ds.cache.stats.corrupt_dropped == 1


def test_direct_reads_of_local_datasets_copy_nothing_and_hash_once(tmp_path):
    uri = f"file://{tmp_path}/ds"
    synth(uri, tokens=TOKENS, seed=5, shard_tokens=SHARD, val_tokens=0)
    cache = tmp_path / "cache"
    with open_dataset(uri, context=CONTEXT, cache_dir=str(cache)) as ds:
        assert ds.read_mode == "direct"
        expected = ds.batch(range(ds.num_windows))
        assert ds._source.hashes == ds.num_shards
    assert not (cache / "objects").exists()  # nothing copied
    with open_dataset(uri, context=CONTEXT, cache_dir=str(cache)) as ds:  # the next run
        np.testing.assert_array_equal(ds.batch(range(ds.num_windows)), expected)
        assert ds._source.hashes == 0
    _flip_one_byte(tmp_path / "ds" / "shard-000002.bin")
    with open_dataset(uri, context=CONTEXT, cache_dir=str(cache)) as ds:
        window = next(i for i in range(ds.num_windows) if ds.locate(i)[0] == 2)
        with pytest.raises(ShardIntegrityError, match=f"shard-000002.bin at {uri}/shard-000002.bin: sha256"):
            ds.window(window)


def test_budget_from_disk_is_a_share_of_the_disk_bounded_by_free_space():
    gib = 1 << 30
    # Half of a 1000 GiB disk, if that much is free (800 free + 0 cached - 50 reserve = 750 >= 500).
    assert (
        budget_from_disk(total=1000 * gib, free=800 * gib, cached=0, fraction=0.5, reserve=50 * gib)
        == 500 * gib
    )
    # A fuller disk: what the cache holds plus what is free, minus the reserve (100 + 200 - 50).
    assert budget_from_disk(total=1000 * gib, free=200 * gib, cached=100 * gib, fraction=0.5,
                            reserve=50 * gib) == 250 * gib  # fmt: skip
    assert budget_from_disk(total=1000 * gib, free=10 * gib, cached=0, fraction=0.5, reserve=50 * gib) == 0
    with pytest.raises(ValueError, match="fraction"):
        budget_from_disk(total=1, free=1, cached=0, fraction=1.5, reserve=0)


def test_disk_budget_of_this_machine_fits_in_its_free_space(tmp_path):
    import shutil

    budget = disk_budget(tmp_path / "not-yet" / "cache", 0.5)
    usage = shutil.disk_usage(tmp_path)
    assert 0 <= budget <= min(usage.total // 2, usage.free)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"read_mode": "fast"}, "read mode must be one of"),
        ({"verify": "maybe"}, "verify mode must be one of"),
        ({"cache_max_bytes": -1}, "cache_max_bytes must be >= 0"),
        ({"split": "test"}, "split must be one of"),
        ({"read_mode": "direct"}, "needs a file:// dataset"),
    ],
)
def test_bad_settings_are_data_errors_naming_them(s3_dataset, proxy, tmp_path, kw, needle):
    with pytest.raises(DataError, match=needle):
        _open(s3_dataset, proxy, tmp_path / "c", **kw)


def test_unwritable_cache_directory_is_a_data_error(tmp_path):
    (tmp_path / "file").write_text("x")
    uri = f"file://{tmp_path}/ds"
    synth(uri, tokens=TOKENS, seed=5, shard_tokens=SHARD, val_tokens=0)
    with pytest.raises(DataError, match=f"{tmp_path}/file/c/seals: not a writable directory"):
        open_dataset(uri, context=CONTEXT, cache_dir=str(tmp_path / "file" / "c"))
    with pytest.raises(DataError, match=f"shard cache {tmp_path}/file/c: not a writable directory"):
        open_dataset(uri, context=CONTEXT, cache_dir=str(tmp_path / "file" / "c"), read_mode="disk")


def test_missing_val_split_and_too_short_dataset_are_named(s3_dataset, proxy, tmp_path):
    with pytest.raises(DataError, match=f"{s3_dataset}/manifest.json: the dataset has no val split"):
        _open(s3_dataset, proxy, tmp_path / "c", split="val")
    with pytest.raises(
        DataError,
        match=r"\(train split\): no window of context \+ 1 = 5001 tokens fits \(its longest shard has \d+ tokens",
    ):
        open_dataset(s3_dataset, context=5000, cache_dir=str(tmp_path / "c"), endpoint_url=proxy.endpoint)


def test_a_download_finishing_while_space_is_reserved_is_counted_and_the_budget_holds(tmp_path):
    """A download in flight moves its object into the cache, then drops its reservation. When that happens
    while another download reserves space, the finished object must still be counted: the cache then evicts for
    the new shard and never holds more than its budget."""
    src = tmp_path / "store"
    src.mkdir()
    refs = {}
    for name in ("a", "b", "c"):
        data = bytes([ord(name)]) * 1000
        (src / name).write_bytes(data)
        refs[name] = CacheRef(name, len(data), hashlib.sha256(data).hexdigest())
    store = open_store(f"file://{src}")
    cache = ShardCache(tmp_path / "cache", max_bytes=2000)  # room for two of the three
    cache.fetch(store, refs["a"])
    # b is being downloaded by another worker: its space is reserved, its file not in the cache yet.
    cache._reservation(refs["b"]).write_text(str(refs["b"].size))
    read_reservations = cache._reserved_bytes

    def finish_b_then_read() -> int:
        # b's download ends just before the reservations are read: its file lands, its reservation goes.
        (cache.objects / refs["b"].sha256).write_bytes((src / "b").read_bytes())
        cache._unreserve(refs["b"])
        return read_reservations()

    cache._reserved_bytes = finish_b_then_read
    cache.fetch(store, refs["c"])
    assert cache.total_bytes() <= 2000, sorted(p.name[:8] for p in cache.objects.iterdir())
    assert (cache.objects / refs["c"].sha256).exists() and cache.stats.evictions == 1
