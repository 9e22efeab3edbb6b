"""Alert rules: `promtool check rules` on the rules rendered for every stack, and the promtool unit
tests in infra/k8s/rules/tests/ showing each alert firing and not firing.

Usage: .venv/bin/pytest tests/infra/k8s/test_rules.py -q   (needs /usr/bin/promtool)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.config import MonitoringConfig
from infra.k8s import monitoring
from tests.infra.k8s.harness import STACKS, load_stack

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
TESTS_DIR = monitoring.RULES_DIR / "tests"


def render_to(directory: Path, settings: MonitoringConfig) -> list[Path]:
    out = []
    for path in sorted(monitoring.RULES_DIR.glob("*.yaml")):
        target = directory / path.name
        target.write_text(monitoring.render_rules_text(path.read_text(), monitoring.rule_parameters(settings),
                                                       str(path)))
        out.append(target)
    return out


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check_for_every_stack(tmp_path):
    for stack in STACKS:
        d = tmp_path / stack
        d.mkdir()
        files = render_to(d, load_stack(stack).monitoring)
        proc = promtool("check", "rules", *map(str, files))
        assert proc.returncode == 0, f"{stack}: {proc.stdout}{proc.stderr}"
        assert "SUCCESS" in proc.stdout


def test_thresholds_from_settings_are_rendered_in():
    settings = MonitoringConfig(low_utilization_percent=37, checkpoint_max_age_minutes=45)
    rules = {r["alert"]: r for g in monitoring.load_rule_groups(settings) for r in g["rules"]}
    assert rules["GpuLowUtilization"]["expr"].rstrip().endswith("< 37")
    assert rules["GpuLowUtilization"]["for"] == "30m"
    assert "> 2700" in rules["CheckpointTooOld"]["expr"]
    assert f'job="{monitoring.TRAINER_JOB}"' in rules["TrainerMetricsDown"]["expr"]
    assert 'job="dcgm-exporter"' in rules["DcgmExporterDown"]["expr"]
    assert "trainer_last_step_timestamp_seconds" in rules["TrainingStalled"]["expr"]


def test_every_alert_has_a_unit_test():
    alerts = {r["alert"] for g in monitoring.load_rule_groups(MonitoringConfig()) for r in g["rules"]}
    assert alerts >= {"GpuXidError", "GpuEccDoubleBitErrors", "GpuRowRemapFailure", "GpuLowUtilization",
                      "TrainingStalled", "GpuTemperatureHigh", "DcgmExporterDown", "TrainerMetricsDown",
                      "TrainerRestarting", "CheckpointTooOld"}
    tested_firing, tested_quiet = set(), set()
    for path in TESTS_DIR.glob("*.test.yaml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (tested_firing if check["exp_alerts"] else tested_quiet).add(check["alertname"])
    assert alerts <= tested_firing, f"no firing test for {alerts - tested_firing}"
    assert alerts <= tested_quiet, f"no not-firing test for {alerts - tested_quiet}"


def run_unit_tests(tmp_path: Path, settings: MonitoringConfig) -> dict[str, subprocess.CompletedProcess]:
    render_to(tmp_path, settings)
    results = {}
    for test in sorted(TESTS_DIR.glob("*.test.yaml")):
        shutil.copy(test, tmp_path / test.name)
        results[test.name] = promtool("test", "rules", str(tmp_path / test.name))
    assert results, f"no promtool unit tests in {TESTS_DIR}"
    return results


def test_promtool_unit_tests_pass(tmp_path):
    for name, proc in run_unit_tests(tmp_path, MonitoringConfig()).items():
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("change", [{"low_utilization_percent": 5}, {"checkpoint_max_age_minutes": 200}])
def test_unit_tests_notice_a_different_threshold(tmp_path, change):
    """The unit tests pin the default thresholds: rendering other values must make them fail, which
    shows the settings really reach the rules."""
    results = run_unit_tests(tmp_path, dataclasses.replace(MonitoringConfig(), **change))
    assert any(proc.returncode != 0 for proc in results.values())


# Job-wide trainer series (every local rank serves the same value) -> (input values every minute,
# the value one rank alone gives through the dashboard's expression).
JOB_WIDE = {
    "trainer_step": ("1200x30", 1200),
    "trainer_loss": ("2.5x30", 2.5),
    "trainer_tokens_per_second": ("50000x30", 50000),
    "trainer_mfu": ("0.4x30", 0.4),
    "trainer_tokens_total": ("0+6000x30", 100),  # 6000 tokens a minute = 100 tokens/s
}


def test_dashboard_job_wide_panels_do_not_multiply_by_the_number_of_ranks(tmp_path):
    """Every dashboard query over a job-wide series, evaluated by promtool with one job served by two
    ranks (two pods' endpoints, identical values), gives exactly the one-rank value: a `sum` over
    ranks would double it."""
    board = json.loads(monitoring.load_dashboards()["training.json"])
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    cases = []
    for expr in exprs:
        used = [m for m in JOB_WIDE if re.search(rf"\b{m}\b", expr)]
        if len(used) != 1:
            continue
        query = (expr.replace("$namespace", ".*").replace("$jobset", ".*")
                 .replace("$__rate_interval", "5m"))
        cases.append({"expr": query, "eval_time": "20m",
                      "exp_samples": [{"labels": '{namespace="team-a", jobset="job"}',
                                       "value": JOB_WIDE[used[0]][1]}]})
    assert {m for m in JOB_WIDE if any(re.search(rf"\b{m}\b", c["expr"]) for c in cases)} == set(JOB_WIDE)
    series = [{"series": f'{m}{{namespace="team-a", jobset="job", pod="job-worker-0-{p}", endpoint="metrics-{r}"}}',
               "values": values}
              for m, (values, _) in JOB_WIDE.items() for p in range(2) for r in range(2)]
    render_to(tmp_path, MonitoringConfig())
    test = {"rule_files": ["training.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}]}
    path = tmp_path / "dashboard.test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}"
    # Control: the same check fails for a sum over ranks, so it can tell the difference.
    summed = copy.deepcopy(test)
    summed["tests"][0]["promql_expr_test"] = [{**cases[0], "expr": cases[0]["expr"].replace("max by", "sum by", 1)}]
    path.write_text(yaml.safe_dump(summed, sort_keys=False))
    assert promtool("test", "rules", str(path)).returncode != 0
