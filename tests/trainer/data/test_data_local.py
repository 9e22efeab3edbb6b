"""Data path pieces that need no S3: packing, windows, synthetic data, the cache, BPE, the CLI.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_local.py -q``
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

from gpu_train.storage import FileStore, open_store
from trainer.data import ManifestError, ShardIntegrityError, open_dataset
from trainer.data.__main__ import main as cli
from trainer.data.cache import CacheRef, ShardCache
from trainer.data.manifest import Manifest
from trainer.data.pack import pack_documents
from trainer.data.prepare import prepare, synth
from trainer.data.shards import open_sharded, read_manifest
from trainer.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe


def _docs(lengths: list[int]) -> list[np.ndarray]:
    return [np.full(n, i + 1, dtype=np.uint16) for i, n in enumerate(lengths)]


def test_pack_cuts_shards_at_document_starts_and_splits_giant_documents():
    shards = list(pack_documents(_docs([3, 4, 2, 12, 1]), eot_id=0, shard_tokens=8, dtype="uint16"))
    # docs+EOT: 4, 5, 3, 13, 2 tokens; the 13 is cut into 8 + 5 and the 5-token tail shares a shard
    assert [t.size for t, _ in shards] == [4, 8, 8, 7]
    assert [d.tolist() for _, d in shards] == [[0], [0, 5], [0], [0, 5]]
    np.testing.assert_array_equal(shards[1][0], [2, 2, 2, 2, 0, 3, 3, 0])
    joined = np.concatenate([t for t, _ in shards])
    assert (joined == 0).sum() == 5 and joined.size == 4 + 5 + 3 + 13 + 2


def test_synthetic_dataset_is_deterministic_contiguous_and_low_entropy():
    a = open_dataset("synthetic", context=64)
    b = open_dataset("synthetic", context=64)
    assert a.num_windows > 10_000 and a.vocab_size == 257 and a.eot_id == 256
    assert a.manifest_sha256 == b.manifest_sha256
    np.testing.assert_array_equal(a.batch(range(50)), b.batch(range(50)))
    assert open_dataset("synthetic", context=64, seed=1).manifest_sha256 != a.manifest_sha256
    # Packed windows tile the stream, sharing one token at each seam.
    w0, w1 = a.window(0), a.window(1)
    assert w0[-1] == w1[0]
    # Learnable: the next byte given the previous three is nearly determined (< 1 bit on average).
    stream = np.concatenate([a.window(i)[:-1] for i in range(2000)])
    ctx = stream[:-3] * 65536 + stream[1:-2] * 256 + stream[2:-1]
    pairs = ctx * 512 + stream[3:]
    _, pair_counts = np.unique(pairs, return_counts=True)
    _, ctx_counts = np.unique(ctx, return_counts=True)
    h_joint = -(pair_counts / pairs.size * np.log2(pair_counts / pairs.size)).sum()
    h_ctx = -(ctx_counts / ctx.size * np.log2(ctx_counts / ctx.size)).sum()
    assert h_joint - h_ctx < 1.0


def test_unpacked_windows_never_cross_a_document_boundary():
    packed = open_dataset("synthetic", context=128)
    ds = open_dataset("synthetic", context=128, packing=False)
    assert 0 < ds.num_windows < packed.num_windows
    for i in range(0, ds.num_windows, 7):
        w = ds.window(i)
        assert 256 not in w[:-1].tolist()


@pytest.mark.parametrize("packing", [True, False])
def test_a_batch_is_its_windows_read_one_by_one_in_the_order_asked(packing):
    ds = open_dataset("synthetic", context=32, packing=packing)
    assert ds.num_shards > 2
    rng = np.random.default_rng(0)
    # Across every shard, out of order, repeated, the first and last windows included.
    idx = [ds.num_windows - 1, 0, *rng.integers(0, ds.num_windows, 200).tolist(), 0]
    got = ds.batch(iter(idx))
    assert got.shape == (len(idx), 33) and got.dtype == np.int64
    np.testing.assert_array_equal(got, np.stack([ds.window(i) for i in idx]))
    assert ds.batch([]).shape == (0, 33)
    with pytest.raises(IndexError, match=f"window {ds.num_windows} out of range"):
        ds.batch([3, ds.num_windows, -1])


def test_synth_on_disk_matches_in_memory_synthetic(tmp_path):
    synth(f"file://{tmp_path}/syn", tokens=1 << 20, seed=0)
    mem = open_dataset("synthetic", context=64)
    with open_dataset(f"file://{tmp_path}/syn", context=64, cache_dir=str(tmp_path / "c")) as disk:
        assert disk.num_windows == mem.num_windows
        idx = np.random.default_rng(0).integers(0, mem.num_windows, size=200)
        np.testing.assert_array_equal(disk.batch(idx), mem.batch(idx))


def _shard_refs(tmp_path: Path, n: int, size: int) -> tuple[FileStore, list[CacheRef]]:
    store = FileStore(tmp_path / "src")
    refs = []
    for i in range(n):
        data = np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()
        store.put_bytes(f"s{i}.bin", data)
        refs.append(CacheRef(f"s{i}.bin", size, hashlib.sha256(data).hexdigest()))
    return store, refs


def test_lru_eviction_respects_budget_and_never_evicts_a_pinned_shard(tmp_path):
    store, refs = _shard_refs(tmp_path, 5, 1000)
    cache = ShardCache(tmp_path / "cache", max_bytes=2500)
    pinned = cache.acquire(store, refs[0])  # oldest, but in use
    cache.fetch(store, refs[1])
    cache.fetch(store, refs[2])  # 3000 > 2500: evicts s1 (LRU, unpinned), not s0
    assert pinned.exists() and not cache.path_of(refs[1]).exists() and cache.path_of(refs[2]).exists()
    assert cache.total_bytes() <= 2500
    cache.fetch(store, refs[2])  # a hit refreshes s2
    cache.fetch(store, refs[3])  # evicts s2? no: s0 pinned, s2 is the only other -> evicted
    assert cache.total_bytes() <= 2500 and pinned.exists()
    cache.release(refs[0])  # the end of a use: s0 is now the most recently used
    cache.fetch(store, refs[4])  # evicts s3
    assert pinned.exists() and not cache.path_of(refs[3]).exists() and cache.path_of(refs[4]).exists()
    cache.fetch(store, refs[1])  # s0 is unpinned and least recently used now
    assert not pinned.exists() and cache.path_of(refs[4]).exists()
    assert cache.total_bytes() <= 2500
    assert cache.stats.evictions == 4


def test_pins_of_dead_processes_do_not_block_eviction(tmp_path):
    store, refs = _shard_refs(tmp_path, 2, 1000)
    cache = ShardCache(tmp_path / "cache", max_bytes=1500)
    cache.fetch(store, refs[0])
    dead = mp.get_context("spawn").Process(target=os.getpid)
    dead.start()
    dead.join()
    (cache.pins / f"{refs[0].sha256}.{dead.pid}").touch()  # a worker that crashed while holding the shard
    cache.fetch(store, refs[1])
    assert not cache.path_of(refs[0]).exists()


def _crash_mid_download(cache_dir: str, src: str, ref: CacheRef) -> None:
    """Child process: write half a shard into the cache's temp area, then die without cleanup."""

    class Dying(FileStore):
        def download(self, key, dest_path):
            data = self.get_bytes(key)
            Path(dest_path).write_bytes(data[: len(data) // 2])
            os._exit(9)

    ShardCache(cache_dir).fetch(Dying(Path(src)), ref)


def test_partial_download_from_a_crashed_process_is_never_used(tmp_path):
    store, refs = _shard_refs(tmp_path, 1, 4096)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_crash_mid_download, args=(str(tmp_path / "cache"), str(store.root), refs[0]))
    child.start()
    child.join()
    assert child.exitcode == 9
    tmp_files = list((tmp_path / "cache" / "tmp").iterdir())
    assert len(tmp_files) == 1 and tmp_files[0].stat().st_size == 2048
    cache = ShardCache(tmp_path / "cache")  # start-up cleans the dead writer's temp file
    assert list(cache.tmp.iterdir()) == []
    path = cache.fetch(store, refs[0])
    assert cache.stats.downloads == 1 and cache.stats.hits == 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == refs[0].sha256


def test_truncated_cache_object_is_downloaded_again(tmp_path):
    store, refs = _shard_refs(tmp_path, 1, 4096)
    cache = ShardCache(tmp_path / "cache")
    path = cache.fetch(store, refs[0])
    path.write_bytes(path.read_bytes()[:100])  # e.g. a disk error after the fact
    assert cache.fetch(store, refs[0]).stat().st_size == 4096
    assert cache.stats.downloads == 2


def test_integrity_failure_with_file_store_leaves_nothing_behind(tmp_path):
    store, refs = _shard_refs(tmp_path, 1, 512)
    bad = CacheRef(refs[0].key, refs[0].size, "0" * 64)
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(ShardIntegrityError, match=f"s0.bin at file://{store.root}/s0.bin: sha256"):
        cache.fetch(store, bad)
    assert list(cache.objects.iterdir()) == [] and list(cache.tmp.iterdir()) == []


def test_bpe_round_trip_and_prepare_with_bpe(tmp_path):
    texts = [
        f"the quick brown fox {i} jumps over the lazy dog. caf\u00e9 \u00fcber na\u00efve\n" * 20
        for i in range(30)
    ]
    tok = train_bpe(texts, vocab_size=400)
    assert tok.vocab_size <= 400 and tok.eot_id is not None
    for t in texts[:3] + ["unseen w\u00f6rds \u2713 and emoji \U0001f600"]:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
    assert len(tok.encode(texts[0])) < len(texts[0].encode()) / 2  # merges learned

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, t in enumerate(texts):
        (corpus / f"{i:02d}.txt").write_text(t)
    m = prepare(
        [corpus], f"file://{tmp_path}/bpe", tokenizer="bpe", vocab_size=400, workers=2, shard_tokens=2000
    )
    assert m.tokenizer.kind == "bpe" and m.tokenizer.file is not None and m.dtype == "uint16"
    store = open_store(f"file://{tmp_path}/bpe")
    loaded = load_tokenizer(read_manifest(store, "manifest.json")[0], store)
    with open_sharded(
        f"file://{tmp_path}/bpe", context=16, cache_dir=str(tmp_path / "c"), packing=False
    ) as ds:
        arr = np.concatenate([np.asarray(ds._source.array(s)) for s in range(ds.num_shards)])
    docs = np.split(arr, np.flatnonzero(arr == loaded.eot_id) + 1)[:-1]
    assert [loaded.decode(d) for d in docs] == texts


def test_manifest_sha_mismatch_of_bpe_tokenizer_is_reported(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("hello world " * 50)
    prepare([tmp_path / "c"], f"file://{tmp_path}/o", tokenizer="bpe", vocab_size=300, workers=1)
    (tmp_path / "o" / "tokenizer.json").write_text("{}")
    store = open_store(f"file://{tmp_path}/o")
    with pytest.raises(
        ManifestError, match="tokenizer.json: sha256 differs from manifest key 'tokenizer.sha256'"
    ):
        load_tokenizer(read_manifest(store, "manifest.json")[0], store)


def _valid_manifest() -> dict:
    return {
        "format": "gpu-train-token-shards",
        "version": 1,
        "tokenizer": {"kind": "byte", "vocab_size": 257, "eot_id": 256},
        "dtype": "uint16",
        "shards": [
            {
                "file": "shard-000000.bin", "tokens": 10, "bytes": 20, "sha256": "a" * 64, "documents": 1,
                "index": {"file": "shard-000000.idx", "bytes": 8, "sha256": "b" * 64},
            }
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m.update(version=2), "key 'version' is 2"),
        (lambda m: m["tokenizer"].update(eot_id=300), "key 'tokenizer.eot_id' (300)"),
        (lambda m: m.update(dtype="int8"), "key 'dtype' must be one of"),
        (lambda m: m["shards"][0].update(bytes=21), "key 'shards[0].bytes' (21) != tokens (10)"),
        (lambda m: m["shards"][0].update(sha256="XYZ"), "key 'shards[0].sha256' is not a lowercase sha256"),
        (lambda m: m["shards"][0].update(file="../etc/passwd"), "key 'shards[0].file'"),
        (lambda m: m["shards"][0].update(tokens=True), "key 'shards[0].tokens' must be int"),
        (lambda m: m["shards"][0]["index"].update(bytes=16), "key 'shards[0].index.bytes' (16)"),
        (lambda m: m.update(shards=[]), "key 'shards' is empty"),
    ],
)
def test_manifest_validation_names_the_key(edit, needle):
    doc = _valid_manifest()
    Manifest.parse(json.dumps(doc).encode(), uri="s3://b/ds/manifest.json")
    edit(doc)
    with pytest.raises(ManifestError) as info:
        Manifest.parse(json.dumps(doc).encode(), uri="s3://b/ds/manifest.json")
    assert needle in str(info.value) and "s3://b/ds/manifest.json" in str(info.value)


def test_cli_prepare_verify_and_errors(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"abc" * 100)
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "first doc"}\n{"text": "second doc"}\n')
    assert cli(["prepare", str(tmp_path / "in"), "--out", f"file://{tmp_path}/ds", "--workers", "2"]) == 0
    assert "3 documents" in capsys.readouterr().out
    with open_dataset(f"file://{tmp_path}/ds/manifest.json", context=4, cache_dir=str(tmp_path / "c")) as ds:
        text = ByteTokenizer().decode(np.concatenate([ds._source.array(0)]))
    assert text == "abc" * 100 + "first doc" + "second doc"
    assert cli(["verify", f"file://{tmp_path}/ds"]) == 0
    assert "ok:" in capsys.readouterr().out
    (tmp_path / "ds" / "shard-000000-000000.bin").write_bytes(b"\0\0" * 303)
    assert cli(["verify", f"file://{tmp_path}/ds"]) == 2
    assert f"file://{tmp_path}/ds/shard-000000-000000.bin" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    assert (
        cli(["prepare", str(tmp_path / "bad.jsonl"), "--out", f"file://{tmp_path}/x", "--workers", "1"]) == 2
    )
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert cli(["prepare", str(tmp_path / "nope"), "--out", f"file://{tmp_path}/x"]) == 2


def test_start_up_cleanup_keeps_temp_files_of_live_writers(tmp_path):
    cache = ShardCache(tmp_path / "cache")
    sha = "c" * 64
    live = cache.tmp / f"{sha}.{os.getpid()}.1234abcd.part"
    # A boto3/s3transfer temp name inside our own temp name: suffixes must not be read as a pid.
    nested = cache.tmp / f".{sha}.{os.getpid()}.1234abcd.part.{os.getpid()}.99999999.part.12345678"
    for p in (live, nested):
        p.write_bytes(b"partial")
    ShardCache(tmp_path / "cache")
    assert live.exists() and nested.exists()
