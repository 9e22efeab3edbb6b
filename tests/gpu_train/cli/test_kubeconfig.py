"""`gpu-train kubeconfig`: what it refuses (a team not on the platform, no contract file, EKS options on GKE). The
kubeconfig it writes, used end to end against an API server, is tests/cluster/test_cli_kubeconfig.py.

Run: .venv/bin/pytest tests/gpu_train/cli/test_kubeconfig.py -q
"""

from __future__ import annotations

import json

from tests.gpu_train.cli.conftest import only_error_lines


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
