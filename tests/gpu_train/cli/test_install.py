"""`pip install ".[cli]"` brings neither Pulumi nor torch, and the command works without them.

Run: .venv/bin/pytest tests/gpu_train/cli/test_install.py -q

Two halves: pip's own resolver says what the `cli` extra installs (no Pulumi package, no torch, none of the
trainer's or the Pulumi program's dependencies), and the command's everyday paths (help, `submit --dry-run
--platform`, `kubeconfig`) run in a Python environment that has neither those packages nor this project's infra,
policies and trainer packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpu_train.spec.install import install_hint
from tests.gpu_train.cli.conftest import contract_doc, spec

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("pulumi", "torch", "nvidia", "triton", "numpy", "mlflow", "tokenizers", "matplotlib", "pyarrow")


@pytest.fixture(scope="module")
def without(tmp_path_factory):
    """A Python environment holding this venv's packages except Pulumi's, torch and the trainer's heavy ones, and of
    this project only the gpu_train package (no infra, policies, trainer): what `pip install ".[cli]"` gives."""
    import site

    env_dir = tmp_path_factory.mktemp("cli-env")
    packages = Path(site.getsitepackages()[0])
    for entry in packages.iterdir():
        name = entry.name.lower()
        if name.startswith(HEAVY) or name.endswith(".pth") or name.startswith(("__editable__", "gpu_train")):
            continue
        (env_dir / entry.name).symlink_to(entry)
    (env_dir / "gpu_train").symlink_to(ROOT / "gpu_train")

    def run(*args: str, cwd: Path, code: str = "import sys; from gpu_train.cli.main import main; "
                                                   "sys.exit(main(sys.argv[1:]))") -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "PYTHONPATH")}
        env.update(PYTHONPATH=str(env_dir), HOME=str(cwd))
        # -S: no site-packages of this venv, only the environment above.
        return subprocess.run([sys.executable, "-S", "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=120)

    return run


@pytest.mark.parametrize("module", ["torch", "pulumi", "pulumi_kubernetes", "infra", "trainer", "policies"])
def test_the_environment_lacks_them(without, tmp_path, module):
    proc = without(cwd=tmp_path, code=f"import {module}")
    assert proc.returncode != 0 and f"No module named '{module}'" in proc.stderr


def test_help_submit_and_kubeconfig_work_without_pulumi_or_torch(without, tmp_path):
    assert without("--help", cwd=tmp_path).returncode == 0
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(contract_doc()))
    proc = without("submit", str(spec(tmp_path)), "--dry-run", "--platform", str(platform), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    jobset = yaml.safe_load(proc.stdout)
    assert jobset["kind"] == "JobSet" and jobset["metadata"]["namespace"] == "team-research"
    out = tmp_path / "kube.yaml"
    proc = without("kubeconfig", "--platform", str(platform), "--team", "research", "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(out.read_text())["contexts"][0]["context"]["namespace"] == "team-research"


def test_serve_dry_run_works_and_serve_local_says_what_to_install(without, tmp_path):
    """`gpu-train serve deploy --dry-run` renders with the cli extra alone (no MLflow for a pinned version);
    `serve --local`, which runs torch, names the extra that brings it."""
    from tests.gpu_train.cli.test_serve import pinned, platform

    proc = without("serve", "deploy", "tiny-gpt:3", "--team", "research", "--name", "chat", "--spec",
                   str(pinned(tmp_path)), "--dry-run", "--platform", str(platform(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [d["kind"] for d in yaml.safe_load_all(proc.stdout)] == ["InferenceService", "ConfigMap", "Deployment",
                                                                    "Service"]
    export = tmp_path / "export"
    export.mkdir()
    proc = without("serve", "--local", str(export), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert install_hint("serve-local") in proc.stderr


def test_run_local_without_the_trainer_says_what_to_install(without, tmp_path):
    proc = without("run", "--local", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert install_hint("trainer") in proc.stderr


@pytest.mark.slow
def test_the_cli_extra_installs_neither_pulumi_nor_torch(tmp_path):
    """pip's resolver, asked what `pip install ".[cli]"` would install into an empty environment."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), ".[cli]"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"gpu-train", "kubernetes", "pydantic"} <= names
    heavy = sorted(n for n in names if n.startswith("pulumi") or n in ("torch", "numpy", "mlflow-skinny", "grpcio-tools",
                                                                        "tokenizers", "matplotlib", "pyarrow"))
    assert heavy == []


@pytest.mark.slow
def test_the_sweeps_extra_adds_optuna_but_neither_pulumi_nor_torch(tmp_path):
    """`gpu-train sweep`'s controller: the cli and sweeps extras together bring Optuna, and still no Pulumi or
    torch (no Optuna code runs in a trial, so the trainer's image needs none of it)."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), ".[cli,sweeps]"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"optuna", "matplotlib", "mlflow-skinny", "kubernetes"} <= names
    assert sorted(n for n in names if n.startswith("pulumi") or n == "torch") == []
