"""`gpu-train serve --local`, the model server and the route refuse what they cannot serve before they start anything: a port
in use or out of range, a registered model the registry does not have. Each is one line naming the culprit, exit
status 2, no process left behind and nothing written into the working directory.

Run: .venv/bin/pytest tests/gpu_train/serving/test_local_errors.py -q

The commands run as subprocesses. Every process they start inherits a marker in its environment, which is how the
test finds any that outlives them (/proc/<pid>/environ).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.gpu_train.serving.servers import export_tiny

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
MARK = "GPU_TRAIN_TEST_MARK"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("export") / "tiny", seed=1)


def marked() -> set[int]:
    """Pids of live processes whose environment holds this test's marker."""
    needle = f"{MARK}={os.environ[MARK]}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def run(tmp_path, monkeypatch):
    """run(*argv, module=...) -> CompletedProcess of `python -m module ARGV` in an empty working directory, with
    no MLflow tracking URI; every process it started is killed afterwards (and must be gone already)."""
    monkeypatch.setenv(MARK, uuid.uuid4().hex)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"))

    def go(*argv: str, module: str = "gpu_train.cli.main", extra: dict[str, str] | None = None):
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env={**env, **(extra or {})},
                              capture_output=True, text=True, timeout=90)

    go.cwd = cwd
    yield go
    for pid in marked():
        os.kill(pid, 9)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-train: error: "), proc.stderr
    return lines[0]


@pytest.fixture
def occupied():
    """A port another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_one_line_and_leaves_no_process(run, export, occupied):
    proc = run("serve", "--local", str(export), "--port", str(occupied), "--threads", "1")
    assert proc.returncode == 2
    assert f"--port {occupied}: cannot listen on 127.0.0.1:{occupied} (in use" in one_line(proc)
    assert "serving" not in proc.stderr
    assert marked() == set()
    assert list(run.cwd.iterdir()) == []


@pytest.mark.parametrize("port", ["70000", "0", "-1"])
def test_a_port_out_of_range_is_one_line_and_leaves_no_process(run, export, port):
    proc = run("serve", "--local", str(export), "--port", port, "--threads", "1")
    assert proc.returncode == 2
    assert f"--port {port} is out of range (1..65535)" in one_line(proc)
    assert marked() == set()


def test_the_model_server_binds_its_port_before_it_loads_the_model(run, occupied, tmp_path):
    proc = run("--model", str(tmp_path / "not-yet-loaded"), "--name", "m", "--port", str(occupied),
               module="trainer.model_server")
    assert proc.returncode == 2
    assert f"--port {occupied}: cannot listen on 127.0.0.1:{occupied} (in use" in one_line(proc)


def test_a_registered_model_without_a_tracking_server_is_one_line_and_writes_nothing(run):
    proc = run("serve", "--local", "models:/missing/1")
    assert proc.returncode == 2
    assert "a registered model needs MLflow: give --tracking-uri URI or set MLFLOW_TRACKING_URI" in one_line(proc)
    assert list(run.cwd.iterdir()) == []


def test_a_model_the_registry_lacks_is_one_line_and_writes_nothing_here(run, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    proc = run("serve", "--local", "models:/missing/1", extra={"MLFLOW_TRACKING_URI": f"sqlite:///{store}/m.db"})
    assert proc.returncode == 2
    assert "model missing:1 is not in the registry" in one_line(proc)
    assert list(run.cwd.iterdir()) == []


def test_the_clusters_route_binds_its_port_before_it_reads_its_config_map(run, occupied):
    proc = run("--service", "chat", "--namespace", "team-research", "--config-map", "chat-route", "--port",
               str(occupied), module="gpu_train.serving.router")
    assert proc.returncode == 2
    assert f"--port {occupied}: cannot listen on 0.0.0.0:{occupied} (in use" in one_line(proc)
