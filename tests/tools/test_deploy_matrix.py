"""The deploy workflow's stack matrix: only stacks marked `deploy: true`, as GitHub outputs.

Usage: .venv/bin/pytest tests/tools/test_deploy_matrix.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tools import deploy_matrix

ROOT = Path(__file__).resolve().parents[2]
RUNNER = {"kind": "codebuild", "repository": "corp/gpu-train",
          "connectionArn": "arn:aws:codeconnections:us-east-1:731204958136:connection/7c1e4f52-98a1-4b0c-a7d2-5e6f3b9c0d18"}


def test_deploy_matrix_lists_only_stacks_marked_for_deployment(tmp_path):
    assert deploy_matrix.deploy_matrix(ROOT / "stacks") == {"nonprod": [], "prod": []}  # the shipped ones are examples
    for name, cloud, env, deploy in (("a-dev", "aws", "dev", True), ("g-prod", "gcp", "prod", True),
                                     ("x-prod", "aws", "prod", False), ("s-stg", "gcp", "staging", True)):
        doc = {"config": {"gpu-train:cloud": cloud, "gpu-train:environment": env, "gpu-train:deploy": deploy,
                          "gpu-train:region": "eu-west-1" if cloud == "aws" else "europe-west4"}}
        if cloud == "aws":
            doc["config"]["gpu-train:deployRunner"] = RUNNER
        (tmp_path / f"Pulumi.{name}.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "Pulumi.notes.yaml").write_text("config:\n  gpu-train:deploy: 'true'\n")  # a string is not a marker
    assert deploy_matrix.deploy_matrix(tmp_path) == {
        "nonprod": [{"stack": "a-dev", "cloud": "aws", "region": "eu-west-1"},
                    {"stack": "s-stg", "cloud": "gcp", "region": "europe-west4"}],
        "prod": [{"stack": "g-prod", "cloud": "gcp", "region": "europe-west4"}]}


def test_deploy_matrix_cli_prints_github_outputs(tmp_path, capsys):
    doc = {"config": {"gpu-train:cloud": "gcp", "gpu-train:environment": "prod", "gpu-train:deploy": True,
                      "gpu-train:region": "us-central1"}}
    (tmp_path / "Pulumi.g-prod.yaml").write_text(yaml.safe_dump(doc))
    assert deploy_matrix.main([str(tmp_path)]) == 0
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert json.loads(lines["prod"]) == [{"stack": "g-prod", "cloud": "gcp", "region": "us-central1"}]
    assert json.loads(lines["nonprod"]) == [] and lines["aws"] == "false"
    assert json.loads(lines["all"]) == json.loads(lines["prod"])
    (tmp_path / "Pulumi.bad.yaml").write_text(yaml.safe_dump({"config": {"gpu-train:deploy": True}}))
    assert deploy_matrix.main([str(tmp_path)]) == 2
    assert "Pulumi.bad.yaml: a stack marked deploy: true needs gpu-train:cloud" in capsys.readouterr().err
    (tmp_path / "Pulumi.bad.yaml").write_text(yaml.safe_dump({"config": {
        "gpu-train:deploy": True, "gpu-train:cloud": "aws", "gpu-train:environment": "dev",
        "gpu-train:region": "us-east-1"}}))
    assert deploy_matrix.main([str(tmp_path)]) == 2
    assert "an AWS stack marked deploy: true needs gpu-train:deployRunner.kind codebuild" in capsys.readouterr().err
