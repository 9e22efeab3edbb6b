"""Real multi-process runs on one node: kill -9 and resume bit-exactly (FSDP2), world-size changes with
resharding, SIGTERM, DDP and FSDP2 hashing alike. Several nodes: tests/trainer/test_multinode.py.

Run: .venv/bin/pytest tests/trainer/test_elastic.py -q
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from gpu_train.sizing.layout import batch_layout
from gpu_train.spec.trainer_config import build_config
from tests.trainer.launch import FAULTS, SMALL, kill_group, run_trainer, start, step_records, summary
from trainer.checkpoint import verify
from trainer.errors import EXIT_RESUMABLE
from trainer.metrics import batch_hash

pytestmark = pytest.mark.slow


def _expected_batch_hashes(overrides: list[str], steps: int) -> dict[int, str]:
    """What the sampler must hand out, computed here without any worker: independent of world size. The
    sampler is the block shuffle over the dataset's shards with data.block_shards (docs/data.md, Sampler)."""
    from trainer.data import GlobalSampler, open_dataset

    cfg = build_config("tiny", overrides=overrides)
    global_batch, _ = batch_layout(cfg, 1)
    ds = open_dataset(cfg.data.uri, context=cfg.model.context)
    sampler = GlobalSampler(ds.num_windows, global_batch=global_batch, seed=cfg.train.seed,
                            shard_windows=ds.shard_windows, block_shards=cfg.data.block_shards)
    ds.close()
    return {s + 1: batch_hash(sampler.global_batch(s)) for s in range(steps)}


@pytest.mark.parametrize("parallel", ["fsdp"])
def test_kill9_and_restart_is_bit_identical(tmp_path, parallel):
    overrides = [*SMALL, "train.steps=8", "checkpoint.every_steps=2", f"train.parallel={parallel}"]
    ref = run_trainer(tmp_path / "ref", 2, overrides)
    assert ref.returncode == 0, ref.output[-4000:]

    # Rank 1 SIGKILLs itself in the middle of step 5 (after backward); torchrun restarts the group, which
    # resumes from step 4 and redoes step 5.
    killed = run_trainer(tmp_path / "killed", 2, overrides, max_restarts=1, module=FAULTS,
                         env={"TRAINER_TEST_KILL_AT_STEP": "5", "TRAINER_TEST_KILL_RANK": "1"})
    assert killed.returncode == 0, killed.output[-4000:]
    assert "resumed from" in killed.output
    got, want = summary(tmp_path / "killed"), summary(tmp_path / "ref")
    assert got["restarts"] == 1
    assert got["step"] == want["step"] == 8
    assert got["params_sha256"] == want["params_sha256"]
    assert got["final_loss"] == want["final_loss"]


@pytest.mark.parametrize(("before", "after", "parallel"), [(1, 3, "ddp"), (2, 1, "fsdp")])
def test_world_size_change_keeps_global_batch_sequence(tmp_path, before, after, parallel):
    overrides = [*SMALL, "train.steps=6", "checkpoint.every_steps=1", "metrics.batch_hash=true",
                 f"train.parallel={parallel}"]
    run_dir = tmp_path / "run"
    first = run_trainer(run_dir, before, overrides, module=FAULTS, env={"TRAINER_TEST_KILL_AT_STEP": "3"})
    assert first.returncode != 0  # killed, no restarts allowed
    second = run_trainer(run_dir, after, overrides)
    assert second.returncode == 0, second.output[-4000:]
    assert "resumed from" in second.output

    records = step_records(run_dir)
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    starts = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in starts if r.get("event") == "start"] == [before, after]
    got = {s: r["batch_sha256"] for s, r in records.items()}
    assert got == _expected_batch_hashes(overrides, 6)
    assert summary(run_dir)["tokens"] == 6 * 384


@pytest.mark.parametrize("nproc", [None, 2], ids=["single-process", "torchrun-2-workers"])
def test_sigterm_saves_a_checkpoint_and_does_not_report_success(tmp_path, nproc):
    """SIGTERM to the worker (single process) or to torchrun, which forwards it to every worker (as Kubernetes
    does to the pod's main process on spot reclaim or eviction): every rank finishes the same step, saves it
    and exits 75 (resumable), never 0, which would end the run as completed."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=100000", "checkpoint.every_steps=0"]
    proc = start(run_dir, nproc, overrides)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and sum('"event": "step"' in line for line in metrics.read_text().splitlines()) >= 2:
                break
            assert proc.poll() is None, "trainer exited before it was signalled"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    result = summary(run_dir)
    assert result["status"] == "preempted"
    step = result["step"]
    assert 2 <= step < 100000
    manifest = verify(run_dir / "checkpoints" / f"step_{step:09d}")
    assert manifest["step"] == step
    assert manifest["trainer"]["sampler"]["index"] == step * 12
    assert (run_dir / "loss.png").is_file()
    log = run_dir.with_name("run.log").read_text()
    assert code != 0
    if nproc is None:
        assert code == EXIT_RESUMABLE
    else:
        # Each worker finished the same step, saved, and exited 75; torchrun reports the signal.
        for rank in range(nproc):
            assert f"[rank{rank}] WARNING trainer: SIGTERM: saved checkpoint at step {step}, stopping" in log
        assert "exitcode: 75" in log or "exitcode" not in log


def test_params_hash_is_the_same_for_ddp_and_fsdp(tmp_path):
    """A DDP checkpoint loaded into FSDP2 (sharded across 2 workers) hashes to the same params_sha256."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=3", "checkpoint.every_steps=3"]
    ddp = run_trainer(run_dir, 1, overrides)
    assert ddp.returncode == 0, ddp.output[-4000:]
    want = summary(run_dir)
    (run_dir / "summary.json").unlink()
    fsdp = run_trainer(run_dir, 2, [*overrides, "train.parallel=fsdp"])
    assert fsdp.returncode == 0, fsdp.output[-4000:]
    got = summary(run_dir)
    assert got["step"] == want["step"] == 3
    assert got["params_sha256"] == want["params_sha256"]
    assert got["final_loss"] == want["final_loss"]
