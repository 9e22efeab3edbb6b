"""prepare -> S3 (moto over real HTTP) -> cache -> windows, with faults injected by the proxy.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_s3.py -q``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import boto3
import numpy as np
import pytest

from gpu_train.storage import RetryPolicy, StorageError, StoreOptions, open_store
from trainer.data import ManifestError, ShardError, ShardIntegrityError, ShardMissingError, open_dataset
from trainer.data.prepare import prepare
from trainer.data.shards import open_sharded

# Reads shards from a local S3 server.
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
CONTEXT = 32
FAST_RETRY = RetryPolicy(attempts=4, base_s=0.05, cap_s=0.2)


def _corpus(root: Path, n_files: int = 5) -> list[bytes]:
    rng = np.random.default_rng(7)
    texts = []
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        words = [b"alpha", b"beta", b"gamma", b"delta", "\u00e9t\u00e9".encode()]
        body = b" ".join(words[j] for j in rng.integers(0, len(words), size=int(rng.integers(300, 900))))
        (root / f"doc{i:02d}.txt").write_bytes(body)
        texts.append(body)
    return texts


def _expected_stream(texts: list[bytes]) -> np.ndarray:
    parts = []
    for t in texts:
        parts += [np.frombuffer(t, dtype=np.uint8).astype(np.int64), np.array([256])]
    return np.concatenate(parts)


@pytest.fixture
def dataset_uri(tmp_path: Path, bucket: str, moto_endpoint: str) -> tuple[str, np.ndarray]:
    texts = _corpus(tmp_path / "corpus")
    uri = f"s3://{bucket}/ds"
    prepare([tmp_path / "corpus"], uri, shard_tokens=3000, workers=2, endpoint_url=moto_endpoint)
    return uri, _expected_stream(texts)


def _open(uri: str, proxy, cache: Path, **kw):
    opts = kw.pop("store_options", StoreOptions(max_attempts=3, connect_timeout=2, read_timeout=2))
    return open_sharded(
        uri, context=CONTEXT, cache_dir=str(cache), endpoint_url=proxy.endpoint, store_options=opts,
        retry=kw.pop("retry", FAST_RETRY), **kw,
    )  # fmt: skip


def test_prepare_upload_and_read_windows_through_cache(dataset_uri, proxy, tmp_path, moto_endpoint, bucket):
    uri, expected = dataset_uri
    # The shards in the bucket, fetched with plain boto3, are the byte tokens of the files in order.
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    manifest = json.loads(s3.get_object(Bucket=bucket, Key="ds/manifest.json")["Body"].read())
    assert manifest["tokenizer"] == {"kind": "byte", "vocab_size": 257, "eot_id": 256}
    assert len(manifest["shards"]) > 2
    stream = np.concatenate(
        [
            np.frombuffer(s3.get_object(Bucket=bucket, Key=f"ds/{s['file']}")["Body"].read(), "<u2")
            for s in manifest["shards"]
        ]
    ).astype(np.int64)
    np.testing.assert_array_equal(stream, expected)

    ds = _open(uri, proxy, tmp_path / "cache")
    starts = np.cumsum([0] + [s["tokens"] for s in manifest["shards"]])
    assert ds.num_windows == sum((s["tokens"] - 1) // CONTEXT for s in manifest["shards"])
    for i in range(ds.num_windows):
        s, off = ds.locate(i)
        w = ds.window(i)
        assert w.dtype == np.int64 and w.shape == (CONTEXT + 1,)
        np.testing.assert_array_equal(w, expected[starts[s] + off : starts[s] + off + CONTEXT + 1])
    ds.close()
    # Each shard was fetched exactly once.
    for s in manifest["shards"]:
        assert len(proxy.gets(s["file"])) == 1


def test_second_open_hits_cache_without_shard_gets(dataset_uri, proxy, tmp_path):
    uri, _ = dataset_uri
    with _open(uri, proxy, tmp_path / "cache") as ds:
        first = ds.batch(range(ds.num_windows))
        assert ds.cache.stats.downloads == ds.num_shards
    proxy.reset()
    with _open(uri, proxy, tmp_path / "cache") as ds:
        again = ds.batch(range(ds.num_windows))
        assert ds.cache.stats.downloads == 0 and ds.cache.stats.hits == ds.num_shards
    np.testing.assert_array_equal(first, again)
    assert proxy.gets(".bin") == []
    assert len(proxy.gets("manifest.json")) == 1  # the manifest is always read fresh


def test_corrupted_shard_is_rejected_and_not_cached(dataset_uri, proxy, tmp_path, moto_endpoint, bucket):
    uri, _ = dataset_uri
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    key = "ds/shard-000000-000001.bin"
    good = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=bytes([good[0] ^ 0xFF]) + good[1:])  # same size, bad hash
    cache = tmp_path / "cache"
    with _open(uri, proxy, cache) as ds:
        bad_window = next(i for i in range(ds.num_windows) if ds.locate(i)[0] == 1)
        with pytest.raises(ShardIntegrityError) as info:
            ds.window(bad_window)
    msg = str(info.value)
    assert "shard-000000-000001.bin" in msg and f"{uri}/shard-000000-000001.bin" in msg and "sha256" in msg
    assert info.value.uri == f"{uri}/shard-000000-000001.bin"
    sha = json.loads(s3.get_object(Bucket=bucket, Key="ds/manifest.json")["Body"].read())["shards"][1][
        "sha256"
    ]
    assert not (cache / "objects" / sha).exists()
    assert list((cache / "tmp").iterdir()) == []

    s3.put_object(Bucket=bucket, Key=key, Body=good[:-2])  # truncated: wrong size
    with _open(uri, proxy, cache) as ds, pytest.raises(ShardIntegrityError, match="size"):
        ds.window(bad_window)


def test_missing_shard_names_shard_and_uri(dataset_uri, proxy, tmp_path, moto_endpoint, bucket):
    uri, _ = dataset_uri
    boto3.client("s3", endpoint_url=moto_endpoint).delete_object(Bucket=bucket, Key="ds/shard-000000-000000.bin")
    with _open(uri, proxy, tmp_path / "cache") as ds, pytest.raises(ShardMissingError) as info:
        ds.window(0)
    assert f"{uri}/shard-000000-000000.bin" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"format": "gpu-train-token-shards", "version": 1}', "missing key 'tokenizer'"),
        (
            b'{"format": "gpu-train-token-shards", "version": 1, "dtype": "uint16", "shards": [{}],'
            b' "tokenizer": {"kind": "byte", "vocab_size": 257, "eot_id": 256}}',
            "missing key 'shards[0].tokens'",
        ),
    ],
)
def test_malformed_manifest_names_key_and_uri(proxy, bucket, tmp_path, moto_endpoint, raw, needle):
    boto3.client("s3", endpoint_url=moto_endpoint).put_object(
        Bucket=bucket, Key="bad/manifest.json", Body=raw
    )
    with pytest.raises(ManifestError) as info:
        _open(f"s3://{bucket}/bad", proxy, tmp_path / "cache")
    assert needle in str(info.value)
    assert f"s3://{bucket}/bad/manifest.json" in str(info.value)


def test_missing_manifest_is_a_manifest_error(proxy, bucket, tmp_path):
    with pytest.raises(
        ManifestError, match=f"s3://{bucket}/nothing/manifest.json: dataset manifest not found"
    ):
        _open(f"s3://{bucket}/nothing", proxy, tmp_path / "cache")


def test_injected_503s_are_retried(dataset_uri, proxy, tmp_path):
    uri, _ = dataset_uri
    # 3 failures on one shard: more than botocore's 2 attempts, so the outer shard retry must step in too.
    proxy.fail_next(3, status=503, match="shard-000000-000000.bin")
    opts = StoreOptions(max_attempts=2, connect_timeout=2, read_timeout=2)
    with _open(uri, proxy, tmp_path / "cache", store_options=opts) as ds:
        w = ds.window(0)
        assert ds.cache.stats.retries >= 1
    assert w.shape == (CONTEXT + 1,)
    failed = [r for r in proxy.records if r.status == 503]
    assert len(failed) == 3


def test_stalled_read_times_out_and_is_retried(dataset_uri, proxy, tmp_path):
    uri, expected = dataset_uri
    proxy.stall_next(1, seconds=2.5, match="shard-000000-000000.bin")
    opts = StoreOptions(max_attempts=3, connect_timeout=1, read_timeout=1)
    with _open(uri, proxy, tmp_path / "cache", store_options=opts) as ds:
        np.testing.assert_array_equal(ds.window(0), expected[: CONTEXT + 1])
    assert len(proxy.gets("shard-000000-000000.bin")) == 1  # the stalled attempt never completed


def test_persistent_outage_raises_storage_error_naming_uri(dataset_uri, proxy, tmp_path):
    uri, _ = dataset_uri
    proxy.fail_next(1000, status=500, match="shard-000000-000002.bin")
    opts = StoreOptions(max_attempts=1, connect_timeout=1, read_timeout=1)  # only the bounded outer retry
    with _open(uri, proxy, tmp_path / "cache", store_options=opts) as ds:
        idx = next(i for i in range(ds.num_windows) if ds.locate(i)[0] == 2)
        with pytest.raises(ShardError) as info:
            ds.window(idx)
        assert ds.cache.stats.retries == FAST_RETRY.attempts - 1
    assert f"{uri}/shard-000000-000002.bin" in str(info.value) and info.value.shard == "shard-000000-000002.bin"
    assert isinstance(info.value.__cause__, StorageError) and info.value.__cause__.transient


def test_store_ranged_reads_listing_multipart_and_delete(proxy, bucket, tmp_path):
    store = open_store(
        f"s3://{bucket}/objs",
        endpoint_url=proxy.endpoint,
        options=StoreOptions(multipart_threshold=5 << 20, multipart_chunksize=5 << 20),
    )
    data = np.random.default_rng(0).integers(0, 256, size=(11 << 20), dtype=np.uint8).tobytes()
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.upload(src, "a/big.bin")
    assert any("uploadId" in r.query for r in proxy.records if r.method == "POST")  # multipart was used
    assert store.get_bytes("a/big.bin", 1000, 1010) == data[1000:1010]
    ranged = [r for r in proxy.records if r.method == "GET" and r.headers.get("Range") == "bytes=1000-1009"]
    assert len(ranged) == 1
    store.put_bytes("a/small", b"xyz")
    store.put_bytes("b/other", b"1")
    assert store.list() == ["a/big.bin", "a/small", "b/other"]
    assert store.list("a/") == ["a/big.bin", "a/small"]
    dest = tmp_path / "out.bin"
    store.download("a/big.bin", dest)
    assert dest.read_bytes() == data
    assert store.exists("a/small") and not store.exists("a/nope")
    store.delete_prefix("a/")
    assert store.list() == ["b/other"]
    store.delete("b/other")
    assert store.list() == []


def test_gs_uses_xml_api_with_bearer_token_from_environment(proxy, bucket, monkeypatch):
    # No HMAC keys in the env: the gs:// store must authenticate with an OAuth2 bearer token.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", "ya29.test-token")
    store = open_store(f"gs://{bucket}/p", endpoint_url=proxy.endpoint)
    store.put_bytes("k", b"hello")
    assert store.get_bytes("k") == b"hello"
    assert store.list() == ["k"]
    auth = {r.headers.get("Authorization") for r in proxy.records}
    assert auth == {"Bearer ya29.test-token"}
    assert all("list-type" not in r.query for r in proxy.records)  # ListObjects v1 for the XML API


def test_endpoint_from_environment_variable(dataset_uri, proxy, tmp_path, monkeypatch):
    uri, expected = dataset_uri
    monkeypatch.setenv("TRAINER_S3_ENDPOINT_URL", proxy.endpoint)
    with open_dataset(uri, context=CONTEXT, cache_dir=str(tmp_path / "c"), prefetch_shards=2) as ds:
        ds.prefetch(range(ds.num_windows))
        np.testing.assert_array_equal(ds.window(0), expected[: CONTEXT + 1])
    assert len(proxy.gets("manifest.json")) == 1


_WORKER = textwrap.dedent(
    """
    import faulthandler, hashlib, sys
    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test with every thread's stack
    from trainer.data import open_dataset
    ds = open_dataset(sys.argv[1], context=32, cache_dir=sys.argv[2], cache_max_bytes=None, prefetch_shards=3)
    order = list(range(ds.num_windows))
    ds.prefetch(order)
    h = hashlib.sha256()
    for i in order:
        h.update(ds.window(i).tobytes())
    ds.close()
    print(h.hexdigest())
    """
)


@pytest.mark.slow
def test_concurrent_processes_share_one_cache(dataset_uri, proxy, tmp_path):
    uri, expected = dataset_uri
    cache = tmp_path / "shared-cache"
    env = {**os.environ, "TRAINER_S3_ENDPOINT_URL": proxy.endpoint, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, uri, str(cache)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    digests = [p.communicate(timeout=90)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(digests)) == 1
    manifest = json.loads(open_store(uri, endpoint_url=proxy.endpoint).get_bytes("manifest.json"))
    for s in manifest["shards"]:
        assert len(proxy.gets(s["file"])) == 1, s["file"]  # no duplicate downloads
    with _open(uri, proxy, cache) as ds:
        import hashlib

        h = hashlib.sha256()
        for i in range(ds.num_windows):
            h.update(ds.window(i).tobytes())
        assert ds.cache.stats.downloads == 0
    assert h.hexdigest() == digests[0]
    assert list((cache / "tmp").iterdir()) == [] and list((cache / "pins").iterdir()) == []
