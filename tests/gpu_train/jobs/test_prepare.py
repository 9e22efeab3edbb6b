"""`gpu-train prepare --cluster`'s RayJob (gpu_train/jobs/prepare.py) and the refusals before anything is sent, on the
dev stack's contract (tests/gpu_train/cli/conftest.py). Pure functions, and the command in-process with --platform.

Usage: .venv/bin/pytest tests/gpu_train/jobs/test_prepare.py -q
"""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from gpu_train.jobs import prepare
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract
from infra.k8s import pod_admission
from tests.gpu_train.cli.conftest import REGISTRY, contract_doc, only_error_lines
from tests.infra.k8s.vap import Admission

ROOT = Path(__file__).resolve().parents[3]
DATASETS = "s3://gpu-train-aws-dev-datasets"


def contract() -> PlatformContract:
    return PlatformContract.from_document(contract_doc(), "test")


def request(**over) -> prepare.PrepareRequest:
    kw = dict(name="web", team="research", inputs=(f"{DATASETS}/raw/web/",), out=f"{DATASETS}/research/web",
              tokenizer="bpe", vocab_size=8192, tasks=64, workers=3, worker_cpu=8, worker_memory="16Gi")
    kw.update(over)
    return prepare.PrepareRequest(**kw)


def test_the_rayjob_waits_suspended_in_the_teams_queue_and_runs_the_local_prepare_on_ray():
    job = prepare.ray_job(request(), contract())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["metadata"]["namespace"] == "team-research"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research-queue"
    spec = job["spec"]
    # Kueue unsuspends it on admission and requires the cluster to go when the job ends.
    assert spec["suspend"] is True and spec["shutdownAfterJobFinishes"] is True
    assert spec["submissionMode"] == "HTTPMode" and spec["rayClusterSpec"]["enableInTreeAutoscaling"] is False
    argv = shlex.split(spec["entrypoint"])
    assert argv[:5] == ["python", "-m", "trainer.data", "prepare", f"{DATASETS}/raw/web/"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert flags["--out"] == f"{DATASETS}/research/web"
    assert (flags["--engine"], flags["--address"], flags["--workers"]) == ("ray", "auto", "24")  # 3 x 8 CPUs
    assert (flags["--tokenizer"], flags["--vocab-size"], flags["--tasks"]) == ("bpe", "8192", "64")
    # The same parser the local command uses accepts every flag.
    from trainer.data.__main__ import parser

    parsed = parser().parse_args(argv[3:])
    assert (parsed.engine, parsed.address, parsed.tasks, parsed.vocab_size) == ("ray", "auto", 64, 8192)


def test_head_and_one_worker_group_with_requests_the_data_prep_identity_and_the_platform_image():
    cluster = prepare.ray_job(request(), contract())["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3
    assert cluster["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}  # tasks run on the workers only
    for template, cpu, memory in ((cluster["headGroupSpec"]["template"], "1", "4Gi"),
                                  (workers["template"], "8", "16Gi")):
        pod = template["spec"]
        assert pod["serviceAccountName"] == naming.DATA_PREP_SERVICE_ACCOUNT
        (c,) = pod["containers"]
        assert c["image"] == contract().image
        assert c["resources"] == {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
        assert {"name": "AWS_REGION", "value": "us-east-1"} in c["env"]
    assert prepare.requested(request()) == {"cpu": 25, "memory": (4 + 3 * 16) * 2**30}
    # The Ray the image installs is the one the RayJob declares.
    prep = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["prep"]
    assert f"ray[default]=={prepare.RAY_VERSION}" in prep


def test_the_ray_pods_select_the_cpu_flavors_nodes_and_match_no_gpu_pools_flavor():
    doc = contract()
    cpu = next(f for f in doc.kueue.resource_flavors if f["metadata"]["name"] == naming.CPU_FLAVOR)
    # The contract's CPU flavor is the platform's system nodes (the cloud layer's selector).
    import infra.aws

    assert cpu["spec"]["nodeLabels"] == infra.aws.SYSTEM_LABELS
    cluster = prepare.ray_job(request(), doc)["spec"]["rayClusterSpec"]
    for template in (cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]):
        pod = template["spec"]
        assert pod["nodeSelector"] == infra.aws.SYSTEM_LABELS
        # No toleration at all: Kueue gives a pool's flavor only to pod sets that tolerate its nodes' taints, and
        # the scheduler keeps them off those nodes too.
        assert "tolerations" not in pod
        for pool in (f for f in doc.kueue.resource_flavors if f["metadata"]["name"] != naming.CPU_FLAVOR):
            assert naming.GPU_TAINT["key"] in {t["key"] for t in pool["spec"]["nodeTaints"]}, pool["metadata"]["name"]


def test_a_contract_without_the_cpu_flavor_is_refused_naming_it():
    doc = contract_doc()
    doc["kueue"]["resourceFlavors"] = [f for f in doc["kueue"]["resourceFlavors"]
                                       if f["metadata"]["name"] != naming.CPU_FLAVOR]
    old = PlatformContract.from_document(doc, "platform.json")
    (problem,) = prepare.check_request(request(), old)
    assert problem.startswith("platform.json: kueue.resourceFlavors has no 'cpu' flavor")


def test_the_ray_pods_pass_the_team_namespaces_admission_policies():
    admission = Admission(pod_admission.admission_policies(nvme_host_path="/mnt/k8s-disks/0", registries=[REGISTRY]))
    cluster = prepare.ray_job(request(), contract())["spec"]["rayClusterSpec"]
    for template in (cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-research"},
               "spec": template["spec"]}
        assert admission.denials(pod, namespace="team-research") == []
        # KubeRay's wait-gcs-ready init container copies the Ray container's image and securityContext.
        (c,) = template["spec"]["containers"]
        init = {"name": "wait-gcs-ready", "image": c["image"], "securityContext": c["securityContext"]}
        with_init = {**pod, "spec": {**pod["spec"], "initContainers": [init]}}
        assert admission.denials(with_init, namespace="team-research") == []
    broken = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-research"},
              "spec": {**cluster["headGroupSpec"]["template"]["spec"], "securityContext": {}, "containers": [
                  {**cluster["headGroupSpec"]["template"]["spec"]["containers"][0], "securityContext": {}}]}}
    assert any(d.startswith("non-root") for d in admission.denials(broken, namespace="team-research"))


@pytest.mark.parametrize(("over", "culprit"), [
    ({"team": "nobody"}, "--team: team 'nobody' is not on this platform"),
    ({"out": "s3://elsewhere/research/web"}, "--out s3://elsewhere/research/web: the cluster's Ray pods may write "
                                             "only under the datasets bucket's prefix for team research"),
    ({"out": f"{DATASETS}/platform/web"}, f"--out {DATASETS}/platform/web:"),
    ({"out": f"{DATASETS}/research"}, f"--out {DATASETS}/research:"),
    ({"inputs": ("corpus/",)}, "input corpus/: the cluster's Ray pods read only objects in the datasets bucket"),
    # research's prepareQuota (32 CPUs, 128 GiB) plus what platform's default one (8, 32 GiB) lends it.
    ({"workers": 16, "worker_memory": "4Gi"}, "--head-cpu 1 + --workers 16 x --worker-cpu 8 = 129 CPUs: more than "
                                              "team research's queue can ever admit (40 on flavor cpu, "
                                              "teams[].prepareQuota)"),
    ({"worker_memory": "1Ti"}, "--head-memory 4Gi + --workers 3 x --worker-memory 1Ti = 3076Gi bytes of memory: "
                               "more than team research's queue can ever admit (160Gi on flavor cpu"),
    ({"tokenizer": "gpt2"}, "--tokenizer gpt2 reads GPT-2's files from a local folder"),
    ({"name": "Web_1"}, "--name 'Web_1' is not a job name"),
])
def test_bad_input_is_refused_in_one_line_naming_the_culprit(over, culprit):
    problems = prepare.check_request(request(**over), contract())
    assert len(problems) == 1 and problems[0].startswith(culprit), problems


def test_a_request_within_quota_has_no_problems():
    assert prepare.check_request(request(), contract()) == []
    # Only the CPU flavor counts, never a GPU pool's CPUs: platform's own 8 plus research's 32, which it may borrow.
    assert prepare.team_quota_limits(contract(), "platform") == {"cpu": 40, "memory": 160 * 2**30}


def test_the_command_prints_the_rayjob_on_a_dry_run_and_refuses_before_sending(cli, tmp_path):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(contract_doc()))
    base = ("prepare", "--cluster", f"{DATASETS}/raw/", "--team", "research", "--platform", platform, "--dry-run")
    code, out, err = cli(*base, "--out", f"{DATASETS}/research/web-2024", "--workers", "4")
    assert code == 0, err
    job = yaml.safe_load(out)
    assert job["metadata"]["name"] == "web-2024" and job["spec"]["suspend"] is True
    assert job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 4
    code, out, err = cli(*base, "--out", f"{DATASETS}/research/web", "--workers", "40")
    assert code == 2 and out == "" and only_error_lines(err)
    assert "--workers 40 x --worker-cpu 2 = 81 CPUs" in err
    code, out, err = cli("prepare", f"{DATASETS}/raw/", "--out", f"{DATASETS}/research/web", "--team", "research",
                         "--platform", platform)
    assert code == 2 and "prepare runs on the cluster only (--cluster)" in err


# -- --runner job: the Indexed Job ---------------------------------------------------------------------------------
K8S = "1.33"  # the API version tests/gpu_train/jobs/test_serving.py validates against


def job_request(**over) -> prepare.PrepareRequest:
    return request(runner="job", **over)


def test_the_indexed_job_waits_suspended_in_the_teams_queue_and_runs_one_member_per_worker(monkeypatch):
    job = prepare.indexed_job(job_request(), contract())
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert job["metadata"]["namespace"] == "team-research"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research-queue"
    assert job["metadata"]["labels"][prepare.PREPARE_LABEL] == "web"
    spec = job["spec"]
    assert spec["suspend"] is True and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3  # --workers 3: every member at once
    # A member is retried on its own index a bounded number of times; one index out of retries fails the Job.
    assert 1 <= spec["backoffLimitPerIndex"] <= 5 and spec["maxFailedIndexes"] == 0
    assert spec["ttlSecondsAfterFinished"] == 3600
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # what backoffLimitPerIndex and podFailurePolicy need
    (c,) = pod["containers"]
    argv = c["command"]
    assert argv[:5] == ["python", "-m", "trainer.data", "prepare", f"{DATASETS}/raw/web/"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert (flags["--engine"], flags["--workers"], flags["--member"]) == ("local", "8", "env/3")  # 8 CPUs per pod
    assert (flags["--tokenizer"], flags["--vocab-size"], flags["--tasks"]) == ("bpe", "8192", "64")
    # Kubernetes sets JOB_COMPLETION_INDEX in each pod of an Indexed Job; the local command reads it.
    from trainer.data.__main__ import parser

    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    parsed = parser().parse_args(argv[3:])
    assert (parsed.member, parsed.engine, parsed.workers, parsed.tasks) == ((2, 3), "local", 8, 64)
    # Bad input (exit 2) fails the index at once; the pod failure rules name the container that exits so.
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailIndex", "onExitCodes": {"containerName": c["name"], "operator": "In", "values": [2]}} in rules


def test_the_members_pods_are_the_ray_workers_pods_but_for_their_command():
    ray_pod = prepare.ray_job(request(), contract())["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    job_pod = prepare.indexed_job(job_request(), contract())["spec"]["template"]
    (rc,), (jc,) = ray_pod["spec"]["containers"], job_pod["spec"]["containers"]
    assert {k: v for k, v in jc.items() if k not in ("name", "command")} == {k: v for k, v in rc.items() if k != "name"}
    assert {k: v for k, v in job_pod["spec"].items() if k not in ("containers", "restartPolicy")} == {
        k: v for k, v in ray_pod["spec"].items() if k != "containers"}
    pod = job_pod["spec"]
    import infra.aws

    assert pod["serviceAccountName"] == naming.DATA_PREP_SERVICE_ACCOUNT
    assert pod["nodeSelector"] == infra.aws.SYSTEM_LABELS and "tolerations" not in pod  # never a GPU pool
    assert jc["image"] == contract().image
    assert jc["resources"] == {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}


def test_the_job_is_a_valid_batch_v1_job_and_passes_the_team_namespaces_admission_policies():
    import kubernetes_validate

    job = prepare.indexed_job(job_request(), contract())
    kubernetes_validate.validate(job, K8S, strict=True)
    admission = Admission(pod_admission.admission_policies(nvme_host_path="/mnt/k8s-disks/0", registries=[REGISTRY]))
    assert admission.denials(job, namespace="team-research") == []
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-research"},
           "spec": job["spec"]["template"]["spec"]}
    assert admission.denials(pod, namespace="team-research") == []
    (c,) = job["spec"]["template"]["spec"]["containers"]
    broken = {**job, "spec": {**job["spec"], "template": {**job["spec"]["template"], "spec": {
        **job["spec"]["template"]["spec"], "containers": [{**c, "securityContext": {"privileged": True}}]}}}}
    assert admission.denials(broken, namespace="team-research") != []


def test_the_jobs_quota_is_its_members_alone():
    # research may be admitted 40 CPUs on flavor cpu (its 32 and platform's 8): 5 members of 8 CPUs fit, while the
    # RayJob of the same workers needs its head's CPU on top.
    assert prepare.requested(job_request(workers=5)) == {"cpu": 40, "memory": 5 * 16 * 2**30}
    assert prepare.check_request(job_request(workers=5), contract()) == []
    (ray_problem,) = prepare.check_request(request(workers=5), contract())
    assert ray_problem.startswith("--head-cpu 1 + --workers 5 x --worker-cpu 8 = 41 CPUs")
    (problem,) = prepare.check_request(job_request(workers=6), contract())
    assert problem.startswith("--workers 6 x --worker-cpu 8 = 48 CPUs: more than team research's queue can ever "
                              "admit (40 on flavor cpu, teams[].prepareQuota)")
    (problem,) = prepare.check_request(job_request(force=True), contract())
    assert problem.startswith("--force does not go with --runner job")
    (problem,) = prepare.check_request(request(runner="spark"), contract())
    assert problem.startswith("--runner 'spark' is not one of ray, job")


def test_the_command_prints_the_job_on_a_dry_run_with_runner_job(cli, tmp_path):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(contract_doc()))
    code, out, err = cli("prepare", "--cluster", f"{DATASETS}/raw/", "--team", "research", "--platform", platform,
                         "--dry-run", "--runner", "job", "--out", f"{DATASETS}/research/web-2024", "--workers", "4")
    assert code == 0, err
    job = yaml.safe_load(out)
    assert (job["kind"], job["metadata"]["name"], job["spec"]["completions"]) == ("Job", "web-2024", 4)
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] != "--force"
    code, out, err = cli("prepare", "--cluster", f"{DATASETS}/raw/", "--team", "research", "--platform", platform,
                         "--dry-run", "--runner", "job", "--out", f"{DATASETS}/research/web", "--workers", "21")
    assert code == 2 and out == "" and only_error_lines(err)
    assert "--workers 21 x --worker-cpu 2 = 42 CPUs" in err
