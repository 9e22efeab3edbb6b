"""`gpu-train sweep status` reads a finished sweep's journal without Optuna, which the `cli` extra does not install.

Run: .venv/bin/pytest tests/gpu_train/cli/test_sweep_status.py -q

The journal is a real one: the sweep controller runs examples/sweep-tiny.yaml's ASHA sweep to its end on the
simulated trainer of tests/gpu_train/sweeps/test_controller.py. The command then runs in a fresh interpreter in
which `import optuna` fails (sys.modules["optuna"] = None), as in `pip install ".[cli]"`.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import yaml

from gpu_train.spec.sweep import parse_sweep
from gpu_train.sweeps.controller import Controller
from tests.gpu_train.spec.test_sweep import raw
from tests.gpu_train.sweeps.test_controller import SimBackend

pytestmark = pytest.mark.integration
BLOCKED = "import sys; sys.modules.update({m: None for m in sys.argv[1].split(',')}); sys.argv[1:2] = []; " \
          "from gpu_train.cli.main import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(spec file, runs folder, best trial) of a sweep the controller ran to its end."""
    tmp = tmp_path_factory.mktemp("sweep")
    doc = raw()
    sweep = parse_sweep(doc, "sweep.yaml")
    spec = tmp / "sweep.yaml"
    spec.write_text(yaml.safe_dump(doc))
    best = Controller(sweep, tmp / "runs" / sweep.name, SimBackend(sweep), out=io.StringIO()).run()
    return spec, tmp / "runs", best


def status(tmp_path, finished, blocked: str) -> subprocess.CompletedProcess:
    spec, runs, _ = finished
    return subprocess.run([sys.executable, "-c", BLOCKED, blocked, "sweep", "status", str(spec), "--runs", str(runs)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_status_reads_the_journal_where_optuna_cannot_be_imported(tmp_path, finished):
    proc = status(tmp_path, finished, "optuna")
    assert proc.returncode == 0, proc.stderr
    best = finished[2]
    lines = proc.stdout.splitlines()
    assert any(line.startswith(f"{best.id} *") for line in lines), proc.stdout
    assert f"best: {best.id} (*) val_loss {best.value:.4f}" in proc.stdout
    assert "8/8 trials" in proc.stdout
    assert (finished[1] / "sweep-tiny" / "sweep.png").is_file()


def test_without_matplotlib_the_table_comes_and_one_line_says_why_there_is_no_plot(tmp_path, finished):
    proc = status(tmp_path, finished, "optuna,matplotlib")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    plot = [line for line in proc.stdout.splitlines() if line.startswith("plot")]
    assert plot == ['plot      not drawn: it needs matplotlib (pip install ".[sweeps]" from the gpu-train checkout)']


def test_run_still_says_what_to_install_without_optuna(tmp_path, finished):
    spec, runs, _ = finished
    proc = subprocess.run([sys.executable, "-c", BLOCKED, "optuna", "sweep", "replay", str(spec), "--runs",
                           str(runs)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        'gpu-train: error: `gpu-train sweep replay` needs Optuna: pip install ".[cli,sweeps]" from the gpu-train '
        'checkout']
