"""The in-cluster sweep controller, offline: `gpu-train sweep submit --dry-run` renders a Deployment the team
namespaces' admission policies and Pod Security's restricted level admit, and is refused where the platform runs no
controllers; the controller names a bad spec and a foreign namespace, and reaches the API server with its pod's
service account. (On the real control plane, with its Role and its trials in Kueue: tests/cluster/test_sweeps.py.)

Run: .venv/bin/pytest tests/gpu_train/cli/test_sweep_incluster.py -q
"""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from gpu_train.jobs.sweep_platform import SPEC_ENV
from gpu_train.spec import naming
from gpu_train.spec.sweep import load_sweep, parse_sweep
from gpu_train.sweeps import __main__ as incluster
from infra.k8s import pod_admission
from tests.gpu_train.cli.conftest import REGISTRY, contract_doc
from tests.gpu_train.cli.test_sweep import SWEEP, sweep_file
from tests.infra.k8s.vap import Admission
from tools.validation import pod_security

pytestmark = pytest.mark.integration
NS = "team-research"
K8S = "1.33"
DEPLOYMENT = "sweep-lr-sweep"
IDENTITY = {"namespaces": [NS], "serviceAccount": naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT}


@pytest.fixture
def doc():
    d = contract_doc()
    d["identities"] = {"sweeps/research": IDENTITY}
    return d


def policies():
    return pod_admission.admission_policies(nvme_host_path="/mnt/k8s-disks/0", registries=[REGISTRY])


def platform_file(tmp_path, doc) -> str:
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_submit_renders_a_controller_the_platform_admits(cli, doc, tmp_path):
    spec = sweep_file(tmp_path)
    code, out, err = cli("sweep", "submit", spec, "--dry-run", "--platform", platform_file(tmp_path, doc))
    assert code == 0, err
    deployment = yaml.safe_load(out)
    kubernetes_validate.validate(deployment, K8S, strict=True)
    assert deployment["metadata"] == {**deployment["metadata"], "name": DEPLOYMENT, "namespace": NS}
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    template = deployment["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": NS, **template["metadata"]},
           "spec": template["spec"]}
    kubernetes_validate.validate(pod, K8S, strict=True)
    # The team namespace's admission policies admit it, and it needs nothing beyond Pod Security's restricted level.
    assert Admission(policies()).denials(pod, NS) == []
    assert pod_security.evaluate(pod, "restricted", K8S) == []
    spec_pod = template["spec"]
    assert spec_pod["serviceAccountName"] == "sweep-controller" and "automountServiceAccountToken" not in spec_pod
    assert spec_pod["nodeSelector"] == {naming.SYSTEM_LABEL: "true"}
    (container,) = spec_pod["containers"]
    assert container["image"] == doc["image"]
    assert container["command"] == ["python", "-m", "gpu_train.sweeps"]
    assert not any(k.startswith("nvidia.com") for k in container["resources"]["limits"])
    env = {e["name"]: e["value"] for e in container["env"]}
    # The spec travels whole (its trial template inline) and reads back as the same sweep.
    assert parse_sweep(yaml.safe_load(env[SPEC_ENV]), "env") == load_sweep(spec)
    assert env["MLFLOW_TRACKING_URI"] == doc["endpoints"]["tracking"] and env["AWS_REGION"] == "us-east-1"


def test_submit_is_refused_where_the_platform_runs_no_controllers(cli, tmp_path):
    code, _, err = cli("sweep", "submit", sweep_file(tmp_path), "--dry-run", "--platform",
                       platform_file(tmp_path, contract_doc()))
    assert code == 2
    assert "runs no sweep controllers for team 'research' (no identity sweeps/research)" in err


def test_the_in_cluster_controller_names_a_bad_spec_and_a_foreign_namespace(monkeypatch, capsys):
    monkeypatch.delenv(SPEC_ENV, raising=False)
    assert incluster.main(["--namespace", NS]) == 2
    assert capsys.readouterr().err.strip() == (f"gpu_train.sweeps: no sweep spec: set {SPEC_ENV} to its YAML or pass "
                                               "--spec FILE")
    monkeypatch.setenv(SPEC_ENV, yaml.safe_dump(SWEEP))
    assert incluster.main(["--namespace", "team-platform"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpu_train.sweeps: ${SPEC_ENV}: trialTemplate.team 'research' runs in namespace team-research, "
                   "not in team-platform, where this controller runs"]


def test_in_the_pod_the_controller_reaches_the_api_server_with_its_service_account(monkeypatch, tmp_path):
    """The pod's projected token and CA and the service's address, as the kubelet and Kubernetes give them."""
    from kubernetes.config import incluster_config

    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token-123")
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.100.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    session = incluster.in_cluster_session(NS)
    assert (session.server, session.namespace, session.context) == ("https://10.100.0.1:443", NS, "in-cluster")
    # What the client sends with every request: the account's token.
    assert session.api.configuration.auth_settings()["BearerToken"]["value"] == "bearer sa-token-123"
    assert session.api.configuration.ssl_ca_cert == str(ca)
