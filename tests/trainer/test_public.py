"""The library's public surface (trainer/__init__.py): every name imports, `import trainer` stays cheap, the bundled
trainer reaches the library pieces only by these names (imported from the modules that define them, so that the
import graph tests/test_layers.py reads sees every edge), and the pieces take plain arguments (the job's
environment, the process group's) rather than the trainer's config.

Run: .venv/bin/pytest tests/trainer/test_public.py -q
"""

from __future__ import annotations

import ast
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import trainer
from gpu_train.spec import env as job_env
from gpu_train.spec.trainer_config import WatchdogConfig
from tests.trainer.launch import ROOT, child_env

# The library's pieces: the bundled trainer's own modules import only their public names.
LIBRARY = ("trainer.checkpoint", "trainer.data", "trainer.tracking", "trainer.watchdog", "trainer.preemption",
           "trainer.distributed", "trainer.jobenv")
BUNDLED = ("train.py", "resume.py", "run.py")


def test_every_public_name_imports_from_its_module():
    for name in trainer.__all__:
        value = getattr(trainer, name)
        assert value is getattr(__import__(trainer.PUBLIC[name], fromlist=[name]), name), name
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        trainer.Trainer  # noqa: B018 -- the bundled GPT loop is not part of the library


def test_importing_the_package_imports_no_piece_and_no_torch():
    code = "import sys, trainer; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('trainer.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def _library_imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def _pieces(module: str) -> list[tuple[str, str]]:
    """(module, name) of every name a bundled module imports from the library's modules."""
    return [(m, n) for m, ns in _library_imports(ROOT / "trainer" / module)
            if any(m == lib or m.startswith(lib + ".") for lib in LIBRARY) for n in ns]


@pytest.mark.parametrize("module", BUNDLED)
def test_the_bundled_trainer_uses_the_public_names_only(module):
    pieces = _pieces(module)
    assert pieces, f"trainer/{module} uses no library piece"
    private = [f"{m}.{n}" for m, n in pieces if n not in trainer.__all__
               or getattr(importlib.import_module(m), n) is not getattr(trainer, n)]
    # Never through the package face, which is for the library's users: tests/test_layers.py checks that.
    assert private == [], f"trainer/{module} reaches past the public names (trainer.__all__): {private}"


def test_train_uses_every_piece_of_the_library():
    used = {n for module in BUNDLED for _, n in _pieces(module)}
    assert {"CheckpointManager", "GlobalSampler", "read_step", "Tracker", "Watchdog", "Preemption",
            "init_distributed"} <= used


def test_job_env_reads_the_job_environment_and_falls_back_on_one_machine(tmp_path):
    env = {job_env.JOB_NAME: "own", job_env.RUN_DIR: "/mnt/nvme/runs/own",
           job_env.CHECKPOINT_DIR: "/mnt/nvme/runs/own/checkpoints", job_env.CHECKPOINT_URI: "s3://ck/research/own",
           job_env.DATASET_URI: "s3://own/manifest.json", job_env.DATA_CACHE_DIR: "/mnt/nvme/cache/own",
           job_env.DATA_ENDPOINT: "http://cache:39999/api/v1/s3", job_env.TRACKING_URI: "http://mlflow:5000",
           job_env.EXPERIMENT: "own", job_env.METRICS_PORT: "9400", job_env.SHUTDOWN: "285", "RANK": "5",
           "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RESTART_COUNT": "2"}
    job = trainer.JobEnv.from_environ(env)
    assert (job.job_name, job.run_dir, job.checkpoint_dir, job.checkpoint_uri) == (
        "own", Path("/mnt/nvme/runs/own"), Path("/mnt/nvme/runs/own/checkpoints"), "s3://ck/research/own")
    assert (job.dataset_uri, job.data_cache_dir, job.data_endpoint) == (
        "s3://own/manifest.json", "/mnt/nvme/cache/own", "http://cache:39999/api/v1/s3")
    assert (job.tracking_uri, job.experiment, job.metrics_port) == ("http://mlflow:5000", "own", 9401)
    assert (job.rank, job.local_rank, job.world_size, job.restart_count, job.shutdown_timeout_s) == (5, 1, 8, 2, 285)
    alone = trainer.JobEnv.from_environ({})
    assert (alone.job_name, alone.run_dir, alone.checkpoint_dir, alone.checkpoint_uri, alone.dataset_uri) == (
        "local", Path("runs/local"), Path("runs/local/checkpoints"), "", "synthetic")
    assert (alone.metrics_port, alone.rank, alone.world_size, alone.tracking_uri) == (0, 0, 1, "")
    with pytest.raises(ValueError, match="WORLD_SIZE must be a whole number"):
        trainer.JobEnv.from_environ({"WORLD_SIZE": "two"})


def test_every_variable_the_job_env_reads_is_listed_in_job_env():
    """JobEnv reads nothing JOB_ENV does not list."""
    source = (ROOT / "trainer" / "jobenv.py").read_text()
    read = {getattr(job_env, n.attr) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "job_env"}
    literal = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value.isupper() and "_" in n.value}
    assert read | literal <= job_env.names()
    assert read >= {job_env.RUN_DIR, job_env.CHECKPOINT_URI, job_env.DATASET_URI, job_env.TRACKING_URI}


def test_the_watchdog_takes_its_bounds_and_torchruns_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    wd = trainer.Watchdog(dump_dir=str(tmp_path))
    assert (wd.rank, wd.local_rank, wd.cfg, wd.dump_dir) == (3, 1, WatchdogConfig(), tmp_path)
    wd = trainer.Watchdog(WatchdogConfig(floor_s=5), rank=0, local_rank=0)
    assert (wd.rank, wd.cfg.floor_s) == (0, 5)


def test_preemption_outside_a_process_group_is_this_process():
    with trainer.Preemption() as preemption:
        assert preemption.any_rank() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.any_rank() is True


def test_the_guide_documents_every_public_name_and_every_job_env_variable():
    """docs/your-code.md is where a team reads the library's API and the environment its code gets."""
    guide = (ROOT / "docs" / "your-code.md").read_text()
    undocumented = [n for n in trainer.__all__ if f"`{n}" not in guide and f"{n}(" not in guide and f" {n}," not in guide]
    assert undocumented == [], undocumented
    assert [v.name for v in job_env.JOB_ENV if f"`{v.name}`" not in guide] == []
