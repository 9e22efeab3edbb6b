"""The offline checker's command line, config handling and policy context, on small hand-built plans.

Usage: `.venv/bin/pytest tests/policies/test_check_cli.py -q` (no plans, no mocks).
"""

from __future__ import annotations

import json

import pytest

from policies.check import PlanError, main, parse_config
from policies.core import Context, PolicyConfigError

TAGS = {"project": "gpu-train", "stack": "aws-dev", "environment": "dev", "managed-by": "pulumi"}


def _plan(tmp_path, resources, stack="aws-dev"):
    path = tmp_path / f"{stack}.json"
    path.write_text(json.dumps({"project": "gpu-train", "stack": stack, "resources": resources, "outputs": {}}))
    return path


def _key(rotation: bool) -> dict:
    return {"urn": "urn:pulumi:aws-dev::gpu-train::aws:kms/key:Key::data", "type": "aws:kms/key:Key",
            "name": "data", "parent": None,
            "inputs": {"enableKeyRotation": rotation, "description": "data", "tags": TAGS}}


def _deployment(image: str) -> dict:
    pod = {"securityContext": {"runAsNonRoot": True},
           "containers": [{"name": "web", "image": image, "securityContext": {"allowPrivilegeEscalation": False},
                           "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}
    return {"urn": "urn:pulumi:aws-dev::gpu-train::kubernetes:apps/v1:Deployment::web",
            "type": "kubernetes:apps/v1:Deployment", "name": "web", "parent": None,
            "inputs": {"metadata": {"namespace": "monitoring"}, "spec": {"template": {"spec": pod}}}}


def test_mandatory_violation_exits_1_and_names_resource_rule_and_fix(tmp_path, capsys):
    code = main([str(_plan(tmp_path, [_key(False)]))])
    out = capsys.readouterr().out
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("ERROR"))
    assert "[kms-rotation]" in line and "aws:kms/key:Key 'data'" in line
    assert "urn:pulumi:aws-dev::gpu-train::aws:kms/key:Key::data" in line and "Remediation:" in line


def test_clean_plan_exits_0(tmp_path, capsys):
    assert main([str(_plan(tmp_path, [_key(True)]))]) == 0
    assert "0 mandatory" in capsys.readouterr().out


def test_advisory_violation_is_a_warning_and_exits_0(tmp_path, capsys):
    assert main([str(_plan(tmp_path, [_deployment("grafana/grafana:12.0.0")]))]) == 0
    out = capsys.readouterr().out
    assert "WARNING [image-digest]" in out and "ERROR" not in out


def test_config_can_raise_an_advisory_rule_to_mandatory_or_disable_a_rule(tmp_path):
    plan = str(_plan(tmp_path, [_deployment("grafana/grafana:12.0.0"), _key(False)]))
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({"image-digest": "mandatory", "kms-rotation": {"enforcementLevel": "disabled"}}))
    assert main([plan, "--config", str(strict), "--quiet"]) == 1
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"kms-rotation": "disabled"}))
    assert main([plan, "--config", str(off)]) == 0


@pytest.mark.parametrize(("doc", "culprit"), [
    ({"no-such-rule": "mandatory"}, "no-such-rule"),
    ({"kms-rotation": "sometimes"}, "kms-rotation.enforcementLevel"),
    ({"gpu-total-cap": {"maxGpu": 8}}, "gpu-total-cap.maxGpu"),
    ({"gpu-total-cap": {"maxGpus": "eight"}}, "maxGpus"),
    ({"allowed-regions": {"allowedRegions": "us-east-1"}}, "allowedRegions"),
    ({"all": "loud"}, "all"),
])
def test_bad_config_names_the_key(doc, culprit):
    with pytest.raises(PlanError, match=culprit.replace(".", r"\.")):
        parse_config(doc)


def test_unreadable_inputs_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such plan file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad)]) == 2
    noname = _plan(tmp_path, [{"urn": "u", "type": "aws:kms/key:Key", "inputs": {}}])
    assert main([str(noname)]) == 2
    assert "resources[0] lacks name" in capsys.readouterr().err


def test_context_environment_and_caps():
    assert Context.environment_of("aws-dev") == "dev"
    assert Context.environment_of("gcp-prod") == "prod"
    assert Context.environment_of("sandbox") == ""
    ctx = Context.from_config({"maxGpus": 64.0, "maxGpusByStack": {"aws-dev": 8}}, "aws-dev")
    assert (ctx.environment, ctx.max_gpus, ctx.is_prod) == ("dev", 8, False)
    assert Context.from_config({"environment": "prod"}, "aws-dev").is_prod
    with pytest.raises(PolicyConfigError, match="environment"):
        Context.from_config({"environment": "qa"}, "aws-dev")
