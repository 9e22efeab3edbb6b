"""`python -m tools.validation PLAN...`: problems, what was not checked, and the exit status.

Usage: .venv/bin/pytest tests/tools/validation/test_cli.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT
from tools.validation import helm

MONITOR = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
           "metadata": {"name": "m", "namespace": "monitoring"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "metrics"}]}}


def _plan(values: dict | None, monitor: dict) -> dict:
    release = {"type": helm.RELEASE_TYPE, "name": "dcgm", "inputs": {
        "name": "dcgm-exporter", "chart": "dcgm-exporter", "version": "4.8.2", "namespace": "monitoring",
        "repositoryOpts": {"repo": "https://nvidia.github.io/dcgm-exporter/helm-charts"}, "values": values}}
    return {"stack": "demo", "resources": [
        *([release] if values is not None else []),
        {"type": "kubernetes:monitoring.coreos.com/v1:ServiceMonitor", "inputs": monitor},
    ]}


def _run(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.validation", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_clean_plan_exits_0_and_a_broken_one_exits_1_naming_each_problem(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_plan(None, MONITOR)))
    ok = _run(good)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "demo: 0 Helm releases, 1 custom resources, 0 workloads, 0 problems" in ok.stdout
    bad = tmp_path / "bad.json"
    broken_monitor = {**MONITOR, "spec": {**MONITOR["spec"], "endpoint": []}}
    bad.write_text(json.dumps(_plan({"serviceMonitors": {"enabled": False}}, broken_monitor)))
    failed = _run(bad)
    assert failed.returncode == 1
    assert ("demo: release dcgm-exporter (dcgm-exporter 4.8.2): values.serviceMonitors: the chart defines no such "
            "key (Helm ignores it)") in failed.stdout
    assert "demo: ServiceMonitor/monitoring/m: spec.endpoint: unknown field (the API server drops it)" in failed.stdout
    # Values of a shape no render was recorded for: what the chart would install is unknown, which fails too.
    assert ("demo: release monitoring/dcgm-exporter (dcgm-exporter 4.8.2): the values' shape has no recorded render"
            in failed.stdout)
    (tmp_path / "junk.json").write_text("{")
    junk = _run(tmp_path / "junk.json")
    assert junk.returncode == 2 and junk.stderr.startswith("error: ") and "Traceback" not in junk.stderr
