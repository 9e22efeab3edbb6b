"""The offline plan tool: every stack plans, the document has the promised shape, secrets never leak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra import plan as plan_tool
from tests.conftest import ROOT, STACKS


def run_plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_all_four_stacks_exist():
    assert set(STACKS) >= {"aws-dev", "aws-prod", "gcp-dev", "gcp-prod"}


def test_plan_document_shape(plans):
    for stack, doc in plans.items():
        assert doc["project"] == "gpu-train" and doc["stack"] == stack
        assert len(doc["resources"]) > 50, f"{stack} planned only {len(doc['resources'])} resources"
        urns = {r["urn"] for r in doc["resources"]}
        for res in doc["resources"]:
            assert set(res) == {"urn", "type", "name", "parent", "inputs"}
            assert res["type"].count(":") >= 2, res["type"]
            # Every parent is the stack or another planned resource.
            assert res["parent"] is None or res["parent"] in urns or res["parent"].endswith(
                f"pulumi:pulumi:Stack::gpu-train-{stack}"), res["parent"]


def test_each_stack_only_uses_its_own_cloud(plans):
    for stack, doc in plans.items():
        cloud = stack.split("-")[0]
        other = "gcp" if cloud == "aws" else "aws"
        types = {r["type"] for r in doc["resources"]}
        assert any(t.startswith(f"{cloud}:") for t in types)
        assert not any(t.startswith(f"{other}:") for t in types), stack


def test_secrets_are_redacted(plans, plan_dir):
    for stack, doc in plans.items():
        assert doc["outputs"]["kubeconfig"] == plan_tool.SECRET
        text = (plan_dir / f"{stack}.json").read_text()
        assert plan_tool._SECRET_SIG not in text
        assert "ya29.mock-token" not in text, "a registry access token leaked into the plan"


def test_bucket_outputs_use_the_clouds_scheme(plans):
    for stack, doc in plans.items():
        scheme = "s3://" if stack.startswith("aws") else "gs://"
        for key in ("datasetsBucket", "checkpointsBucket", "artifactsBucket"):
            assert str(doc["outputs"][key]).startswith(scheme), (stack, key, doc["outputs"][key])


def test_kubernetes_objects_written_as_yaml(plans, plan_dir):
    for stack, doc in plans.items():
        objects = plan_tool.kubernetes_objects(doc)
        files = sorted((plan_dir / stack / "k8s").glob("*.yaml"))
        assert len(files) == len(objects) > 0, stack
        for f in files:
            obj = yaml.safe_load(f.read_text())
            assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], f


def test_redact_replaces_nested_engine_secrets():
    secret = {plan_tool._SIG_KEY: plan_tool._SECRET_SIG, "value": "hunter2"}
    mapping = {plan_tool._SIG_KEY: plan_tool._SECRET_SIG, "value": {"password": "hunter2", "user": ["a"]}}
    doc = {"a": [1, {"b": secret}], "c": secret, "stringData": mapping}
    assert plan_tool.redact(doc) == {"a": [1, {"b": "[secret]"}], "c": "[secret]",
                                     "stringData": {"password": "[secret]", "user": ["[secret]"]}}
    assert "hunter2" not in json.dumps(plan_tool.redact(doc))


def test_stack_file_option_checks_an_uncommitted_file(tmp_path):
    raw = yaml.safe_load((ROOT / "stacks" / "Pulumi.aws-dev.yaml").read_text())
    raw["config"]["gpu-train:gpuPools"][0]["maxNodes"] = 0
    bad = tmp_path / "Pulumi.my-test.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = run_plan("--stack-file", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "gpu-train:gpuPools[0].maxNodes must be >= 1 (got 0)" in proc.stderr
    assert not (tmp_path / "out").exists(), "a failed plan must not write anything"


def test_stack_file_must_be_named_like_a_stack(tmp_path):
    other = tmp_path / "settings.yaml"
    other.write_text("config: {}\n")
    proc = run_plan("--stack-file", str(other))
    assert proc.returncode == 2 and "must be named Pulumi.<stack>.yaml" in proc.stderr


def test_unknown_stack_is_a_clear_error():
    proc = run_plan("--stack", "does-not-exist")
    assert proc.returncode == 2 and "no such stack settings file" in proc.stderr


@pytest.mark.parametrize("stack", ["aws-dev"])
def test_summary_prints_types_and_outputs(stack, tmp_path):
    proc = run_plan("--stack", stack, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"Plan for stack {stack}:" in proc.stdout
    assert "aws:eks/cluster:Cluster" in proc.stdout
    assert "kubeconfig: [secret]" in proc.stdout
    doc = json.loads((tmp_path / f"{stack}.json").read_text())
    assert doc["stack"] == stack
