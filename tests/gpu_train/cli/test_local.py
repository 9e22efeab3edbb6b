"""`gpu-train run --local`: a job spec under local torchrun through the one launcher and the image's launcher, read
and checked by the one job model first.

Run: .venv/bin/pytest tests/gpu_train/cli/test_local.py -q   (the slow test trains the embedded default: ~1 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun

from gpu_train.client import local
from gpu_train.jobs import launch
from gpu_train.jobs.launch import shutdown_timeout_s
from gpu_train.spec.job import read_job
from gpu_train.spec.trainer_config import build_config
from tests.gpu_train.cli.conftest import only_error_lines, spec
from trainer.__main__ import parser as trainer_parser

ROOT = Path(__file__).resolve().parents[3]


def test_the_command_line_is_torchruns_and_the_trainers_own(tmp_path):
    job = read_job(local.DEFAULT_SPEC, key="job")
    assert local.local_problems(job, nproc=2) == []
    cmd, _ = launch.local(job, launch.Site(run_dir=str(tmp_path / "run"), dataset_uri="synthetic"), 2)
    assert cmd[:3] == [sys.executable, "-m", "trainer.launch"]
    args = torchrun.get_args_parser().parse_args(cmd[3:])  # torch's own parser
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.max_restarts) == ("1:1", "2", "c10d", 3)
    # The same shutdown rule as a pod's: torchrun stops its workers within the grace period, less a margin.
    assert args.shutdown_timeout == shutdown_timeout_s()
    assert args.module and args.training_script == "trainer"
    trainer_args = trainer_parser().parse_args(args.training_script_args)
    assert trainer_args.preset == "tiny" and trainer_args.run_dir == tmp_path / "run"
    cfg = build_config(trainer_args.preset, overrides=trainer_args.overrides)
    assert (cfg.train.steps, cfg.train.global_batch_tokens, cfg.checkpoint.every_steps) == (200, 4096, 50)
    assert cfg.data.uri == "synthetic"


def test_a_spec_is_checked_before_anything_starts(tmp_path, cli):
    code, _, err = cli("run", "--local", spec(tmp_path, preset="tiny", steps=0))
    assert code == 2 and only_error_lines(err) and "job.steps must be >= 1 (got 0)" in err
    code, _, err = cli("run", "--local", spec(tmp_path, preset="tiny", overrides={"train.lrr": 1}))
    assert code == 2 and only_error_lines(err)
    assert "job.overrides.train.lrr: the trainer refuses it" in err
    code, _, err = cli("run", "--local", "--nproc", "0")
    assert code == 2 and "--nproc 0 must be >= 1" in err
    # The global batch must divide over this machine's workers: 4096 tokens / 64 = 64 sequences, micro batch 8,
    # 3 workers x 8 = 24 does not divide 64.
    code, _, err = cli("run", "--local", spec(tmp_path, preset="tiny", globalBatchTokens=4096, gpusPerNode=0,
                                              overrides={}), "--nproc", "3")
    assert code == 2 and only_error_lines(err) and "does not divide at world size 3" in err


@pytest.mark.parametrize("kind", ["file-uri", "plain-path", "own-code"])
def test_a_mistyped_local_dataset_fails_at_once_naming_it(tmp_path, kind):
    """A dataset on this disk without its manifest is a typo, not an upload still to come: one line naming the path
    before anything starts, for the bundled trainer (which otherwise waits dataWaitMinutes, 10 by default) and a
    job of its own code alike; a plain path is read from where the command runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "TRAINER_DATA_WAIT_S")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    data = {"file-uri": f"file://{tmp_path}/no/such", "plain-path": "no/such", "own-code": "no/such"}[kind]
    job = [str(ROOT / "examples" / "plain-loop" / "job.yaml")] if kind == "own-code" else []
    try:
        proc = subprocess.run([str(Path(sys.executable).parent / "gpu-train"), "run", "--local", *job, "--data", data],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"gpu-train run --local --data {data} did not fail at once") from None
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert only_error_lines(proc.stderr) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert f"--data file://{tmp_path}/no/such: no dataset manifest at file://{tmp_path}/no/such/manifest.json" in (
        proc.stderr)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_run_local_trains_the_embedded_default_on_cpu(tmp_path):
    """The embedded default (the tiny preset, 200 steps, 2 CPU workers, synthetic data) trains to completion and
    its loss falls."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run([str(Path(sys.executable).parent / "gpu-train"), "run", "--local"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "local-tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 200
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0] / 2, losses
    assert (run / "checkpoints").is_dir()
