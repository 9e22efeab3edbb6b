"""Sweeps on the real control plane: `gpu-train sweep run --dry-run` renders the first trials from the cluster's
own contract, JobSets the real API server admits (schemas, admission policies, Kueue's and JobSet's webhooks) and
creates nothing; a bound the cluster would refuse is named; the controller's trials are JobSets in the team's
LocalQueue with the sweep priority class, admitted by the real Kueue as quota allows, paused and resumed through
their Workloads' `spec.active` (Kueue evicts and readmits them); the in-cluster controller runs as the namespace's
`sweep-controller` account with only its Role (the real RBAC refuses it elsewhere), `gpu-train sweep submit`
creates and replaces its Deployment and `sweep stop --cluster` removes it and pauses its trials, which the next
controller resumes; a controller that lost its disk goes on from the journal's copy without creating a trial
twice; a gs:// checkpoints bucket holds the budgets and the journal.

The object store is a local S3 server (moto) on 127.0.0.1: the contract read from the cluster is used with its
objectStore endpoint set to that server (and, for the gs:// case, its checkpoints bucket renamed). The trainer's
side (status.json at a rung) is written by the test.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_sweeps.py -q
"""

from __future__ import annotations

import io
import json
import logging

import boto3
import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpu_train.client import jobs
from gpu_train.client.cluster import connect, load_contract
from gpu_train.client.errors import ClientError
from gpu_train.jobs.jobset import PRIORITY_LABEL, QUEUE_LABEL
from gpu_train.jobs.sweep_platform import controller_name, sweep_controller_rules
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.sweep import load_sweep, parse_sweep
from gpu_train.sweeps.cluster import ClusterBackend, checkpoints_store, cluster_controller, journal_mirror
from gpu_train.sweeps.controller import Controller
from gpu_train.sweeps.mirror import MirrorError
from tests.cluster.conftest import wait_for
from tests.cluster.jobs import (
    JOBSET,
    NS,
    admitted,
    condition,
    gpu_usage,
    service_account_kubeconfig,
    submit,
    workload_of,
)
from tests.gpu_train.cli.conftest import only_error_lines
from tests.gpu_train.cli.test_sweep import SWEEP
from tools.cluster.plane import free_port

RUNG = 655360  # 10 steps of 65,536 tokens


def sweep_doc(name: str, trials: int = 4, parallel: int = 2, **over) -> dict:
    """The CLI tests' sweep under its own name, each trial on one GPU (research's l4-spot quota is 4, and the
    stack's own job holds 2 of them)."""
    return {**SWEEP, "name": name, "trialTemplate": {**SWEEP["trialTemplate"], "name": name, "nodes": "1:1"},
            "algorithm": {"name": "random", "seed": 1, "earlyStopping": {"name": "asha", "minTokens": RUNG,
                                                                          "reductionFactor": 2}},
            "trialConfig": {"numTrials": trials, "parallelTrials": parallel}, **over}


def sweep_file(tmp_path, doc: dict):
    path = tmp_path / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def store(platform, s3_endpoint, monkeypatch, tmp_path):
    """(the cluster's contract document with the local object store, an S3 client of it, that document's file)"""
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    doc = {**platform.contract, "endpoints": {**platform.contract["endpoints"], "objectStore": s3_endpoint}}
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=doc["buckets"]["checkpoints"].removeprefix("s3://"))
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return doc, s3, path


@pytest.fixture
def sweeps(platform):
    """Names the test's sweeps; afterwards their controllers and trials (JobSets, Workloads) are gone."""
    names: list[str] = []
    yield names.append
    dyn = platform.plane.client()
    for name in names:
        for kind, api_version, prefix in ((JOBSET[1], JOBSET[0], f"{name}-t"),
                                          ("Deployment", "apps/v1", controller_name(name))):
            res = dyn.resources.get(api_version=api_version, kind=kind)
            for obj in platform.list(api_version, kind, NS):
                if obj["metadata"]["name"].startswith(prefix):
                    res.delete(name=obj["metadata"]["name"], namespace=NS, body={"propagationPolicy": "Foreground"})
        wait_for(f"sweep {name}'s trials and controller gone", lambda n=name: not [
            o for kind in (JOBSET, ("apps/v1", "Deployment"), ("kueue.x-k8s.io/v1beta2", "Workload"))
            for o in platform.list(*kind, NS) if f"{n}-t0" in o["metadata"]["name"]
            or o["metadata"]["name"] == controller_name(n)])


def trial_names(platform, sweep: str) -> list[str]:
    return sorted(j["metadata"]["name"] for j in platform.list(*JOBSET, NS) if j["metadata"]["name"].startswith(
        f"{sweep}-t"))


def active(platform, trial: str) -> bool:
    return workload_of(platform, trial)["spec"].get("active", True)


def held(s3, doc: dict, sweep: str, trial: str, loss: float) -> None:
    """What the trainer writes when it holds at the rung."""
    s3.put_object(Bucket=doc["buckets"]["checkpoints"][5:], Key=f"research/{sweep}/{trial}/status.json",
                  Body=json.dumps({"state": "held", "tokens": RUNG, "val_loss": loss,
                                   "evals": [{"step": 10, "tokens": RUNG, "val_loss": loss}]}).encode())


def budget(s3, doc: dict, sweep: str, trial: str) -> int:
    body = s3.get_object(Bucket=doc["buckets"]["checkpoints"][5:], Key=f"research/{sweep}/{trial}/budget.json")
    return json.loads(body["Body"].read())["tokens"]


def controller_session(platform):
    """A session as the namespace's sweep-controller account (test_controllers: its pod's identity)."""
    return connect(str(service_account_kubeconfig(platform, naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT)))


def uids(platform, sweep: str) -> dict[str, str]:
    return {j["metadata"]["name"]: j["metadata"]["uid"] for j in platform.list(*JOBSET, NS)
            if j["metadata"]["name"].startswith(f"{sweep}-t")}


def test_dry_run_renders_trials_the_api_server_admits_and_creates_nothing(platform, cli, tmp_path, sweeps):
    sweeps("sw-dry")
    alice = platform.kubeconfigs["alice"]
    doc = {**sweep_doc("sw-dry", trials=6, parallel=3), "trialTemplate": {**sweep_doc("sw-dry")["trialTemplate"],
                                                                          "nodes": "1:2"}}
    code, out, err = cli("sweep", "run", sweep_file(tmp_path, doc), "--dry-run", "--kubeconfig", alice)
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in docs] == ["sw-dry-t000", "sw-dry-t001", "sw-dry-t002"]
    bucket = platform.contract["buckets"]["checkpoints"]
    for d in docs:
        assert d["metadata"]["namespace"] == NS
        assert d["metadata"]["labels"][QUEUE_LABEL] == naming.local_queue_name("research")
        assert d["metadata"]["labels"][PRIORITY_LABEL] == naming.priority_class_name("sweep")
        assert f"train.budget_uri={bucket}/research/sw-dry/{d['metadata']['name']}/budget.json" in yaml.safe_dump(d)
    assert len({a for d in docs for a in yaml.safe_dump(d).split() if a.startswith("train.lr=")}) == 3
    assert "queue " + naming.local_queue_name("research") in err
    # What it printed, alice may create as it is: the real API server's dry run admits every trial.
    platform.plane.apply(docs, dry_run=True, kubeconfig_path=alice, manager="sweep-dry-run")
    assert trial_names(platform, "sw-dry") == []  # and nothing was created


def test_a_search_bound_the_cluster_would_refuse_is_named(platform, cli, tmp_path):
    space = {"train.micro_batch_size": {"distribution": "choice", "values": [8, 7]}}
    code, out, err = cli("sweep", "run", sweep_file(tmp_path, sweep_doc("sw-bound", searchSpace=space)), "--dry-run",
                         "--kubeconfig", platform.kubeconfigs["alice"])
    assert code != 0 and out == ""
    assert "train.micro_batch_size=7" in err and only_error_lines(err)


def test_trials_are_admitted_by_kueue_and_paused_and_resumed_through_their_workloads(platform, store, tmp_path,
                                                                                      sweeps):
    sweeps(name := "sw-pause")
    doc, s3, _ = store
    sweep = parse_sweep(sweep_doc(name), "s.yaml")
    session = connect(str(platform.kubeconfigs["alice"]))
    backend = ClusterBackend(session, PlatformContract.from_document(doc, "test"), sweep, source="s.yaml")
    controller = Controller(sweep, tmp_path / "sweep", backend, out=io.StringIO())
    t = [f"{name}-t00{n}" for n in range(4)]

    assert controller.step()
    assert trial_names(platform, name) == t[:2]
    for j in platform.list(*JOBSET, NS):
        if j["metadata"]["name"] in t:
            assert j["metadata"]["labels"][QUEUE_LABEL] == naming.local_queue_name("research")
            assert j["metadata"]["labels"][PRIORITY_LABEL] == naming.priority_class_name("sweep")
    wait_for("Kueue to admit both trials", lambda: admitted(platform, t[0]) and admitted(platform, t[1]))
    assert workload_of(platform, t[0])["spec"]["priorityClassRef"]["name"] == naming.priority_class_name("sweep")
    assert budget(s3, doc, name, t[0]) == budget(s3, doc, name, t[1]) == RUNG

    held(s3, doc, name, t[0], 3.0)  # first at the rung: goes on in place
    held(s3, doc, name, t[1], 4.0)  # the best 2 // 2 = 1 of [3, 4] is 3: paused
    assert controller.step()
    assert budget(s3, doc, name, t[0]) == 2 * RUNG
    assert not active(platform, t[1])
    wait_for(f"Kueue to evict {t[1]} and admit {t[2]} in its place", lambda: not admitted(platform, t[1]) and
             admitted(platform, t[2]))
    assert condition(workload_of(platform, t[1]), "Evicted")["status"] == "True"

    held(s3, doc, name, t[2], 5.0)  # [3, 4, 5]: paused; t003 starts
    assert controller.step()
    wait_for(f"Kueue to admit {t[3]}", lambda: admitted(platform, t[3]))  # a trial holds at a rung only once it ran
    held(s3, doc, name, t[3], 6.0)  # [3, 4, 5, 6]: paused, and now the best 2 include t001's 4.0
    assert controller.step()
    assert active(platform, t[1]) and budget(s3, doc, name, t[1]) == 2 * RUNG
    assert not active(platform, t[2]) and not active(platform, t[3])
    wait_for(f"Kueue to admit {t[1]} again", lambda: admitted(platform, t[1]) and not admitted(platform, t[2])
             and not admitted(platform, t[3]))
    assert {x.id: x.state for x in controller.state.trials.values()} == {
        t[0]: "running", t[1]: "running", t[2]: "paused", t[3]: "paused"}


def test_the_controller_account_manages_its_trials_and_nothing_outside_its_namespace(platform, store, tmp_path,
                                                                                   sweeps):
    sweeps(name := "sw-role")
    doc, _, _ = store
    binding = platform.get("rbac.authorization.k8s.io/v1", "RoleBinding", naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT, NS)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sweep-controller", "namespace": NS}]
    # Nothing a team member may not do himself: the real authorizer allows alice every grant of the account's Role.
    authz = k8s.AuthorizationV1Api(platform.plane.client().client)
    for rule in sweep_controller_rules():
        for group, resource, verb in ((g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                                      for v in rule["verbs"]):
            resource, _, sub = resource.partition("/")
            review = authz.create_subject_access_review({"spec": {
                "user": "alice", "groups": ["ml-research", "system:authenticated"], "resourceAttributes": {
                    "namespace": NS, "group": group, "resource": resource, "subresource": sub, "verb": verb,
                    "name": naming.PLATFORM_CONFIGMAP}}})
            assert review.status.allowed, (group, resource, verb)

    session = controller_session(platform)
    contract = load_contract(session, "research")  # the platform ConfigMap, by name
    assert contract.document() == {**doc, "endpoints": platform.contract["endpoints"]}
    local = PlatformContract.from_document(doc, "test")
    controller, _ = cluster_controller(session, local, parse_sweep(sweep_doc(name, parallel=3), "s.yaml"), "s.yaml",
                                       tmp_path / "state")
    assert controller.step()
    assert trial_names(platform, name) == [f"{name}-t00{n}" for n in range(3)]
    assert {j["metadata"]["labels"][QUEUE_LABEL] for j in platform.list(*JOBSET, NS)
            if j["metadata"]["name"].startswith(name)} == {naming.local_queue_name("research")}

    # Outside its namespace, and outside its trials' kinds, the real API server refuses it.
    trial = platform.get(*JOBSET, f"{name}-t000", NS)
    with pytest.raises(ClientError, match='cannot create resource "jobsets".* in the namespace "team-platform"'):
        jobs.create_jobset(session, {**trial, "metadata": {"name": "x", "namespace": "team-platform"}}, "platform")
    with pytest.raises(ClientError, match="403 Forbidden"):
        load_contract(session, "platform")
    for call in (lambda: session.core.list_namespaced_config_map(NS),
                 lambda: session.core.read_namespaced_pod_log("p", NS),
                 lambda: k8s.AppsV1Api(session.api).delete_namespaced_deployment(controller_name(name), NS),
                 lambda: session.core.read_namespaced_config_map("chat-route", NS)):
        with pytest.raises(ApiException) as exc:
            call()
        assert exc.value.status == 403 and "system:serviceaccount:team-research:sweep-controller" in exc.value.body


def test_submit_creates_and_replaces_the_controller_and_stop_pauses_what_the_next_one_resumes(platform, cli, store,
                                                                                              tmp_path, sweeps, clean):
    # A job holding 2 of research's 4 GPUs leaves room for two 1-GPU trials of three.
    assert submit(cli, platform, tmp_path, name="sw-holder", nodes="2:2")[0] == 0
    wait_for("'sw-holder' admitted", lambda: admitted(platform, "sw-holder") and gpu_usage(platform) == 2)
    sweeps(name := "sw-submit")
    doc, _, platform_file = store
    alice, spec = platform.kubeconfigs["alice"], sweep_file(tmp_path, sweep_doc(name, parallel=3))
    deployment = controller_name(name)
    code, out, err = cli("sweep", "submit", spec, "--kubeconfig", alice, "--platform", platform_file)
    assert code == 0 and f"controller deployment {NS}/{deployment} created" in out, err
    stored = platform.get("apps/v1", "Deployment", deployment, NS)
    assert stored["spec"]["template"]["spec"]["serviceAccountName"] == "sweep-controller"
    wait_for("the controller's pod Running", lambda: [p for p in platform.core().list_namespaced_pod(NS).items
                                                      if p.metadata.name.startswith(deployment + "-")
                                                      and p.status.phase == "Running"])
    code, out, err = cli("sweep", "submit", spec, "--kubeconfig", alice, "--platform", platform_file)
    assert code == 0 and f"{deployment} replaced" in out, err
    assert platform.get("apps/v1", "Deployment", deployment, NS)["metadata"]["generation"] == 2

    # What that controller does (as its account): three trials; Kueue admits two within the free quota.
    contract = PlatformContract.from_document(doc, "test")
    first, _ = cluster_controller(controller_session(platform), contract, load_sweep(spec), str(spec),
                                  tmp_path / "pod-1")
    assert first.step()
    trials = [f"{name}-t00{n}" for n in range(3)]
    wait_for("two trials admitted and a Workload for each", lambda: sum(admitted(platform, t) for t in trials) == 2
             and all(workload_of(platform, t) for t in trials))
    before = uids(platform, name)
    code, out, err = cli("sweep", "status", spec, "--cluster", "--platform", platform_file, "--runs",
                         tmp_path / "laptop")
    assert code == 0, err
    assert all(t in out for t in trials) and f"{name}-t003" not in out
    assert (tmp_path / "laptop" / name / "journal.jsonl").read_bytes() == \
        (tmp_path / "pod-1" / "journal.jsonl").read_bytes()

    code, out, err = cli("sweep", "stop", spec, "--cluster", "--kubeconfig", alice, "--platform", platform_file,
                         "--runs", tmp_path / "runs")
    assert code == 0, err
    assert f"trials paused (checkpoint kept, quota released): {', '.join(trials)};" in out and "not paused" not in out
    assert platform.get("apps/v1", "Deployment", deployment, NS) is None
    assert not any(active(platform, t) for t in trials)
    wait_for("Kueue to release the trials' quota", lambda: not any(admitted(platform, t) for t in trials))

    # The next controller, on a new disk: the same sweep from the object store, its trials resumed, none created again.
    second, _ = cluster_controller(controller_session(platform), contract, load_sweep(spec), str(spec),
                                   tmp_path / "pod-2")
    assert {t.id: t.state for t in second.state.trials.values()} == {t: "running" for t in trials}
    second.resume_active()
    assert all(active(platform, t) for t in trials)
    wait_for("Kueue to admit two of them again", lambda: sum(admitted(platform, t) for t in trials) == 2)
    assert uids(platform, name) == before


def test_a_controller_that_lost_its_disk_goes_on_with_no_trial_lost_or_run_twice(platform, store, tmp_path, sweeps):
    sweeps(name := "sw-disk")
    doc, s3, _ = store
    sweep = parse_sweep(sweep_doc(name), "s.yaml")
    contract = PlatformContract.from_document(doc, "test")
    first, _ = cluster_controller(controller_session(platform), contract, sweep, "s.yaml", tmp_path / "pod-1")
    assert first.step()
    held(s3, doc, name, f"{name}-t000", 3.0)
    held(s3, doc, name, f"{name}-t001", 4.0)
    assert first.step()  # t000 goes on, t001 is paused, t002 starts
    journal = (tmp_path / "pod-1" / "journal.jsonl").read_bytes()
    stored = s3.get_object(Bucket=doc["buckets"]["checkpoints"][5:], Key=f"research/{name}/controller/journal.jsonl")
    assert stored["Body"].read() == journal  # copied after its last record
    before = uids(platform, name)
    assert sorted(before) == [f"{name}-t00{n}" for n in range(3)]

    second, _ = cluster_controller(controller_session(platform), contract, sweep, "s.yaml", tmp_path / "pod-2")
    assert (tmp_path / "pod-2" / "journal.jsonl").read_bytes() == journal
    assert {t.id: (t.state, t.budget, t.params) for t in second.state.trials.values()} == \
        {t.id: (t.state, t.budget, t.params) for t in first.state.trials.values()}
    second.resume_active()
    assert uids(platform, name) == before  # t000 and t002 run, t001 is paused: nothing launched again
    assert not active(platform, f"{name}-t001") and active(platform, f"{name}-t002")
    held(s3, doc, name, f"{name}-t002", 5.0)  # the worst at the rung: paused, its slot goes to the last trial
    assert second.step()
    after = uids(platform, name)
    assert {k: v for k, v in after.items() if k in before} == before and sorted(set(after) - set(before)) == [
        f"{name}-t003"]
    assert [r["event"] for r in map(json.loads, (tmp_path / "pod-2" / "journal.jsonl").read_text().splitlines())
            ].count("suggest") == 4  # each trial asked for once, across both controllers

    # Two controllers' copies that disagree are refused, naming both, not merged.
    third = tmp_path / "pod-3"
    third.mkdir()
    (third / "journal.jsonl").write_text(f'{{"event": "start", "seq": 0, "sweep": "{name}"}}\n')
    with pytest.raises(MirrorError, match=rf"pod-3/journal.jsonl and s3://.*/research/{name}/controller/journal"):
        journal_mirror(checkpoints_store(contract), sweep, third).pull()


def test_a_gcs_checkpoints_bucket_holds_the_budgets_and_the_journal(platform, store, tmp_path, sweeps):
    """A GCP platform's gs:// bucket, through the one object-store layer (GCS's XML API; here the local S3 server
    answers for it, signed with HMAC-style keys as GCS's interoperability keys are)."""
    sweeps(name := "sw-gcs")
    doc, s3, _ = store
    gcs = "gpu-train-gcp-dev-checkpoints"
    s3.create_bucket(Bucket=gcs)
    contract = PlatformContract.from_document({**doc, "buckets": {**doc["buckets"], "checkpoints": f"gs://{gcs}"}},
                                              "test")
    controller, _ = cluster_controller(controller_session(platform), contract, parse_sweep(sweep_doc(name), "s.yaml"),
                                       "s.yaml", tmp_path / "pod")
    assert controller.step()
    jobset = platform.get(*JOBSET, f"{name}-t000", NS)
    args = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"train.budget_uri=gs://{gcs}/research/{name}/{name}-t000/budget.json" in args
    body = s3.get_object(Bucket=gcs, Key=f"research/{name}/{name}-t000/budget.json")["Body"].read()
    assert json.loads(body) == {"tokens": RUNG}
    stored = s3.get_object(Bucket=gcs, Key=f"research/{name}/controller/journal.jsonl")["Body"].read()
    assert stored == (tmp_path / "pod" / "journal.jsonl").read_bytes()
