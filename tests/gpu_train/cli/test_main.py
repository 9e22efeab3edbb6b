"""`gpu-train` as installed: the console script from a wheel of this project installed fresh, its help and every
subcommand's help, one-line errors, and what the command imports.

Run: .venv/bin/pytest tests/gpu_train/cli/test_main.py -q
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# Builds and installs the project's wheel.
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = ("kubeconfig", "submit", "list", "status", "logs", "pause", "resume", "cancel", "run", "serve")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of its sources, installed (no dependencies: they are this venv's)
    into a fresh directory; its bin/gpu-train is the console script pyproject.toml declares."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("gpu_train", "infra", "trainer", "policies"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = base / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w",
                    str(wheels)], check=True, cwd=src, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("gpu_train-*.whl")
    entry_points = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("entry_points.txt"))
    assert "gpu-train = gpu_train.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    site = base / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return site


def _run(installed: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KUBECONFIG")}
    env.update(PYTHONPATH=str(installed), HOME=str(cwd))
    return subprocess.run([str(installed / "bin" / "gpu-train"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_help_of_the_installed_command_and_of_every_subcommand(installed, tmp_path):
    proc = _run(installed, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert all(c in proc.stdout for c in COMMANDS)
    for command in COMMANDS:
        proc = _run(installed, command, "--help", cwd=tmp_path)
        assert proc.returncode == 0, (command, proc.stderr)
        assert f"usage: gpu-train {command}" in proc.stdout
    assert "--dry-run" in _run(installed, "submit", "--help", cwd=tmp_path).stdout
    assert "--follow" in _run(installed, "logs", "--help", cwd=tmp_path).stdout
    assert "--local" in _run(installed, "run", "--help", cwd=tmp_path).stdout


def test_the_installed_command_runs_from_the_wheel_not_the_checkout(installed, tmp_path):
    proc = _run(installed, "list", cwd=tmp_path)  # no kubeconfig in this HOME
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu-train: error: no kubeconfig:") and "Traceback" not in proc.stderr
    where = subprocess.run([sys.executable, "-c", "import gpu_train.cli; print(gpu_train.cli.__file__)"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(installed)}, capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(installed)


def test_usage_errors_come_from_argparse_with_status_2(installed, tmp_path):
    proc = _run(installed, "run", cwd=tmp_path)
    assert proc.returncode == 2 and "--local" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run(installed, "frobnicate", cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["submit", "--help"]])
def test_help_imports_neither_pulumi_nor_the_stacks_modules_nor_the_kubernetes_client(argv):
    # The command's own entry point, as the console script runs it; the kubernetes client alone takes half a second.
    code = (f"import sys\nfrom gpu_train.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('pulumi', 'pulumi_kubernetes', 'infra', 'kubernetes', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "usage: gpu-train" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_no_module_of_the_command_imports_pulumi():
    for path in sorted((ROOT / "gpu_train" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0].startswith("pulumi") for n in names), (path.name, names)


def test_changing_the_command_never_rebuilds_the_trainer_image():
    """The image tag hashes exactly what the Dockerfile copies (infra/image.py): the command's package is not
    among it, so a change to gpu-train leaves the image, and a running stack job, alone."""
    from infra import image

    inputs = image.image_inputs()
    assert inputs and not any(p.startswith("gpu_train/cli/") for p in inputs)
    assert any(p.startswith("trainer/") for p in inputs)
