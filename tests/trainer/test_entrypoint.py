"""What the image runs, tested without Docker: the trainer installed from its wheel (as the Dockerfile installs
it, from pyproject.toml, README.md and trainer/ only) and the launcher script trainer/entrypoint.sh.

Run: .venv/bin/pytest tests/trainer/test_entrypoint.py -q
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trainer.config import PRESETS

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "trainer" / "entrypoint.sh"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The trainer wheel built from a copy of exactly the image's inputs, installed with --no-deps into a target
    directory that is used on top of this venv's packages (like a --system-site-packages venv)."""
    base = tmp_path_factory.mktemp("image")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "trainer", src / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = base / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(wheels)],
        check=True, cwd=src, capture_output=True, timeout=300,
    )
    (wheel,) = wheels.glob("gpu_train-*.whl")
    site = base / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RDZV_DNS_TIMEOUT")}
    env["PYTHONPATH"] = str(site)
    env.update(extra)
    return env


def test_wheel_holds_every_trainer_module_and_nothing_from_infra(installed):
    wheel = next((installed.parent / "wheels").glob("gpu_train-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if n.endswith(".py")}
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer").rglob("*.py")
                if "__pycache__" not in p.parts}
    assert expected <= modules, f"missing from the wheel: {sorted(expected - modules)}"
    assert not any(n.startswith(("infra/", "policies/", "tests/")) for n in names)


def test_installed_trainer_help_lists_the_presets(installed, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import trainer; print(trainer.__file__)"],
        cwd=outside, env=_env(installed), capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(installed), f"imported the checkout, not the wheel: {where}"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--help"],
        cwd=outside, env=_env(installed), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for preset in PRESETS:
        assert preset in proc.stdout
    assert "--run-dir" in proc.stdout and "train.global_batch_tokens" in proc.stdout


def _fake_torchrun(tmp_path: Path) -> Path:
    """A `torchrun` that records its arguments, to see exactly what the launcher hands on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv"
    script = bin_dir / "torchrun"
    script.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\n')
    script.chmod(0o755)
    return bin_dir


def _launch(args: list[str], path: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "RDZV_DNS_TIMEOUT"}
    full.update(PATH=path, **env)
    return subprocess.run(["bash", str(LAUNCHER), *args], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=60)


def test_launcher_execs_torchrun_with_every_argument_once_the_host_resolves(tmp_path):
    bin_dir = _fake_torchrun(tmp_path)
    args = ["--nnodes=1:2", "--rdzv-endpoint=localhost:29400", "-m", "trainer", "--preset", "tiny",
            "data.uri=s3://b/with space/manifest.json"]
    proc = _launch(args, f"{bin_dir}:{os.environ['PATH']}", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "argv").read_text().splitlines() == args


def test_launcher_fails_naming_a_rendezvous_host_that_never_resolves(tmp_path):
    bin_dir = _fake_torchrun(tmp_path)
    proc = _launch(["--rdzv-endpoint=worker-0-0.no-such-job.invalid:29400", "-m", "trainer"],
                   f"{bin_dir}:{os.environ['PATH']}", tmp_path, RDZV_DNS_TIMEOUT="0")
    assert proc.returncode == 1
    assert "worker-0-0.no-such-job.invalid" in proc.stderr
    assert not (tmp_path / "argv").exists()  # torchrun never started
    bad = _launch(["--rdzv-endpoint=localhost:1"], f"{bin_dir}:{os.environ['PATH']}", tmp_path,
                  RDZV_DNS_TIMEOUT="ten")
    assert bad.returncode == 2 and "RDZV_DNS_TIMEOUT" in bad.stderr


def test_launcher_runs_the_real_torchrun_on_the_installed_trainer(installed, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    venv_bin = str(Path(sys.executable).parent)
    proc = _launch(
        ["--nnodes=1:1", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
         "--rdzv-id=entrypoint-test", "--max-restarts=0", "-m", "trainer", "--help"],
        f"{venv_bin}:{os.environ['PATH']}", tmp_path, PYTHONPATH=str(installed),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(p in proc.stdout for p in PRESETS)
