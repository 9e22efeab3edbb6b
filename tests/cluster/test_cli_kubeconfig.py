"""`gpu-train kubeconfig` against the real control plane: the stack's own kubeconfig from the contract (pointed at
the plane's API server and CA), with one context in the team's namespace, used end to end. Its exec plugin runs a
stand-in `aws` on PATH that answers as `aws eks get-token` does, with an ExecCredential; here it holds alice's
client certificate (what the plane's users sign in with) where EKS's holds a token. The API server authenticates
alice and RBAC lets her list her team's jobs with no --team; when the plugin fails, no credential reaches the API
server, which takes the request as system:anonymous.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_cli_kubeconfig.py -q
"""

from __future__ import annotations

import base64
import copy
import json
import os
import stat
from pathlib import Path

import yaml

from infra.aws import cluster as aws_cluster
from tests.cluster.jobs import NS
from tests.gpu_train.cli.conftest import only_error_lines

ROLE = "arn:aws:iam::123456789012:role/ml-research-engineers"


def _contract(platform, tmp_path):
    """The stack's contract, its kubeconfig's cluster being the plane's API server and CA."""
    doc = copy.deepcopy(platform.contract)
    ca = base64.b64encode(platform.plane.ca.cert.read_bytes()).decode()
    name = doc["cluster"]["name"]
    doc["cluster"]["kubeconfig"] = json.loads(aws_cluster.kubeconfig(name, platform.plane.server, ca, doc["region"]))
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return path, name


def _aws(tmp_path, monkeypatch, body: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "aws"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_team_kubeconfig_authenticates_with_the_cloud_cli_and_defaults_to_the_team(platform, cli, tmp_path,
                                                                                    monkeypatch, clean):
    user = yaml.safe_load(platform.kubeconfigs["alice"].read_text())["users"][0]["user"]
    credential = {"kind": "ExecCredential", "apiVersion": "client.authentication.k8s.io/v1beta1", "spec": {},
                  "status": {"expirationTimestamp": "2099-01-01T00:00:00Z",
                             "clientCertificateData": Path(user["client-certificate"]).read_text(),
                             "clientKeyData": Path(user["client-key"]).read_text()}}
    (tmp_path / "credential.json").write_text(json.dumps(credential))
    record = tmp_path / "aws-calls"
    _aws(tmp_path, monkeypatch, f'echo "$AWS_PROFILE $*" >> {record}\ncat {tmp_path / "credential.json"}\n')
    platform_file, cluster = _contract(platform, tmp_path)
    out_file = tmp_path / "kube" / "research.yaml"
    code, out, err = cli("kubeconfig", "--platform", platform_file, "--team", "research", "--role-arn", ROLE,
                         "--aws-profile", "research-sso", "--output", out_file)
    assert code == 0, err
    assert f"export KUBECONFIG={out_file}" in out
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o600
    doc = yaml.safe_load(out_file.read_text())
    (context,) = doc["contexts"]
    assert context["context"]["namespace"] == NS
    assert doc["current-context"] == context["name"] == f"gpu-train-{cluster}-research"
    assert set(doc["users"][0]["user"]) == {"exec"}  # no credential in the file
    # The API server authenticated the plugin's credential (with none, RBAC would refuse system:anonymous).
    code, out, err = cli("list", "--kubeconfig", out_file)
    assert code == 0, err
    assert out == "no jobs in team-research\n"
    calls = record.read_text().splitlines()
    assert calls and set(calls) == {f"research-sso eks get-token --cluster-name {cluster} --region us-east-1 "
                                    f"--output json --role-arn {ROLE}"}


def test_a_failing_exec_plugin_is_one_line(platform, cli, tmp_path, monkeypatch, clean):
    _aws(tmp_path, monkeypatch, "echo 'Unable to locate credentials' >&2\nexit 255\n")
    platform_file, _ = _contract(platform, tmp_path)
    assert cli("kubeconfig", "--platform", platform_file, "--team", "research", "-o", tmp_path / "k.yaml")[0] == 0
    code, _, err = cli("list", "--kubeconfig", tmp_path / "k.yaml")
    assert code == 1 and only_error_lines(err), err
    # kube-apiserver's anonymous authentication is on (its default): with no credential, RBAC refuses the
    # request as system:anonymous (403), which the command reports as a sign-in problem.
    assert "did not accept your credentials (403 Forbidden to system:anonymous: no credential was sent)" in err
    assert "the kubeconfig's credential command failed" in err and "Unable to locate credentials" in err
    assert "member" not in err
