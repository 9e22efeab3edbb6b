"""`gpu-train kubeconfig`: the stack's own kubeconfig from the contract, with one context in the team's namespace,
used end to end: its exec plugin (a stand-in `aws` on PATH that answers like `aws eks get-token`) gets the token
the fake API server knows, and `gpu-train list` then works with no --team.

Run: .venv/bin/pytest tests/gpu_train/cli/test_kubeconfig.py -q
"""

from __future__ import annotations

import json
import os
import stat

import yaml

from tests.gpu_train.cli.conftest import ALICE, contract_doc, only_error_lines


def _fake_aws(tmp_path) -> tuple[str, object]:
    """An `aws` that records its arguments and AWS_PROFILE and prints an ExecCredential (client.authentication.k8s.io
    v1beta1, what `aws eks get-token` prints) holding alice's token."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "aws-calls"
    script = bin_dir / "aws"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$AWS_PROFILE $*" >> {record}\n'
        'echo \'{"kind": "ExecCredential", "apiVersion": "client.authentication.k8s.io/v1beta1", "spec": {}, '
        f'"status": {{"expirationTimestamp": "2099-01-01T00:00:00Z", "token": "{ALICE}"}}}}\'\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir), record


def test_a_team_kubeconfig_authenticates_with_the_cloud_cli_and_defaults_to_the_team(api, tmp_path, cli, monkeypatch):
    bin_dir, record = _fake_aws(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(contract_doc(server=api.url)))
    out_file = tmp_path / "kube" / "research.yaml"
    role = "arn:aws:iam::123456789012:role/ml-research-engineers"
    code, out, err = cli("kubeconfig", "--platform", platform, "--team", "research", "--role-arn", role,
                         "--aws-profile", "research-sso", "--output", out_file)
    assert code == 0, err
    assert f"export KUBECONFIG={out_file}" in out
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o600
    doc = yaml.safe_load(out_file.read_text())
    (context,) = doc["contexts"]
    assert context["context"]["namespace"] == "team-research"
    assert doc["current-context"] == context["name"] == "gpu-train-gpu-train-aws-dev-research"
    assert "token" not in doc["users"][0]["user"]  # no credential in the file
    code, out, err = cli("list", "--kubeconfig", out_file)
    assert code == 0, err
    assert out == "no jobs in team-research\n"
    calls = record.read_text().splitlines()
    assert calls and calls[0] == (f"research-sso eks get-token --cluster-name gpu-train-aws-dev --region us-east-1 "
                                  f"--output json --role-arn {role}")


def test_kubeconfig_errors(tmp_path, cli, doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    code, _, err = cli("kubeconfig", "--platform", platform, "--team", "nlp")
    assert code == 2 and only_error_lines(err) and "team 'nlp' is not on this platform (teams: research, platform)" in err
    code, _, err = cli("kubeconfig", "--platform", tmp_path / "nope.json", "--team", "research")
    assert code == 2 and "no such file" in err
    gke = {**doc, "cloud": "gcp"}
    platform.write_text(json.dumps(gke))
    code, _, err = cli("kubeconfig", "--platform", platform, "--team", "research", "--role-arn", "arn:aws:iam::1:role/x")
    assert code == 2 and "apply to EKS" in err


def test_a_failing_exec_plugin_is_one_line(api, tmp_path, cli, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text("#!/bin/sh\necho 'Unable to locate credentials' >&2\nexit 255\n")
    (bin_dir / "aws").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(contract_doc(server=api.url)))
    assert cli("kubeconfig", "--platform", platform, "--team", "research", "-o", tmp_path / "k.yaml")[0] == 0
    code, _, err = cli("list", "--kubeconfig", tmp_path / "k.yaml")
    assert code == 1 and only_error_lines(err), err
    assert "401 Unauthorized" in err and "the kubeconfig's credential command failed" in err
    assert "Unable to locate credentials" in err
