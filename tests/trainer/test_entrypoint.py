"""What the image runs, tested without Docker: the trainer installed from its wheel (as the Dockerfile installs
it, from pyproject.toml, README.md and trainer/ only) and the launcher trainer/entrypoint.sh (trainer/launch.py):
its preflight, its wait for the dataset and the rendezvous host, and what it hands to torchrun.

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

from gpu_train.spec.trainer_config import PRESETS

# Runs the launcher and torchrun as processes.
pytestmark = pytest.mark.integration

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
    """A `torchrun` that records its arguments and the launcher-set environment, to see what it hands on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "torchrun"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$@" > {tmp_path / "argv"}\n'
        f'env | grep -E "^(TORCH_DISABLE_SHARE_RDZV_TCP_STORE|TRAINER_EXIT_FILE|TRAINER_LAUNCHER_PID|TORCH_(NCCL|FR)_[A-Z_]+)=" '
        f'| sort > {tmp_path / "env"}\n'
    )
    script.chmod(0o755)
    return bin_dir


def _launch_env(path: str) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RDZV_DNS_TIMEOUT", "TRAINER_DATA_WAIT_S", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    full.update({"PATH": path, "GPU_TRAIN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)})
    return full


def _launch(args: list[str], path: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCHER), *args], cwd=tmp_path, env={**_launch_env(path), **env},
                          capture_output=True, text=True, timeout=120)


TINY = ["tracking.enabled=false", "model.context=32", "train.global_batch_tokens=384", "train.micro_batch_size=2"]


def test_launcher_runs_torchrun_with_every_argument_and_the_store_switch(tmp_path):
    bin_dir = _fake_torchrun(tmp_path)
    args = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-endpoint=localhost:29400", "-m", "trainer",
            "--preset", "tiny", "--run-dir", str(tmp_path / "run"), *TINY, "tracking.experiment=with space"]
    proc = _launch(args, f"{bin_dir}:{os.environ['PATH']}", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "argv").read_text().splitlines() == args
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TRAINER_EXIT_FILE"].endswith("bad-input") and env["TRAINER_LAUNCHER_PID"].isdigit()
    assert not (tmp_path / "run" / "config.json").exists()  # the preflight writes nothing


def test_launcher_hands_torchrun_the_nccl_watchdog_settings_unless_already_set(tmp_path, monkeypatch):
    """NCCL's own watchdog must agree with the trainer's (trainer/watchdog.py): the launcher sets its settings for
    torchrun and the workers, and a value the caller exported wins."""
    from gpu_train.jobs.launch import nccl_env

    for key in [k for k in os.environ if k.startswith(("TORCH_NCCL_", "TORCH_FR_"))]:
        monkeypatch.delenv(key)
    bin_dir = _fake_torchrun(tmp_path)
    args = ["--nnodes=1", "--nproc-per-node=1", "--rdzv-endpoint=localhost:29400", "-m", "trainer",
            "--run-dir", str(tmp_path / "run"), *TINY]
    proc = _launch(args, f"{bin_dir}:{os.environ['PATH']}", tmp_path, TORCH_FR_BUFFER_SIZE="100")
    assert proc.returncode == 0, proc.stderr
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert {k: v for k, v in env.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_"))} == {
        **nccl_env(), "TORCH_FR_BUFFER_SIZE": "100"}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_launcher_fails_naming_a_rendezvous_host_that_never_resolves(tmp_path):
    bin_dir = _fake_torchrun(tmp_path)
    proc = _launch(["--rdzv-endpoint=worker-0-0.no-such-job.invalid:29400", "-m", "trainer", "--run-dir",
                    str(tmp_path / "run"), *TINY], f"{bin_dir}:{os.environ['PATH']}", tmp_path, RDZV_DNS_TIMEOUT="0")
    assert proc.returncode == 1
    assert "worker-0-0.no-such-job.invalid" in proc.stderr
    assert not (tmp_path / "argv").exists()  # torchrun never started
    bad = _launch(["--rdzv-endpoint=localhost:1"], f"{bin_dir}:{os.environ['PATH']}", tmp_path,
                  RDZV_DNS_TIMEOUT="ten")
    assert bad.returncode == 2 and "RDZV_DNS_TIMEOUT" in bad.stderr


@pytest.mark.parametrize(("args", "needle"), [
    # 12 sequences in micro batches of 2 fit 1, 2 and 3 workers, not 4 (MAX nodes x 1 GPU).
    (["--nnodes=1:4", "--nproc-per-node=1"], "at world size 4"),
    (["--nnodes=1", "--nproc-per-node=1", "train.stepz=3"], "train.stepz: unknown key"),
    (["--nnodes=1", "--nproc-per-node=1", "train.lr=inf"], "train.lr must be a finite number"),
    (["--nnodes=1", "--nproc-per-node=2", "metrics.port=65535"], "metrics.port 65535 + 1"),
])
def test_launcher_preflight_refuses_bad_settings_before_torchrun(tmp_path, args, needle):
    bin_dir = _fake_torchrun(tmp_path)
    torchrun_args = [a for a in args if a.startswith("--")]
    overrides = [a for a in args if not a.startswith("--")]
    proc = _launch([*torchrun_args, "--rdzv-endpoint=localhost:29400", "-m", "trainer", "--run-dir",
                    str(tmp_path / "run"), *TINY, *overrides], f"{bin_dir}:{os.environ['PATH']}", tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "argv").exists()


def test_launcher_refuses_a_missing_local_dataset_at_once_whatever_the_wait(tmp_path):
    """Nothing uploads into a directory on this disk while the launcher waits: a missing file:// manifest (or one
    under a plain path) is a mistyped path, refused with one line naming it although TRAINER_DATA_WAIT_S is 600."""
    bin_dir = _fake_torchrun(tmp_path)
    for uri, named in ((f"file://{tmp_path / 'no-such'}", f"file://{tmp_path / 'no-such'}/manifest.json"),
                       (str(tmp_path / "typo"), f"file://{tmp_path / 'typo'}/manifest.json")):
        args = ["--nnodes=1", "--nproc-per-node=1", "--rdzv-endpoint=localhost:29400", "-m", "trainer", "--run-dir",
                str(tmp_path / "run"), *TINY, f"data.uri={uri}"]
        try:
            missing = subprocess.run(["bash", str(LAUNCHER), *args], cwd=tmp_path, capture_output=True, text=True,
                                     timeout=60, env={**_launch_env(f"{bin_dir}:{os.environ['PATH']}"),
                                                      "TRAINER_DATA_WAIT_S": "600"})
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher still waits for the local dataset {uri}") from None
        assert missing.returncode == 2, missing.stderr
        lines = missing.stderr.strip().splitlines()
        assert len(lines) == 1 and f"dataset manifest {named} not found" in lines[0], missing.stderr
        assert "waiting" not in missing.stderr and "Traceback" not in missing.stderr
        assert not (tmp_path / "argv").exists()


def test_launcher_waits_for_a_dataset_in_object_storage_then_starts(tmp_path, s3):
    """The manifest appears in the store while the launcher waits (TRAINER_DATA_WAIT_S): one message, then
    torchrun."""
    bin_dir = _fake_torchrun(tmp_path)
    uri = f"s3://{s3.bucket}/ds"
    args = ["--nnodes=1", "--nproc-per-node=1", "--rdzv-endpoint=localhost:29400", "-m", "trainer", "--run-dir",
            str(tmp_path / "run"), *TINY, f"data.uri={uri}", f"data.endpoint_url={s3.endpoint}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    env = {**_launch_env(f"{bin_dir}:{os.environ['PATH']}"), **s3.env}
    missing = subprocess.run(["bash", str(LAUNCHER), *args], cwd=tmp_path, env={**env, "TRAINER_DATA_WAIT_S": "0"},
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert f"dataset manifest {uri}/manifest.json not found" in missing.stderr
    assert "python -m trainer.data prepare" in missing.stderr and "Traceback" not in missing.stderr
    assert not (tmp_path / "argv").exists()

    proc = subprocess.Popen(["bash", str(LAUNCHER), *args], cwd=tmp_path, env={**env, "TRAINER_DATA_WAIT_S": "90"},
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # blocks until the launcher says what it waits for
        assert f"waiting up to 90s (TRAINER_DATA_WAIT_S) for dataset manifest {uri}/manifest.json" in first
        assert not (tmp_path / "argv").exists()
        data = tmp_path / "data"
        subprocess.run([sys.executable, "-m", "trainer.data", "synth", "--out", f"file://{data}", "--tokens", "20000"],
                       cwd=ROOT, check=True, capture_output=True, timeout=120)
        client = s3.client()
        for f in sorted(data.iterdir(), key=lambda f: f.name == "manifest.json"):  # the manifest last
            client.upload_file(str(f), s3.bucket, f"ds/{f.name}")
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, rest
    finally:
        proc.kill()
        proc.wait()
    assert "waiting" not in rest  # said once
    assert (tmp_path / "argv").exists()


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
