"""The in-cluster sweep controller, against the fake API server (the platform's Roles, the team namespaces'
admission policies) and a local S3 server (moto): `gpu-train sweep submit` renders a Deployment the platform
admits and creates it as a team member; the controller runs as the namespace's `sweep-controller` account, which
may manage its trials and nothing outside its namespace; its journal's copy in the object store lets a controller
that lost its disk go on with the same sweep, and `sweep stop --cluster` pauses the trials the next controller
resumes. The trainer's side (status.json at a rung) is written by the test.

Run: .venv/bin/pytest tests/gpu_train/cli/test_sweep_incluster.py -q
"""

from __future__ import annotations

import json

import boto3
import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpu_train.client import jobs
from gpu_train.client.cluster import ClientError, connect, load_contract
from gpu_train.jobs.jobset import QUEUE_LABEL
from gpu_train.jobs.sweep_platform import SPEC_ENV, sweep_controller_rules, team_sweep_objects
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract
from gpu_train.sweeps import __main__ as incluster
from gpu_train.sweeps.cluster import checkpoints_store, cluster_controller, journal_mirror
from gpu_train.sweeps.mirror import MirrorError
from gpu_train.sweeps.spec import load_sweep, parse_sweep
from infra.k8s import pod_admission, tenancy
from tests.gpu_train.cli.conftest import ALICE, REGISTRY, TEAMS, contract_doc, requests_of
from tests.gpu_train.cli.fake_api import FakeApi, allowed
from tests.gpu_train.cli.test_sweep import SWEEP, sweep_file
from tests.gpu_train.cli.test_sweep_cluster import BUCKET, active, held, s3_endpoint  # noqa: F401 (a fixture)
from tests.infra.k8s.vap import Admission
from tools.validation import pod_security

pytestmark = pytest.mark.integration
NS = "team-research"
SWEEPER = "sweeper-token"
K8S = "1.33"
DEPLOYMENT = "sweep-lr-sweep"
IDENTITY = {"namespaces": [NS], "serviceAccount": naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT}


@pytest.fixture
def doc(s3_endpoint):  # noqa: F811
    # Moto keeps one store per process, whatever server answers: start from an empty bucket.
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=BUCKET, Key=obj["Key"])
    d = contract_doc()
    d["endpoints"]["objectStore"] = s3_endpoint
    d["identities"] = {"sweeps/research": IDENTITY}
    return d


def policies():
    return pod_admission.admission_policies(nvme_host_path="/mnt/k8s-disks/0", registries=[REGISTRY])


@pytest.fixture
def api(doc):
    """alice submits for research; the research namespace's sweep controller account holds the platform's Role
    there and nothing anywhere else."""
    users = {ALICE: ("alice", {NS: "submitter"}),
             SWEEPER: (f"system:serviceaccount:{NS}:{naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT}", {NS: "sweep-controller"})}
    with FakeApi(users, policies=policies()) as server:
        for team in TEAMS:
            server.put_configmap(naming.team_namespace(team.name), naming.PLATFORM_CONFIGMAP,
                                 {naming.PLATFORM_CONFIGMAP_KEY: json.dumps(doc)})
        yield server


def platform_file(tmp_path, doc) -> str:
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return str(path)


def controller_session(api, tmp_path):
    return connect(str(api.kubeconfig(tmp_path, SWEEPER, NS, name="sweeper")))


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


def test_the_controller_account_manages_its_trials_and_nothing_outside_its_namespace(api, doc, tmp_path):
    # The platform's objects: namespaced, the Role bound to the namespace's own account only.
    objects = team_sweep_objects(NS, identity_annotations={})
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding"]
    assert {o["metadata"]["namespace"] for o in objects} == {NS}
    assert objects[2]["subjects"] == [{"kind": "ServiceAccount", "name": "sweep-controller", "namespace": NS}]
    # Nothing a team member may not do himself: no wildcard, every grant is one the submitter Role has.
    for rule in sweep_controller_rules():
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb)
                    assert allowed(tenancy.submitter_rules(), group, resource, verb, naming.PLATFORM_CONFIGMAP), \
                        (group, resource, verb)

    session = controller_session(api, tmp_path)
    contract = load_contract(session, "research")  # the platform ConfigMap, by name
    sweep = load_sweep(sweep_file(tmp_path))
    controller, _ = cluster_controller(session, contract, sweep, "s.yaml", tmp_path / "state")
    assert controller.step()
    jobsets = api.of("jobsets", NS)
    assert sorted(j["metadata"]["name"] for j in jobsets) == ["lr-sweep-t000", "lr-sweep-t001", "lr-sweep-t002"]
    assert {j["metadata"]["labels"][QUEUE_LABEL] for j in jobsets} == {naming.local_queue_name("research")}

    # Outside its namespace, and outside its trials' kinds, the API server refuses it.
    with pytest.raises(ClientError, match="forbidden|403"):
        jobs.create_jobset(session, {**jobsets[0], "metadata": {"name": "x", "namespace": "team-platform"}}, "platform")
    with pytest.raises(ClientError, match="forbidden|403"):
        load_contract(session, "platform")
    for call in (lambda: session.core.list_namespaced_config_map(NS),
                 lambda: session.core.read_namespaced_pod_log("p", NS),
                 lambda: k8s.AppsV1Api(session.api).delete_namespaced_deployment(DEPLOYMENT, NS),
                 lambda: session.core.read_namespaced_config_map("other", NS)):
        with pytest.raises(ApiException) as exc:
            call()
        assert exc.value.status == 403


def test_submit_creates_and_replaces_the_controller_and_stop_pauses_what_the_next_one_resumes(cli, api, doc,
                                                                                              tmp_path):
    kubeconfig = str(api.kubeconfig(tmp_path, ALICE, NS))
    spec = sweep_file(tmp_path)
    code, out, err = cli("sweep", "submit", spec, "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert f"controller deployment {NS}/{DEPLOYMENT} created" in out
    assert api.get("deployments", NS, DEPLOYMENT)["spec"]["template"]["spec"]["serviceAccountName"] == \
        "sweep-controller"
    code, out, err = cli("sweep", "submit", spec, "--kubeconfig", kubeconfig)
    assert code == 0 and f"{DEPLOYMENT} replaced" in out, err

    # What that controller does: three trials running (its journal's copy in the object store).
    contract = PlatformContract.from_document(doc, "test")
    first, _ = cluster_controller(controller_session(api, tmp_path), contract, load_sweep(spec), spec,
                                  tmp_path / "pod-1")
    assert first.step()
    # What a member sees from a laptop: the journal's copy in the object store.
    code, out, err = cli("sweep", "status", spec, "--cluster", "--kubeconfig", kubeconfig, "--runs",
                         tmp_path / "laptop")
    assert code == 0, err
    assert all(f"lr-sweep-t00{n}" in out for n in range(3)) and "lr-sweep-t003" not in out
    assert (tmp_path / "laptop" / "lr-sweep" / "journal.jsonl").read_bytes() == \
        (tmp_path / "pod-1" / "journal.jsonl").read_bytes()
    # Kueue has not made the third trial's Workload yet: it cannot be paused, and stop says so.
    trials = ["lr-sweep-t000", "lr-sweep-t001", "lr-sweep-t002"]
    (key,) = [k for k, w in api.objects.items()
              if k[0] == "workloads" and w["metadata"]["ownerReferences"][0]["name"] == trials[2]]
    late = api.objects.pop(key)
    code, out, err = cli("sweep", "stop", spec, "--cluster", "--kubeconfig", kubeconfig, "--runs", tmp_path / "runs")
    assert code == 0, err
    assert api.get("deployments", NS, DEPLOYMENT) is None
    assert f"trials paused (checkpoint kept, quota released): {', '.join(trials[:2])};" in out
    assert f"not paused, since Kueue has no Workload for them yet (`gpu-train pause NAME` once it has): {trials[2]}" \
        in out
    assert not any(active(api, t) for t in trials[:2])
    api.put("workloads", late)
    code, out, err = cli("pause", trials[2], "--kubeconfig", kubeconfig)
    assert code == 0 and not active(api, trials[2]), err

    # The next controller, on a new disk: the same sweep from the object store, its trials resumed, none created again.
    api.requests.clear()
    second, _ = cluster_controller(controller_session(api, tmp_path), contract, load_sweep(spec), spec,
                                   tmp_path / "pod-2")
    assert {t.id: t.state for t in second.state.trials.values()} == {t: "running" for t in trials}
    second.resume_active()
    assert all(active(api, t) for t in trials)
    assert not requests_of(api, "POST", "/jobsets")


def test_a_controller_that_lost_its_disk_goes_on_with_no_trial_lost_or_run_twice(api, doc, s3_endpoint,  # noqa: F811
                                                                                 tmp_path):
    sweep = parse_sweep({**SWEEP, "trialConfig": {"numTrials": 4, "parallelTrials": 2}}, "s.yaml")
    contract = PlatformContract.from_document(doc, "test")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    first, _ = cluster_controller(controller_session(api, tmp_path), contract, sweep, "s.yaml", tmp_path / "pod-1")
    assert first.step()
    held(s3, "lr-sweep-t000", 3.0)
    held(s3, "lr-sweep-t001", 4.0)
    assert first.step()  # t000 goes on, t001 is paused, t002 starts
    journal = (tmp_path / "pod-1" / "journal.jsonl").read_bytes()
    stored = s3.get_object(Bucket=BUCKET, Key="research/lr-sweep/controller/journal.jsonl")["Body"].read()
    assert stored == journal  # copied after its last record

    api.requests.clear()
    second, _ = cluster_controller(controller_session(api, tmp_path), contract, sweep, "s.yaml", tmp_path / "pod-2")
    assert (tmp_path / "pod-2" / "journal.jsonl").read_bytes() == journal
    assert {t.id: (t.state, t.budget, t.params) for t in second.state.trials.values()} == \
        {t.id: (t.state, t.budget, t.params) for t in first.state.trials.values()}
    second.resume_active()
    assert not requests_of(api, "POST", "/jobsets")  # t000 and t002 run, t001 is paused: nothing to launch again
    held(s3, "lr-sweep-t002", 5.0)  # the worst at the rung: paused, its slot goes to the sweep's last trial
    assert second.step()
    created = [r[3]["metadata"]["name"] for r in requests_of(api, "POST", "/jobsets")]
    assert created == ["lr-sweep-t003"]
    assert [r["event"] for r in map(json.loads, (tmp_path / "pod-2" / "journal.jsonl").read_text().splitlines())
            ].count("suggest") == 4  # each trial asked for once, across both controllers

    # Two controllers' copies that disagree are refused, naming both, not merged.
    third = tmp_path / "pod-3"
    third.mkdir()
    (third / "journal.jsonl").write_text('{"event": "start", "seq": 0, "sweep": "lr-sweep"}\n')
    with pytest.raises(MirrorError, match=r"pod-3/journal.jsonl and s3://.*/research/lr-sweep/controller/journal"):
        journal_mirror(checkpoints_store(contract), sweep, third).pull()


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


def test_a_gcs_checkpoints_bucket_holds_the_budgets_and_the_journal(api, doc, s3_endpoint, tmp_path):  # noqa: F811
    """A GCP platform's gs:// bucket, through the one object-store layer (GCS's XML API; here the local S3 server
    answers for it, signed with HMAC-style keys as GCS's interoperability keys are)."""
    gcs = "gpu-train-gcp-dev-checkpoints"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=gcs)
    gdoc = {**doc, "buckets": {**doc["buckets"], "checkpoints": f"gs://{gcs}"}}
    contract = PlatformContract.from_document(gdoc, "test")
    sweep = load_sweep(sweep_file(tmp_path))
    controller, _ = cluster_controller(controller_session(api, tmp_path), contract, sweep, "s.yaml", tmp_path / "pod")
    assert controller.step()
    (jobset,) = [j for j in api.of("jobsets", NS) if j["metadata"]["name"] == "lr-sweep-t000"]
    args = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"train.budget_uri=gs://{gcs}/research/lr-sweep/lr-sweep-t000/budget.json" in args
    body = s3.get_object(Bucket=gcs, Key="research/lr-sweep/lr-sweep-t000/budget.json")["Body"].read()
    assert json.loads(body) == {"tokens": 655360}
    stored = s3.get_object(Bucket=gcs, Key="research/lr-sweep/controller/journal.jsonl")["Body"].read()
    assert stored == (tmp_path / "pod" / "journal.jsonl").read_bytes()
