"""A local sweep trial starts as `gpu-train run --local` starts a job (gpu_train.jobs.launch.local): the bundled
trainer's settings name the same places as its environment, the trial's places win over the caller's environment,
and the caller may still retune the launcher.

Run: .venv/bin/pytest tests/gpu_train/sweeps/test_local.py -q
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.run as torchrun

from gpu_train.spec.sweep import load_sweep, trial_job
from gpu_train.spec.trainer_config import build_config
from gpu_train.sweeps import local
from gpu_train.sweeps.journal import TrialState
from trainer.__main__ import parser as trainer_parser

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "sweep-tiny.yaml"


class _Started:
    pid = 4242

    def poll(self) -> None:
        return None


def test_a_trial_gets_the_bundled_settings_and_its_places_win_over_the_callers(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(local.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw)) or _Started())
    monkeypatch.setenv("GPU_TRAIN_RUN_DIR", "/elsewhere")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "0")
    sweep = load_sweep(EXAMPLE)
    backend = local.LocalBackend(sweep, runs=tmp_path / "runs", data_uri="synthetic")
    trial = TrialState(id=f"{sweep.name}-t000", number=0, params={})
    backend.launch(trial, trial_job(sweep, trial.id, {}, backend.settings(trial)))

    ((cmd, kw),) = started
    env, run_dir = kw["env"], backend.run_dir(trial)
    parsed = torchrun.get_args_parser().parse_args(cmd[3:])
    targs = trainer_parser().parse_args(parsed.training_script_args)
    cfg = build_config(targs.preset, overrides=targs.overrides)
    assert env["GPU_TRAIN_RUN_DIR"] == str(run_dir) == str(targs.run_dir)
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert cfg.checkpoint.local_dir == env["GPU_TRAIN_CHECKPOINT_DIR"] == str(run_dir / "checkpoints")
    assert cfg.data.cache_dir == env["GPU_TRAIN_DATA_CACHE_DIR"] == str(run_dir.parent / "cache" / trial.id)
    assert cfg.tracking.experiment == sweep.name  # the sweep's own setting over the bundled default
    assert (run_dir / local.LAUNCHER_PID).read_text() == "4242\n"
