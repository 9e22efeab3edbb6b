"""Alert rules: `promtool check rules` on the rules rendered for every stack, and the promtool unit
tests in infra/k8s/rules/tests/ showing each alert firing and not firing.

Usage: .venv/bin/pytest tests/infra/k8s/test_rules.py -q   (needs /usr/bin/promtool)
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpu_train.spec.settings import HealthSettings, MonitoringSettings
from infra.k8s import monitoring
from tests.infra.k8s.harness import STACKS, load_stack

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
TESTS_DIR = monitoring.RULES_DIR / "tests"


def render_to(directory: Path, settings: MonitoringSettings, health: HealthSettings | None = None) -> list[Path]:
    out = []
    for path in sorted(monitoring.RULES_DIR.glob("*.yaml")):
        target = directory / path.name
        target.write_text(monitoring.render_rules_text(
            path.read_text(), monitoring.rule_parameters(settings, health), str(path)))
        out.append(target)
    return out


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check_for_every_stack(tmp_path):
    for stack in STACKS:
        d = tmp_path / stack
        d.mkdir()
        cfg = load_stack(stack)
        files = render_to(d, cfg.monitoring, cfg.health)
        proc = promtool("check", "rules", *map(str, files))
        assert proc.returncode == 0, f"{stack}: {proc.stdout}{proc.stderr}"
        assert "SUCCESS" in proc.stdout


def test_thresholds_from_settings_are_rendered_in():
    settings = MonitoringSettings(low_utilization_percent=37, checkpoint_max_age_minutes=45)
    rules = {r["alert"]: r for g in monitoring.load_rule_groups(settings) for r in g["rules"] if "alert" in r}
    assert rules["GpuLowUtilization"]["expr"].rstrip().endswith("< 37")
    assert rules["GpuLowUtilization"]["for"] == "30m"
    assert "> 2700" in rules["CheckpointTooOld"]["expr"]
    assert f'job="{monitoring.TRAINER_JOB}"' in rules["TrainerMetricsDown"]["expr"]
    assert 'job="dcgm-exporter"' in rules["DcgmExporterDown"]["expr"]
    assert "trainer_last_step_timestamp_seconds" in rules["TrainingStalled"]["expr"]


def test_every_alert_has_a_unit_test():
    alerts = {r["alert"] for g in monitoring.load_rule_groups(MonitoringSettings()) for r in g["rules"] if "alert" in r}
    assert alerts >= {"GpuXidError", "GpuEccDoubleBitErrors", "GpuRowRemapFailure", "GpuLowUtilization",
                      "TrainingStalled", "GpuTemperatureHigh", "DcgmExporterDown", "TrainerMetricsDown",
                      "TrainerRestarting", "CheckpointTooOld", "GpuFaultDetected", "GpuHardwareNotReady",
                      "GpuNodeQuarantined", "GpuQuarantineStorm", "GpuPreflightFailed", "TrainingStraggler",
                      "PlatformWorkloadUnavailable"}
    tested_firing, tested_quiet = set(), set()
    for path in TESTS_DIR.glob("*.test.yaml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (tested_firing if check["exp_alerts"] else tested_quiet).add(check["alertname"])
    assert alerts <= tested_firing, f"no firing test for {alerts - tested_firing}"
    assert alerts <= tested_quiet, f"no not-firing test for {alerts - tested_quiet}"


def run_unit_tests(tmp_path: Path, settings: MonitoringSettings,
                   health: HealthSettings | None = None) -> dict[str, subprocess.CompletedProcess]:
    render_to(tmp_path, settings, health)
    results = {}
    for test in sorted(TESTS_DIR.glob("*.test.yaml")):
        shutil.copy(test, tmp_path / test.name)
        results[test.name] = promtool("test", "rules", str(tmp_path / test.name))
    assert results, f"no promtool unit tests in {TESTS_DIR}"
    return results


def test_promtool_unit_tests_pass(tmp_path):
    for name, proc in run_unit_tests(tmp_path, MonitoringSettings()).items():
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("change", [{"low_utilization_percent": 5}, {"checkpoint_max_age_minutes": 200}])
def test_unit_tests_notice_a_different_threshold(tmp_path, change):
    """The unit tests pin the default thresholds: rendering other values must make them fail, which
    shows the settings really reach the rules."""
    results = run_unit_tests(tmp_path, MonitoringSettings(**change))
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
        if len(used) != 1 or "DCGM_" in expr:  # the energy panels use trainer_step only to name the job
            continue
        query = (expr.replace("$namespace", ".*").replace("$jobset", ".*").replace("$sweep-t[0-9]{3}", ".*")
                 .replace("$__rate_interval", "5m"))
        cases.append({"expr": query, "eval_time": "20m",
                      "exp_samples": [{"labels": '{namespace="team-a", jobset="job"}',
                                       "value": JOB_WIDE[used[0]][1]}]})
    assert {m for m in JOB_WIDE if any(re.search(rf"\b{m}\b", c["expr"]) for c in cases)} == set(JOB_WIDE)
    series = [{"series": f'{m}{{namespace="team-a", jobset="job", pod="job-worker-0-{p}", endpoint="metrics-{r}"}}',
               "values": values}
              for m, (values, _) in JOB_WIDE.items() for p in range(2) for r in range(2)]
    render_to(tmp_path, MonitoringSettings())
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


def test_the_quarantine_storm_threshold_comes_from_the_health_settings(tmp_path):
    """health.maxConcurrentRepairs is the storm alert's threshold: with 3, two quarantined nodes are no storm,
    so the unit test (written for the default 1) fails, and only that test file."""
    rules = {r["alert"]: r for g in monitoring.load_rule_groups(
        MonitoringSettings(), health_settings=HealthSettings(max_concurrent_repairs=3)) for r in g["rules"] if "alert" in r}
    assert rules["GpuQuarantineStorm"]["expr"].rstrip().endswith("> 3")
    results = run_unit_tests(tmp_path, MonitoringSettings(), HealthSettings(max_concurrent_repairs=3))
    assert {name for name, proc in results.items() if proc.returncode != 0} == {"health.test.yaml"}


def _straggler_case(tmp_path: Path, mutate) -> subprocess.CompletedProcess:
    render_to(tmp_path, MonitoringSettings())
    doc = yaml.safe_load((TESTS_DIR / "straggler.test.yaml").read_text())
    mutate(doc["tests"][0])
    path = tmp_path / "straggler-control.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return promtool("test", "rules", str(path))


def test_the_straggler_test_fails_when_no_rank_is_slow(tmp_path):
    """Control for straggler.test.yaml: give rank 3 the others' compute time and the same expectations must
    fail (no alert, ratio 1), which shows the slowed rank is what makes the series and the alert fire."""
    def even_out(case):
        for s in case["input_series"]:
            if s["series"].startswith("trainer_rank_compute_seconds") and 'rank="3"' in s["series"]:
                s["values"] = "0.1875x30"
    proc = _straggler_case(tmp_path, even_out)
    assert proc.returncode != 0 and "TrainingStraggler" in proc.stdout + proc.stderr


def test_a_rank_slow_on_input_is_a_straggler_too(tmp_path):
    """Slowing rank 3's input instead of its compute (same busy time) gives the same series and alert."""
    def slow_input(case):
        for s in case["input_series"]:
            if 'jobset="llm"' in s["series"] and 'rank="3"' in s["series"]:
                s["values"] = "0.1875x30" if s["series"].startswith("trainer_rank_compute") else "0.3125x30"
    proc = _straggler_case(tmp_path, slow_input)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_straggler_rules_keep_rank_pod_and_node_and_the_monitor_adds_node():
    groups = {g["name"]: g for g in monitoring.load_rule_groups(MonitoringSettings())}
    rules = {r.get("record") or r.get("alert"): r for r in groups["gpu-train.straggler"]["rules"]}
    assert set(rules) == {"trainer:rank_busy_seconds:avg5m", "trainer:rank_busy_over_median:ratio",
                          "jobset:trainer_slowest_rank_over_median:ratio", "TrainingStraggler"}
    assert str(monitoring.STRAGGLER_RATIO) in rules["TrainingStraggler"]["expr"]
    summary = rules["TrainingStraggler"]["annotations"]["summary"]
    assert "$labels.rank" in summary and "$labels.node" in summary
    spec = monitoring.trainer_pod_monitor_spec(["team-a"], 2)
    for endpoint in spec["podMetricsEndpoints"]:
        assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]


def _grafana_to_promql(expr: str, jobset: str = ".*") -> str:
    return (expr.replace("$namespace", ".*").replace("$jobset", jobset).replace("$Hostname", ".*")
            .replace("$gpu", ".*").replace("$sweep", ".*").replace("$__rate_interval", "5m").replace("$__range", "10m"))


def test_every_dashboard_query_parses_and_evaluates(tmp_path):
    """Every panel query of both dashboards, evaluated by promtool with no input series: it must parse, and
    it gives nothing, or 0 where it counts (`or vector(0)`). A query promtool cannot parse fails here."""
    cases = []
    for board in monitoring.load_dashboards().values():
        for panel in json.loads(board)["panels"]:
            for target in panel.get("targets", []):
                expr = _grafana_to_promql(target["expr"])
                cases.append({"expr": expr, "eval_time": "1m",
                              "exp_samples": [{"labels": "{}", "value": 0}] if "or vector(0)" in expr else []})
    assert len(cases) > 30
    render_to(tmp_path, MonitoringSettings())
    path = tmp_path / "dashboards.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["gpu.yaml"], "evaluation_interval": "1m",
                                    "tests": [{"interval": "1m", "input_series": [], "promql_expr_test": cases}]}))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases[0]["expr"] = "max by (node (kube_node_spec_taint)"
    path.write_text(yaml.safe_dump({"rule_files": ["gpu.yaml"], "tests": [
        {"interval": "1m", "input_series": [], "promql_expr_test": cases[:1]}]}))
    assert promtool("test", "rules", str(path)).returncode != 0


def test_the_straggler_table_names_the_slowed_ranks_node(tmp_path):
    """The Training dashboard's table of slowest ranks, over the straggler unit test's series: rank 3 on
    node-b leads it (ratio 2); the other three ranks of the job follow at 1."""
    board = json.loads(monitoring.load_dashboards()["training.json"])
    (panel,) = [p for p in board["panels"] if p["title"] == "Slowest ranks and their nodes"]
    assert panel["type"] == "table"
    expr = _grafana_to_promql(panel["targets"][0]["expr"], jobset="llm")
    render_to(tmp_path, MonitoringSettings())
    straggler = yaml.safe_load((TESTS_DIR / "straggler.test.yaml").read_text())["tests"][0]
    base = 'trainer:rank_busy_over_median:ratio{namespace="team-research", jobset="llm", '
    expected = [
        {"labels": base + 'pod="llm-worker-0-1", node="node-b", endpoint="metrics-1", rank="3"}', "value": 2},
        {"labels": base + 'pod="llm-worker-0-0", node="node-a", endpoint="metrics-0", rank="0"}', "value": 1},
        {"labels": base + 'pod="llm-worker-0-0", node="node-a", endpoint="metrics-1", rank="1"}', "value": 1},
        {"labels": base + 'pod="llm-worker-0-1", node="node-b", endpoint="metrics-0", rank="2"}', "value": 1},
    ]
    path = tmp_path / "table.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["training.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": straggler["input_series"],
         "promql_expr_test": [{"expr": expr, "eval_time": "15m", "exp_samples": expected}]}]}))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unavailable_workloads_are_watched_in_every_namespace_the_platform_installs_into(plans):
    """PlatformWorkloadUnavailable and the Platform dashboard cover each namespace a plan creates or installs a
    release into, team namespaces and kube-system (the clouds' add-ons) aside."""
    watched = set(monitoring.PLATFORM_NAMESPACES)
    for stack, plan in plans.items():
        created = {r["inputs"]["metadata"]["name"] for r in plan["resources"] if r["type"] == "kubernetes:core/v1:Namespace"}
        released = {r["inputs"]["namespace"] for r in plan["resources"] if r["type"] == "kubernetes:helm.sh/v3:Release"}
        platform = {n for n in created | released if not n.startswith("team-") and n != "kube-system"}
        assert platform <= watched, f"{stack}: not watched: {sorted(platform - watched)}"
    rule = next(r for g in monitoring.load_rule_groups(MonitoringSettings()) for r in g["rules"]
                if r.get("alert") == "PlatformWorkloadUnavailable")
    regex = f'namespace=~"{"|".join(sorted(watched))}"'
    assert rule["expr"].count(regex) == 4, rule["expr"]
    board = json.loads(monitoring.load_dashboards()["platform.json"])
    variable = next(v for v in board["templating"]["list"] if v["name"] == "namespace")
    assert set(variable["query"].split(",")) == watched
    assert set(variable["allValue"].split("|")) == watched


def test_the_platform_dashboard_shows_the_workload_the_alert_names(tmp_path):
    """The Platform dashboard's table, over the alert's unit-test series (a DaemonSet with 0 of 3 pods), lists
    that DaemonSet with 3 unavailable pods; a recovered workload is not listed."""
    board = json.loads(monitoring.load_dashboards()["platform.json"])
    table = next(p for p in board["panels"] if p["type"] == "table")
    names = "|".join(sorted(monitoring.PLATFORM_NAMESPACES))
    expr = table["targets"][0]["expr"].replace("$namespace", names)
    series = yaml.safe_load((TESTS_DIR / "workloads.test.yaml").read_text())["tests"][0]["input_series"]
    doc = {"evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": expr, "eval_time": "5m", "exp_samples": [
            {"labels": '{namespace="node-metrics", workload="DaemonSet/kube-prometheus-stack-prometheus-node-exporter"}',
             "value": 3}]},
        {"expr": expr, "eval_time": "25m", "exp_samples": []}]}]}
    path = tmp_path / "platform-dashboard.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}"


def test_the_energy_panels_add_up_the_jobs_gpus(tmp_path):
    """The Training dashboard's energy and power panels over dcgm-exporter series (the GPU's pod and namespace in
    exported_* labels, as Prometheus renames them beside the exporter's own) and the trainer's: two GPUs of job llm
    on two pods, another job's GPU left out."""
    board = json.loads(monitoring.load_dashboards()["training.json"])
    panels = {p["title"]: p for p in board["panels"]}
    energy = _grafana_to_promql(panels["GPU energy over the time range (kWh)"]["targets"][0]["expr"])
    power = _grafana_to_promql(panels["GPU power by job (W)"]["targets"][0]["expr"])
    dcgm = 'namespace="node-metrics", pod="dcgm-exporter-x", exported_namespace="team-a", '
    series = [
        # 1,800,000 mJ a minute = 30 W; over 10 minutes 18,000,000 mJ = 0.005 kWh per GPU.
        {"series": f'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{dcgm}exported_pod="llm-worker-0-0-a", gpu="0"}}',
         "values": "0+1800000x20"},
        {"series": f'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{dcgm}exported_pod="llm-worker-0-1-b", gpu="0"}}',
         "values": "0+1800000x20"},
        {"series": f'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{dcgm}exported_pod="other-worker-0-0-c", gpu="1"}}',
         "values": "0+9000000x20"},
        {"series": f'DCGM_FI_DEV_POWER_USAGE{{{dcgm}exported_pod="llm-worker-0-0-a", gpu="0"}}', "values": "300x20"},
        {"series": f'DCGM_FI_DEV_POWER_USAGE{{{dcgm}exported_pod="llm-worker-0-1-b", gpu="0"}}', "values": "250x20"},
        *({"series": f'trainer_step{{namespace="team-a", jobset="llm", pod="llm-worker-0-{i}-{x}", '
                     f'endpoint="metrics-{r}"}}', "values": "5x20"} for i, x in ((0, "a"), (1, "b")) for r in (0, 1)),
    ]
    # 2 GPUs x 0.005 kWh = 0.01 kWh; power 300 W + 250 W = 550 W. The other job has no trainer series here.
    cases = [{"expr": energy, "eval_time": "20m",
              "exp_samples": [{"labels": '{namespace="team-a", jobset="llm"}', "value": 0.01}]},
             {"expr": power, "eval_time": "20m",
              "exp_samples": [{"labels": '{namespace="team-a", jobset="llm"}', "value": 550}]}]
    render_to(tmp_path, MonitoringSettings())
    path = tmp_path / "energy.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["training.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": cases}]}))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_sweep_panels_show_the_chosen_sweeps_trials_only(tmp_path):
    """The Sweep variable takes a sweep's name from its trials' JobSets (<sweep>-tNNN), and the sweep panels, with
    it set, show exactly those trials: not another sweep's, not a job that merely starts with the same name."""
    board = json.loads(monitoring.load_dashboards()["training.json"])
    (variable,) = [v for v in board["templating"]["list"] if v["name"] == "sweep"]
    pattern = re.compile(variable["regex"].strip("/"))
    names = ["lr-sweep-t000", "lr-sweep-t013", "lr-sweep-final", "other-t001", "gpt2-smoke"]
    assert sorted({m.group(1) for n in names if (m := pattern.match(n))}) == ["lr-sweep", "other"]
    (loss,) = [p for p in board["panels"] if p["title"] == "Sweep trials: validation loss"]
    expr = _grafana_to_promql(loss["targets"][0]["expr"]).replace('".*-t[0-9]{3}"', '"lr-sweep-t[0-9]{3}"')
    series = [{"series": f'trainer_val_loss{{namespace="team-a", jobset="{n}", pod="{n}-worker-0-{p}"}}',
               "values": "3+0x10"} for n in names for p in range(2)]
    cases = [{"expr": expr, "eval_time": "5m",
              "exp_samples": [{"labels": f'{{namespace="team-a", jobset="{n}"}}', "value": 3}
                              for n in ("lr-sweep-t000", "lr-sweep-t013")]}]
    render_to(tmp_path, MonitoringSettings())
    path = tmp_path / "sweep.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["training.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": cases}]}, sort_keys=False))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
