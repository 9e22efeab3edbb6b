"""Reading through the in-cluster cache proxy as a GKE pod does: no AWS credentials, unsigned requests.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_proxy.py -q``

The proxy fixture serves the S3 API under /api/v1/s3, the path of the Alluxio S3 proxy, and forwards to the
local S3 server. The readers run in subprocesses whose environment holds no AWS credentials at all.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gpu_train.storage import StorageError, StoreOptions, open_store, signs_requests
from trainer.data.prepare import synth
from trainer.data.synthetic import synthetic_shards

# Reads through a local S3 proxy server.
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
CONTEXT = 32

_READER = textwrap.dedent(
    """
    import faulthandler, hashlib, json, sys
    from pathlib import Path
    faulthandler.dump_traceback_later(60, exit=True)
    from trainer.data import open_dataset
    ds = open_dataset(sys.argv[1], context=32, cache_dir=sys.argv[2], memory_dir=sys.argv[3])
    h = hashlib.sha256()
    for i in range(ds.num_windows):
        h.update(ds.window(i).tobytes())
    mode, budget = ds.read_mode, ds.cache.max_bytes
    ds.close()
    nvme = [p.name for p in (Path(sys.argv[2]) / "objects").glob("*")] if (Path(sys.argv[2]) / "objects").exists() else []
    print(json.dumps({"sha": h.hexdigest(), "mode": mode, "budget": budget, "nvme_objects": nvme}))
    """
)


def _gke_env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    """What a GKE pod has: no AWS keys, no AWS config or credentials file, no EC2 metadata."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRAINER_"))}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home), PYTHONPATH=str(REPO), AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "no-config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-creds"),
        TRAINER_S3_ENDPOINT_URL=endpoint, **extra,
    )  # fmt: skip
    return env


@pytest.fixture
def proxied_dataset(bucket: str, moto_endpoint: str) -> tuple[str, str]:
    uri = f"s3://{bucket}/ds"
    synth(uri, tokens=1 << 15, seed=2, shard_tokens=1 << 12, val_tokens=1 << 12, endpoint_url=moto_endpoint)
    h = hashlib.sha256()
    arrays = [t.astype(np.int64) for t, _ in synthetic_shards(1 << 15, seed=2, shard_tokens=1 << 12)]
    for a in arrays:  # the expected windows, from the in-memory generator
        for k in range((a.size - 1) // CONTEXT):
            h.update(a[k * CONTEXT : k * CONTEXT + CONTEXT + 1].tobytes())
    return uri, h.hexdigest()


def test_gke_style_reader_without_credentials_reads_through_the_proxy(proxied_dataset, cache_proxy, tmp_path):
    uri, expected = proxied_dataset
    env = _gke_env(tmp_path, cache_proxy.endpoint)
    nvme, ram = tmp_path / "nvme-cache", tmp_path / "shm"
    out = subprocess.run([sys.executable, "-c", _READER, uri, str(nvme), str(ram)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sha"] == expected
    assert got["mode"] == "memory"  # behind the node's cache: no second copy on the NVMe disk
    assert got["nvme_objects"] == []
    assert sorted(p.name for p in (ram / "objects").iterdir())  # the working set went to RAM instead
    shard_gets = cache_proxy.gets(".bin")
    assert shard_gets and all("Authorization" not in r.headers for r in cache_proxy.records)
    assert all(r.path.startswith("/") and not r.path.startswith("/api/") for r in cache_proxy.records)

    verify = subprocess.run([sys.executable, "-m", "trainer.data", "verify", uri], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert verify.returncode == 0, verify.stderr[-3000:]
    assert "ok:" in verify.stdout and "val shards" in verify.stdout


def test_signed_requests_without_credentials_fail_with_one_line(proxied_dataset, cache_proxy, tmp_path):
    """The same pod forced to sign (the old behaviour): it cannot, and says so in one line."""
    uri, _ = proxied_dataset
    env = _gke_env(tmp_path, cache_proxy.endpoint, TRAINER_S3_AUTH="sigv4")
    out = subprocess.run([sys.executable, "-m", "trainer.data", "verify", uri], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "no credentials" in out.stderr and f"{uri}/manifest.json" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert cache_proxy.records == []  # signing failed before any request left the client


@pytest.mark.slow
def test_trainer_run_without_credentials_trains_through_the_proxy(proxied_dataset, cache_proxy, tmp_path):
    uri, _ = proxied_dataset
    env = _gke_env(tmp_path, cache_proxy.endpoint, TRAINER_MEMORY_DIR=str(tmp_path / "shm"))
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run), "train.steps=3",
         "checkpoint.every_steps=0", "tracking.enabled=false", f"data.uri={uri}",
         f"data.endpoint_url={cache_proxy.endpoint}", f"data.cache_dir={tmp_path / 'nvme'}"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert (run / "summary.json").is_file()
    assert cache_proxy.gets(".bin") and all("Authorization" not in r.headers for r in cache_proxy.records)
    assert not any((tmp_path / "nvme" / "objects").glob("*"))
    assert any((tmp_path / "shm" / "objects").glob("*"))


@pytest.mark.parametrize(
    ("auth", "endpoint", "signed"),
    [
        ("auto", "http://alluxio-proxy.alluxio.svc.cluster.local:39999/api/v1/s3", False),
        ("auto", "http://alluxio-proxy:39999/api/v1/s3/", False),
        ("auto", "http://minio:9000", True),
        ("auto", None, True),
        ("unsigned", "http://minio:9000", False),
        ("sigv4", "http://alluxio-proxy:39999/api/v1/s3", True),
    ],
)
def test_which_requests_are_signed(auth, endpoint, signed):
    assert signs_requests(auth, endpoint) is signed


def test_unknown_auth_mode_is_rejected_naming_the_setting(monkeypatch):
    monkeypatch.setenv("TRAINER_S3_AUTH", "hmac")
    with pytest.raises(StorageError, match="TRAINER_S3_AUTH"):
        open_store("s3://b/p", endpoint_url="http://x:1/api/v1/s3", options=StoreOptions())
