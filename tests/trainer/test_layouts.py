"""Tensor, pipeline and hybrid parallelism for real: torchrun with gloo workers in fp32, each layout's training and
validation losses against one plain process's, and a checkpoint saved under one layout resumed under another
through DCP.

Run: .venv/bin/pytest tests/trainer/test_layouts.py -q

The tolerance. Every layout computes the same sums in another order: a row-parallel matmul adds two partial products
of d/2 terms, sequence-parallel norms and the vocabulary-parallel loss reduce across ranks, a pipeline sums its
micro batches' losses on the last stage. In fp32 a sum of K terms rounded in another order differs by at most about
K x 2^-24 relative (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2); the widest sum
here is the MLP's, K = 4 x 32 = 128, so 128 x 6e-8 = 7.6e-6 per step, and the few steps of the test stay within
1e-5 relative. The data must be the same exactly: the batch hash of every step matches.

The final weights. Each layout's last checkpoint exports (trainer.export, one process) to one unsharded model with
the plain run's parameter names; its values differ from the plain run's by less than 1e-5. AdamW moves a parameter
by about train.lr (3e-3 at most here) per step whatever the gradient's size, so a layout that lost a gradient
(a missed sync, a wrong shard, the tied embedding's second copy) is off by a step's size, 100 times that bound.

Each launch has a timeout (run_trainer kills its process group and raises when it passes), so a pipeline that hangs
in a send or receive fails its test instead of blocking the suite.
"""

from __future__ import annotations

import shutil

import pytest

from tests.trainer.launch import FAULTS, SMALL, run_trainer, step_records, summary
from trainer.export import load_checkpoint, newest_checkpoint

pytestmark = pytest.mark.slow

STEPS = 4
# Four blocks, so that an interleaved pipeline has 2 stages on each of 2 ranks; an evaluation after steps 2 and 4.
FP32 = [*SMALL, "model.n_layer=4", f"train.steps={STEPS}", "train.precision=fp32", "metrics.batch_hash=true",
        "eval.sample_tokens=0", "eval.every_steps=2", "eval.batches=2"]
REL = 1e-5  # the module docstring derives it
ATOL = 1e-5  # final parameters, likewise
TIMEOUT = 180


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The reference: one process, no parallelism, the same settings (its checkpoint: the last step's)."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    res = run_trainer(run_dir, None, [*FP32, "checkpoint.every_steps=0"], timeout=TIMEOUT)
    assert res.returncode == 0, res.output[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def plain(plain_run) -> dict[int, dict]:
    return step_records(plain_run)


def exported(run_dir) -> dict:
    return load_checkpoint(newest_checkpoint(run_dir)).model.state_dict()


def assert_matches(records: dict[int, dict], plain: dict[int, dict], steps: range) -> None:
    for step in steps:
        assert records[step]["batch_sha256"] == plain[step]["batch_sha256"], step
        assert records[step]["loss"] == pytest.approx(plain[step]["loss"], rel=REL), step


@pytest.mark.parametrize(("nproc", "layout", "named"), [
    (2, ["train.tp=2"], "x tp=2 x pp=1, tp + fsdp2 replicated"),
    (2, ["train.pp=2", "train.pp_schedule=gpipe"], "x tp=1 x pp=2, pp (gpipe) + fsdp2 replicated"),
    (2, ["train.pp=2", "train.pp_schedule=1f1b"], "x tp=1 x pp=2, pp (1f1b) + fsdp2 replicated"),
    (2, ["train.pp=2", "train.pp_schedule=interleaved_1f1b", "train.pp_stages_per_rank=2"],
     "x tp=1 x pp=2, pp (interleaved_1f1b) + fsdp2 replicated"),
    (4, ["train.pp=2", "train.tp=2", "train.pp_schedule=1f1b"], "x tp=2 x pp=2, pp (1f1b) + tp + fsdp2 replicated"),
], ids=["tp2", "pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2xtp2"])
def test_each_layout_trains_the_plain_runs_losses_and_weights(tmp_path, plain_run, plain, nproc, layout, named):
    run_dir = tmp_path / "run"
    res = run_trainer(run_dir, nproc, [*FP32, "checkpoint.every_steps=0", *layout], timeout=TIMEOUT)
    assert res.returncode == 0, res.output[-3000:]
    start = [line for line in res.output.splitlines() if "non-embedding" in line]  # the start-up line
    assert len(start) == 1 and f"dp=1 (replicate 1 x shard 1) {named}, fp32" in start[0], start
    assert_matches(step_records(run_dir), plain, range(1, STEPS + 1))
    assert summary(run_dir)["val_loss"] == pytest.approx(summary(plain_run)["val_loss"], rel=REL)
    ours, want = exported(run_dir), exported(plain_run)
    assert ours.keys() == want.keys()
    for name, value in want.items():
        assert ours[name].shape == value.shape, name
        assert (ours[name] - value).abs().max().item() < ATOL, name


def test_a_checkpoint_saved_at_tp2_resumes_at_dp2_and_at_pp2(tmp_path, plain):
    """Saved at (tp=2, dp=1), killed in step 3; resumed at (tp=1, dp=2) and, from a copy, at pp=2: both redo
    steps 3 and 4 on the same samples with the uninterrupted run's losses."""
    saved = tmp_path / "tp2"
    overrides = [*FP32, "checkpoint.every_steps=1", "checkpoint.async_save=false"]
    killed = run_trainer(saved, 2, [*overrides, "train.tp=2"], module=FAULTS, timeout=TIMEOUT,
                         env={"TRAINER_TEST_KILL_AT_STEP": "2"})  # 0-based: in step 3, after step 2's checkpoint
    assert killed.returncode != 0
    assert sorted(step_records(saved)) == [1, 2]
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    for run_dir, layout in ((saved, []), (copy, ["train.pp=2"])):
        res = run_trainer(run_dir, 2, [*overrides, *layout], timeout=TIMEOUT)
        assert res.returncode == 0, res.output[-3000:]
        assert "resumed from" in res.output and "step_000000002" in res.output
        records = step_records(run_dir)
        assert sorted(records) == [1, 2, 3, 4]
        assert_matches(records, plain, range(3, STEPS + 1))
