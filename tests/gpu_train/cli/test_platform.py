"""`gpu-train platform` writes a stack's platform contract from its offline plan, and the commands that need a
platform file say so when they have neither it nor a cluster.

Run: .venv/bin/pytest tests/gpu_train/cli/test_platform.py -q

The first test runs the real command, which runs the real plan tool (python -m infra.plan) for aws-dev: 28 s measured
on a 2-core machine busy with other work. The file it writes is then used as a newcomer would: `gpu-train lint` over
examples/jobs and `gpu-train submit --dry-run` of one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpu_train.cli.main import PLATFORM_HINT, main
from gpu_train.spec.contract import PlatformContract

ROOT = Path(__file__).resolve().parents[3]
JOBS = ROOT / "examples" / "jobs"


def gpu_train(*args: str, cwd: Path, code: str = "from gpu_train.cli.main import main") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(cwd)}
    env.pop("KUBECONFIG", None)
    return subprocess.run([sys.executable, "-c", f"import sys; {code}; sys.exit(main(sys.argv[1:]))", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("newcomer")
    return cwd, gpu_train("platform", "--stack", "aws-dev", cwd=cwd)


@pytest.mark.integration
def test_platform_runs_the_offline_plan_and_writes_a_contract_the_commands_use(written, capsys):
    cwd, proc = written
    assert proc.returncode == 0, proc.stderr
    first, last = proc.stderr.strip().splitlines()
    assert first.startswith("gpu-train: running the offline plan (python -m infra.plan --stack aws-dev")
    assert last.startswith("gpu-train: ran the offline plan (python -m infra.plan --stack aws-dev); wrote the "
                           "platform contract of stack 'aws-dev' to platform.json")
    assert sorted(p.name for p in cwd.iterdir()) == ["platform.json"]  # the plan itself went to a temporary folder
    contract = PlatformContract.from_json((cwd / "platform.json").read_text(), "platform.json")
    assert contract.stack == "aws-dev" and {t.name for t in contract.teams} >= {"research", "platform"}
    assert main(["lint", str(JOBS), "--platform", str(cwd / "platform.json")]) == 0
    assert "2 job specs pass every check" in capsys.readouterr().out
    assert main(["submit", str(JOBS / "research" / "gpt2-small.yaml"), "--dry-run", "--platform",
                 str(cwd / "platform.json")]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metadata"]["namespace"] == "team-research"


@pytest.mark.integration
def test_platform_reads_a_plan_already_written_without_importing_pulumi(written, tmp_path):
    contract = json.loads((written[0] / "platform.json").read_text())
    plan = tmp_path / "aws-dev.json"
    plan.write_text(json.dumps({"stack": "aws-dev", "outputs": {"platform": contract}}))
    proc = gpu_train("platform", "--plan", str(plan), "-o", "out/p.json", cwd=tmp_path,
                     code="from gpu_train.cli.main import main; import atexit; "
                          "atexit.register(lambda: print('pulumi' in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert f"read the existing plan {plan} (written " in proc.stderr and "nothing was run" in proc.stderr
    assert json.loads((tmp_path / "out" / "p.json").read_text()) == contract


def test_a_plan_that_is_not_there_or_has_no_platform_is_one_line(tmp_path, capsys):
    assert main(["platform", "--plan", str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gpu-train: error: --plan {tmp_path / 'nope.json'}: no such file (python -m infra.plan --stack <stack> "
        "writes build/plan/<stack>.json)"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"stack": "x", "outputs": {}}))
    assert main(["platform", "--plan", str(other)]) == 2
    assert "the plan has no `platform` output" in capsys.readouterr().err
    assert not (tmp_path / "platform.json").exists()


@pytest.mark.parametrize("argv", [
    ["lint", str(JOBS)],
    ["apply", str(JOBS), "--dry-run"],
    ["submit", str(JOBS / "research" / "gpt2-small.yaml"), "--dry-run"],
    ["sweep", "run", str(ROOT / "examples" / "sweep-tiny.yaml"), "--dry-run"],
])
def test_without_a_cluster_or_a_platform_file_the_commands_point_at_platform(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu-train: error: ") and err[0].endswith(PLATFORM_HINT), err
    assert "`gpu-train platform --stack <stack>` writes one from the offline plan" in PLATFORM_HINT
