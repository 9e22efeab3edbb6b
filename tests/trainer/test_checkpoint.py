"""Checkpoint integrity: manifests, whatever damage is skipped with a warning naming it, retention, the newest
complete checkpoint wins wherever it is (local or remote), upload to and restore from a remote store.

Run: .venv/bin/pytest tests/trainer/test_checkpoint.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest

from gpu_train.storage import open_store
from tests.trainer.launch import FAULTS, SMALL, Nodes, run_trainer, summary
from trainer.checkpoint import MANIFEST, CheckpointInvalid, list_step_dirs, sha256_file, verify

# Saves and resumes across real worker processes and a local S3 server.
pytestmark = pytest.mark.integration


def _remote_steps(remote) -> list[str]:
    """Checkpoint names that still have objects in the store (object semantics: empty folders don't count)."""
    return sorted({key.split("/", 1)[0] for key in open_store(f"file://{remote}").list()})


def _biggest_data_file(step_dir):
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _edit_manifest(step_dir, edit) -> None:
    path = step_dir / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _without(overrides: list[str], *prefixes: str) -> list[str]:
    return [o for o in overrides if not o.startswith(prefixes)]


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


@pytest.fixture
def copy(trained, tmp_path):
    """A private copy of the trained run and its remote; returns (run_dir, remote, overrides for them)."""
    root, overrides = trained
    shutil.copytree(root / "run", tmp_path / "run")
    shutil.copytree(root / "remote", tmp_path / "remote")
    return tmp_path / "run", tmp_path / "remote", [*_without(overrides, "checkpoint.remote_uri"),
                                                   f"checkpoint.remote_uri=file://{tmp_path / 'remote'}"]


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
    assert manifest["trainer"]["dataset"]["uri"] == "synthetic"
    assert len(manifest["trainer"]["dataset"]["manifest_sha256"]) == 64
    assert _remote_steps(root / "remote") == ["step_000000002", "step_000000003", "step_000000004"]
    assert verify(root / "remote" / "step_000000004")["step"] == 4


def _damage(step, kind):
    """Damage a copy of a checkpoint; returns the text verify() must name."""
    bad = _biggest_data_file(step)
    rel = bad.name
    if kind == "truncate":
        bad.write_bytes(bad.read_bytes()[:-100])
        return f"{bad}: size"
    if kind == "flip":
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(bytes(data))
        return f"{bad}: sha256 differs"
    if kind == "missing_file":
        bad.unlink()
        return f"{bad}: listed in {MANIFEST} but missing"
    if kind == "no_manifest":
        (step / MANIFEST).unlink()
        return f"{step}: no {MANIFEST}"
    if kind == "manifest_not_json":
        (step / MANIFEST).write_text("{not json")
        return "manifest is not JSON"
    if kind == "manifest_unreadable":
        (step / MANIFEST).unlink()
        (step / MANIFEST).mkdir()  # reading it fails (EISDIR), even as root
        return "unreadable manifest"
    if kind == "entry_without_size":
        _edit_manifest(step, lambda m: m["files"][rel].pop("size"))
        return f"manifest entry {rel!r} has no valid 'size'"
    if kind == "entry_not_mapping":
        _edit_manifest(step, lambda m: m["files"].__setitem__(rel, "3072"))
        return f"manifest entry {rel!r} is not a mapping"
    if kind == "files_not_mapping":
        _edit_manifest(step, lambda m: m.__setitem__("files", ["a"]))
        return "manifest lists no DCP .metadata"
    if kind == "unsafe_path":
        _edit_manifest(step, lambda m: m["files"].__setitem__("../../etc/passwd", m["files"][rel]))
        return "unsafe path"
    if kind == "file_unreadable":
        bad.unlink()
        bad.mkdir()  # opening it fails (EISDIR), even as root
        return f"{bad}: listed in {MANIFEST} but not a file"
    if kind == "directory_unreadable":
        shutil.rmtree(step / "rng")
        (step / "rng").write_bytes(b"")  # rng/rank_00000.pt cannot be reached: ENOTDIR, even as root
        return f"{step / 'rng' / 'rank_00000.pt'}: unreadable"
    raise AssertionError(kind)


@pytest.mark.parametrize("damage", [
    "truncate", "flip", "missing_file", "no_manifest", "manifest_not_json", "manifest_unreadable",
    "entry_without_size", "entry_not_mapping", "files_not_mapping", "unsafe_path", "file_unreadable",
    "directory_unreadable",
])
def test_verify_names_the_bad_file(trained, tmp_path, damage):
    root, _ = trained
    step = tmp_path / "step_000000004"
    shutil.copytree(root / "run" / "checkpoints" / "step_000000004", step)
    needle = _damage(step, damage)
    with pytest.raises(CheckpointInvalid) as err:
        verify(step)
    assert needle in str(err.value)


def test_permission_denied_is_a_damaged_checkpoint(trained, tmp_path, monkeypatch):
    """An unreadable file (EACCES for the non-root trainer user) is reported, not raised; simulated here
    because this test may run as root, which reads anything."""
    root, _ = trained
    step = tmp_path / "step_000000004"
    shutil.copytree(root / "run" / "checkpoints" / "step_000000004", step)
    bad = _biggest_data_file(step)
    real_open = type(bad).open

    def deny(self, *args, **kwargs):
        if self == bad:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(type(bad), "open", deny)
    with pytest.raises(CheckpointInvalid, match="unreadable"):
        verify(step)


def test_every_kind_of_damage_falls_back_to_the_previous_good_checkpoint(tmp_path):
    """Without a remote store: steps 5, 4, 3, 2 are damaged in four different ways, so the run resumes from
    step 1 with a warning naming each, and trains on to the end."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=5", "checkpoint.every_steps=1", "checkpoint.keep=5"]
    res = run_trainer(run_dir, None, overrides)
    assert res.returncode == 0, res.output[-4000:]
    ckpts = run_dir / "checkpoints"
    _damage(ckpts / "step_000000005", "entry_without_size")
    _damage(ckpts / "step_000000004", "file_unreadable")
    # Step 3: a data file replaced by other bytes of the same size, and the manifest updated to match, so
    # every file matches its hash but DCP cannot load it.
    bad = _biggest_data_file(ckpts / "step_000000003")
    bad.write_bytes(os.urandom(bad.stat().st_size))
    _edit_manifest(ckpts / "step_000000003", lambda m: m["files"][bad.name].update(sha256=sha256_file(bad)))
    verify(ckpts / "step_000000003")
    _damage(ckpts / "step_000000002", "entry_not_mapping")

    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=7"])
    assert res.returncode == 0, res.output[-4000:]
    for step in (5, 4, 3, 2):
        assert f"skipping checkpoint {ckpts / f'step_{step:09d}'}" in res.output, res.output[-4000:]
    assert "cannot be loaded" in res.output
    assert f"resumed from {ckpts / 'step_000000001'} at step 1" in res.output
    assert "Traceback" not in res.output
    assert summary(run_dir)["step"] == 7
    assert verify(ckpts / "step_000000007")["step"] == 7
    assert verify(ckpts / "step_000000005")["step"] == 5  # redone, replacing the damaged directory


def test_corrupt_local_file_is_fetched_again_from_the_remote(copy):
    run_dir, remote, overrides = copy
    bad = _biggest_data_file(run_dir / "checkpoints" / "step_000000004")
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # a save cut short
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=5"])
    assert res.returncode == 0, res.output[-4000:]
    assert "WARNING" in res.output and str(bad) in res.output and "fetching it again" in res.output
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000000004'} at step 4" in res.output
    assert summary(run_dir)["step"] == 5


def test_a_newer_remote_checkpoint_beats_an_older_complete_local_one(copy):
    run_dir, remote, overrides = copy
    shutil.rmtree(run_dir / "checkpoints" / "step_000000004")  # this node never finished writing step 4
    verify(run_dir / "checkpoints" / "step_000000003")
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=5"])
    assert res.returncode == 0, res.output[-4000:]
    assert f"downloaded checkpoint file://{remote}/step_000000004" in res.output
    assert "at step 4" in res.output


def test_lost_disk_restores_from_the_remote(copy):
    run_dir, remote, overrides = copy
    shutil.rmtree(run_dir / "checkpoints")
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=6"])
    assert res.returncode == 0, res.output[-4000:]
    assert f"downloaded checkpoint file://{remote}/step_000000004" in res.output
    assert "at step 4" in res.output
    assert summary(run_dir)["step"] == 6
    assert _remote_steps(remote) == ["step_000000004", "step_000000005", "step_000000006"]
    assert json.loads((remote / "step_000000006" / MANIFEST).read_text())["step"] == 6


def test_damaged_remote_checkpoint_falls_back_to_the_previous_one(copy):
    run_dir, remote, overrides = copy
    shutil.rmtree(run_dir / "checkpoints")
    _damage(remote / "step_000000004", "flip")
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=5"])
    assert res.returncode == 0, res.output[-4000:]
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'step_000000004'}" in res.output
    assert "sha256 differs" in res.output
    assert "at step 3" in res.output


def _lines(output: str, needle: str) -> list[str]:
    return [line for line in output.splitlines() if needle in line]


def test_a_newest_local_checkpoint_without_its_manifest_is_named_and_its_remote_copy_used(copy):
    """Step 4 lacks its local manifest, step 3 its manifest in the store: step 4 is resumed through the store's
    manifest after one line naming the local folder; step 3, whole on this node, is not called skipped."""
    run_dir, remote, overrides = copy
    newest = run_dir / "checkpoints" / "step_000000004"
    (newest / MANIFEST).unlink()
    (remote / "step_000000003" / MANIFEST).unlink()
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=5"])
    assert res.returncode == 0, res.output[-4000:]
    skipped = _lines(res.output, "skipping")
    assert len(skipped) == 1 and f"local copy of checkpoint {newest}: no {MANIFEST}" in skipped[0], res.output[-4000:]
    assert f"resumed from {newest} at step 4" in res.output  # the store's manifest vouches for the local files
    assert (newest / MANIFEST).is_file()


def test_a_newest_remote_checkpoint_without_its_manifest_is_named_and_skipped(copy):
    run_dir, remote, overrides = copy
    shutil.rmtree(run_dir / "checkpoints" / "step_000000004")  # this node lost it; the store's copy is unfinished
    (remote / "step_000000004" / MANIFEST).unlink()
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=5"])
    assert res.returncode == 0, res.output[-4000:]
    skipped = _lines(res.output, f"skipping checkpoint file://{remote}/step_000000004")
    assert len(skipped) == 1 and f"no {MANIFEST} in the store" in skipped[0], res.output[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000000003'} at step 3" in res.output


def test_a_leftover_step_folder_without_a_manifest_is_named_and_skipped(copy):
    """No remote store: an unfinished save's folder (newer than any checkpoint) and the newest checkpoint with its
    manifest deleted are each one line naming the folder; the run resumes from step 3."""
    run_dir, _remote, overrides = copy
    ckpts = run_dir / "checkpoints"
    leftover = ckpts / "step_000000009"
    leftover.mkdir()
    (ckpts / "step_000000004" / MANIFEST).unlink()
    res = run_trainer(run_dir, None, [*_without(overrides, "train.steps", "checkpoint.remote_uri"), "train.steps=5"])
    assert res.returncode == 0, res.output[-4000:]
    for folder in (leftover, ckpts / "step_000000004"):
        skipped = _lines(res.output, f"skipping checkpoint {folder}")
        assert len(skipped) == 1 and f"no {MANIFEST}" in skipped[0], res.output[-4000:]
    assert f"resumed from {ckpts / 'step_000000003'} at step 3" in res.output


def test_checkpoints_upload_to_s3_and_restore_from_it(tmp_path, s3):
    run_dir = tmp_path / "run"
    base = [*SMALL, "checkpoint.every_steps=1", "checkpoint.keep=2", f"checkpoint.remote_uri=s3://{s3.bucket}/runs/a",
            f"checkpoint.endpoint_url={s3.endpoint}"]
    res = run_trainer(run_dir, None, [*base, "train.steps=3"], env=s3.env)
    assert res.returncode == 0, res.output[-4000:]
    keys = set(s3.keys("runs/a/"))
    assert {k.split("/")[2] for k in keys} == {"step_000000002", "step_000000003"}
    assert "runs/a/step_000000003/manifest.json" in keys and "runs/a/step_000000003/.metadata" in keys

    shutil.rmtree(run_dir / "checkpoints")
    res = run_trainer(run_dir, None, [*base, "train.steps=4"], env=s3.env)
    assert res.returncode == 0, res.output[-4000:]
    assert f"downloaded checkpoint s3://{s3.bucket}/runs/a/step_000000003" in res.output
    assert summary(run_dir)["step"] == 4


def test_when_no_checkpoint_loads_training_starts_over_from_the_seed(tmp_path):
    """Step 2's files match their hashes but cannot be loaded (the load may already have changed parameters),
    step 1's manifest is damaged: training starts from step 0 on a model rebuilt from the seed, so it ends on
    the same parameters as the first run."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=2", "checkpoint.every_steps=1", "checkpoint.keep=5"]
    res = run_trainer(run_dir, None, overrides)
    assert res.returncode == 0, res.output[-4000:]
    first = summary(run_dir)["params_sha256"]
    ckpts = run_dir / "checkpoints"
    bad = _biggest_data_file(ckpts / "step_000000002")
    data = bytearray(bad.read_bytes())
    data[len(data) // 2:] = os.urandom(len(data) - len(data) // 2)  # the header still parses
    bad.write_bytes(bytes(data))
    _edit_manifest(ckpts / "step_000000002", lambda m: m["files"][bad.name].update(sha256=sha256_file(bad)))
    _damage(ckpts / "step_000000001", "entry_without_size")
    res = run_trainer(run_dir, None, overrides)
    assert res.returncode == 0, res.output[-4000:]
    assert "cannot be loaded" in res.output  # a load was attempted and failed part-way
    assert "no usable checkpoint" in res.output and "training starts from step 0" in res.output
    assert summary(run_dir)["params_sha256"] == first


def test_a_final_checkpoint_that_cannot_be_uploaded_is_not_a_completed_run(tmp_path, failing_s3):
    s3, proxy = failing_s3
    proxy.refuse = {"/step_000000003/"}
    overrides = [*SMALL, "train.steps=3", "checkpoint.every_steps=1", f"checkpoint.remote_uri=s3://{s3.bucket}/r",
                 f"checkpoint.endpoint_url={proxy.endpoint}"]
    res = run_trainer(tmp_path / "run", None, overrides, env=s3.env)
    assert res.returncode == 1, res.output[-4000:]
    assert "Traceback" not in res.output
    assert "failed (will be retried): the final checkpoint (step 3) was not saved" in res.output
    assert "AccessDenied" in res.output
    assert not (tmp_path / "run" / "summary.json").exists()


@contextlib.contextmanager
def _unreadable(step_dir):
    """The environment of a trainer to which `step_dir` is a directory it may not read: mode 0 when this test
    does not run as root, else the test-only fault of tests/trainer/faults.py (root reads anything)."""
    if os.geteuid() != 0:
        step_dir.chmod(0)
        try:
            yield {}
        finally:
            step_dir.chmod(0o755)
    else:
        yield {"TRAINER_TEST_UNREADABLE": str(step_dir)}


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one_with_one_line(tmp_path):
    """Step 4's directory may not be read (permissions, a half-restored backup): one line names it and the run
    resumes from step 3; before, Path.exists raised PermissionError on every rank, every restart."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=4", "checkpoint.every_steps=1", "checkpoint.keep=3"]
    assert run_trainer(run_dir, None, overrides).returncode == 0
    newest = run_dir / "checkpoints" / "step_000000004"
    with _unreadable(newest) as env:
        res = run_trainer(run_dir, None, [*_without(overrides, "train.steps"), "train.steps=6"], module=FAULTS,
                          env=env)
    assert res.returncode == 0, res.output[-4000:]
    assert "Traceback" not in res.output
    skipped = [line for line in res.output.splitlines() if f"skipping checkpoint {newest}" in line]
    assert len(skipped) == 1 and "not readable by this user" in skipped[0], res.output[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000000003'} at step 3" in res.output
    assert summary(run_dir)["step"] == 6


def test_with_no_readable_checkpoint_the_launch_stops_with_one_line_and_no_restarts(tmp_path):
    """The only checkpoint may not be read: starting over would train beside it and never prune it, so the worker
    stops with exit 2 and one line, and under the launcher torchrun restarts nothing."""
    nodes = Nodes(tmp_path, overrides=[*SMALL, "checkpoint.every_steps=2"], nnodes="1", max_restarts=3,
                  module=FAULTS)
    run_dir = nodes.run_dir(0)  # the launch below trains in the same directory
    assert run_trainer(run_dir, None, [*nodes.overrides, "train.steps=2"]).returncode == 0
    only = run_dir / "checkpoints" / "step_000000002"
    with _unreadable(only) as env:
        agent = nodes.start(0, env=env, overrides=["train.steps=3"])
        agent.wait(timeout=240)
    out = agent.output()
    assert agent.proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out and "will restart worker group" not in out
    lines = [line for line in out.splitlines() if "bad input, not retried" in line]
    assert len(lines) == 1 and str(only) in lines[0] and "not readable by this user" in lines[0], out[-4000:]
