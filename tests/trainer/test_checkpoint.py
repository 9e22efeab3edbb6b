"""Checkpoint integrity: manifests, truncated/corrupted files skipped with a warning naming them, retention,
upload to and restore from a remote store.

Run: .venv/bin/pytest tests/trainer/test_checkpoint.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.trainer.launch import SMALL, run_trainer, summary
from trainer.checkpoint import MANIFEST, CheckpointInvalid, list_step_dirs, verify
from trainer.data.storage import open_store


def _remote_steps(remote) -> list[str]:
    """Checkpoint names that still have objects in the store (object semantics: empty folders don't count)."""
    return sorted({key.split("/", 1)[0] for key in open_store(f"file://{remote}").list()})


def _biggest_data_file(step_dir):
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One world-1 run of 4 steps, a checkpoint every step, keep 3, uploaded to a file:// remote."""
    root = tmp_path_factory.mktemp("ckpt")
    remote = root / "remote"
    overrides = [*SMALL, "train.steps=4", "checkpoint.every_steps=1", "checkpoint.keep=3",
                 f"checkpoint.remote_uri=file://{remote}"]
    res = run_trainer(root / "run", None, overrides)
    assert res.returncode == 0, res.output[-4000:]
    return root, overrides


def test_manifest_lists_every_file_and_retention_keeps_newest(trained):
    root, _ = trained
    local = root / "run" / "checkpoints"
    assert [p.name for p in list_step_dirs(local)] == ["step_000000004", "step_000000003", "step_000000002"]
    manifest = verify(local / "step_000000004")
    assert manifest["step"] == 4 and manifest["world_size"] == 1
    on_disk = {str(p.relative_to(local / "step_000000004")) for p in (local / "step_000000004").rglob("*")
               if p.is_file() and p.name != MANIFEST}
    assert on_disk == set(manifest["files"])
    assert {".metadata", "rng/rank_00000.pt"} <= on_disk
    assert _remote_steps(root / "remote") == ["step_000000002", "step_000000003", "step_000000004"]
    assert verify(root / "remote" / "step_000000004")["step"] == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "missing_file"])
def test_verify_names_the_bad_file(trained, tmp_path, damage):
    root, _ = trained
    step = tmp_path / "step_000000004"
    shutil.copytree(root / "run" / "checkpoints" / "step_000000004", step)
    bad = _biggest_data_file(step)
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:-100])
        needle = f"{bad}: size"
    elif damage == "flip":
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(bytes(data))
        needle = f"{bad}: sha256 differs"
    elif damage == "missing_file":
        bad.unlink()
        needle = f"{bad}: listed in {MANIFEST} but missing"
    else:
        (step / MANIFEST).unlink()
        needle = f"{step}: no {MANIFEST}"
    with pytest.raises(CheckpointInvalid) as err:
        verify(step)
    assert needle in str(err.value)


def test_corrupt_newest_falls_back_then_remote_restores(trained, tmp_path):
    root, overrides = trained
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir)
    remote = root / "remote"
    overrides = [o for o in overrides if not o.startswith("checkpoint.remote_uri")]
    overrides.append(f"checkpoint.remote_uri=file://{tmp_path / 'remote'}")
    shutil.copytree(remote, tmp_path / "remote")

    bad = _biggest_data_file(run_dir / "checkpoints" / "step_000000004")
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # a save cut short
    steps6 = [o for o in overrides if not o.startswith("train.steps")] + ["train.steps=6"]
    res = run_trainer(run_dir, None, steps6)
    assert res.returncode == 0, res.output[-4000:]
    assert "WARNING" in res.output and f"skipping checkpoint {bad.parent}" in res.output and str(bad) in res.output
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000000003'} at step 3" in res.output
    assert summary(run_dir)["step"] == 6

    # Lose the node's disk: the newest verified checkpoint comes back from the remote store.
    shutil.rmtree(run_dir / "checkpoints")
    steps8 = [o for o in overrides if not o.startswith("train.steps")] + ["train.steps=8"]
    res = run_trainer(run_dir, None, steps8)
    assert res.returncode == 0, res.output[-4000:]
    assert f"downloaded checkpoint file://{tmp_path / 'remote'}/step_000000006" in res.output
    assert "at step 6" in res.output
    assert summary(run_dir)["step"] == 8
    assert _remote_steps(tmp_path / "remote") == ["step_000000006", "step_000000007", "step_000000008"]
    assert json.loads((tmp_path / "remote" / "step_000000008" / MANIFEST).read_text())["step"] == 8


@pytest.fixture
def s3_bucket():
    """A real local S3 server (moto) and a fresh bucket in it."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.trainer.launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="ckpt")
    try:
        yield endpoint, creds
    finally:
        server.stop()


def test_checkpoints_upload_to_s3_and_restore_from_it(tmp_path, s3_bucket):
    endpoint, creds = s3_bucket
    run_dir = tmp_path / "run"
    base = [*SMALL, "checkpoint.every_steps=1", "checkpoint.keep=2", "checkpoint.remote_uri=s3://ckpt/runs/a",
            f"checkpoint.endpoint_url={endpoint}"]
    res = run_trainer(run_dir, None, [*base, "train.steps=3"], env=creds)
    assert res.returncode == 0, res.output[-4000:]
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="runs/a/")["Contents"]}
    assert {k.split("/")[2] for k in keys} == {"step_000000002", "step_000000003"}
    assert "runs/a/step_000000003/manifest.json" in keys and "runs/a/step_000000003/.metadata" in keys

    shutil.rmtree(run_dir / "checkpoints")
    res = run_trainer(run_dir, None, [*base, "train.steps=4"], env=creds)
    assert res.returncode == 0, res.output[-4000:]
    assert "downloaded checkpoint s3://ckpt/runs/a/step_000000003" in res.output
    assert summary(run_dir)["step"] == 4
