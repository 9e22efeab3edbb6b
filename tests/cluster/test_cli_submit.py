"""`gpu-train submit` against the real control plane, as the team's users: the JobSet read back from the API server is
the one `--dry-run` renders, Kueue makes its Workload in the team's queue and admits it; a second submit is the
API server's conflict; RBAC refuses a viewer and a user of no team, and the API server refuses an unknown credential
(401); the command's own checks (the platform's pools, its registries, Kueue's quota arithmetic) refuse before
anything reaches the cluster, and the team namespace's ValidatingAdmissionPolicy has the last word when a stale
contract lets an image through.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_cli_submit.py -q

The tests share the lane's plane and run in file order; the `clean` fixture leaves the team namespaces empty
before and after each.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from gpu_train.jobs import gitops
from gpu_train.jobs.jobset import HASH_ANNOTATION, QUEUE_LABEL
from tests.cluster.conftest import ROOT, job_spec, wait_for
from tests.cluster.jobs import JOBSET, NS, is_true, jobset_of, kubeconfig_variant, workload_of
from tests.gpu_train.cli.conftest import only_error_lines

OLD_REGISTRY = "111111111111.dkr.ecr.us-east-1.amazonaws.com/"


def _contract_file(platform, tmp_path, change) -> str:
    """The stack's own contract as a --platform file, after `change(doc)`."""
    doc = copy.deepcopy(platform.contract)
    change(doc)
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _nothing_in_team_namespaces(platform) -> bool:
    return not platform.list(*JOBSET, NS) and not platform.list(*JOBSET, "team-platform")


def test_submit_creates_the_jobset_kueue_admits_in_the_teams_queue(platform, cli, tmp_path, clean):
    path = job_spec(tmp_path, name="sub-create", nodes="1:2")
    _, rendered, _ = cli("submit", path, "--dry-run", "--platform", platform.contract_file)
    code, out, err = cli("submit", path, "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    assert "submitted job 'sub-create' to team-research, queue research-queue" in out
    # The memory a GPU needs under the job's layout, against the pool's GPU (gpu_train/sizing/memory.py).
    assert "  memory: ~" in out and " per GPU of a L4's 24 GB, under pp=1 x dp_replicate=" in out
    live = jobset_of(platform, "sub-create")
    assert live["metadata"]["labels"][QUEUE_LABEL] == "research-queue"
    # The API server stored every field the command rendered (a dry run renders the same), and changed none:
    # what it and Kueue added are not drift (gpu_train.jobs.gitops).
    desired = yaml.safe_load(rendered)
    assert gitops.drift(desired, live) == []
    assert live["metadata"]["annotations"][HASH_ANNOTATION] == desired["metadata"]["annotations"][HASH_ANNOTATION]
    # Kueue made the Workload in the team's LocalQueue, admitted it in the team's ClusterQueue, and unsuspended
    # the JobSet (the command creates it suspended).
    wl = wait_for("Kueue to admit 'sub-create'", lambda: is_true(w := workload_of(platform, "sub-create"), "Admitted")
                  and w)
    assert wl["spec"]["queueName"] == "research-queue" and wl["status"]["admission"]["clusterQueue"] == NS
    assert desired["spec"]["suspend"] is True
    wait_for("the JobSet unsuspended by Kueue", lambda: jobset_of(platform, "sub-create")["spec"]["suspend"] is False)
    # Only the team's namespace holds it.
    assert [js["metadata"]["namespace"] for js in platform.list(*JOBSET) if js["metadata"]["name"] == "sub-create"] \
        == [NS]


def test_a_second_submit_of_the_same_job_is_a_conflict(platform, cli, tmp_path, clean):
    alice = platform.kubeconfigs["alice"]
    assert cli("submit", job_spec(tmp_path, name="sub-twice"), "--kubeconfig", alice)[0] == 0
    uid = jobset_of(platform, "sub-twice")["metadata"]["uid"]
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-twice", steps=300), "--kubeconfig", alice)
    assert code == 1 and only_error_lines(err)
    assert "job 'sub-twice' already exists in team-research" in err and "gpu-train cancel sub-twice" in err
    assert jobset_of(platform, "sub-twice")["metadata"]["uid"] == uid  # the first one, untouched


def test_a_user_of_no_team_may_not_read_the_contract(platform, cli, tmp_path, clean):
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-nobody"), "--kubeconfig", platform.kubeconfigs["mallory"])
    assert code == 1 and only_error_lines(err)
    assert "you may not read the platform contract (configmap gpu-train-platform) in namespace team-research" in err
    assert '403 Forbidden: configmaps "gpu-train-platform" is forbidden: User "mallory" cannot get' in err
    assert "not a member of team 'research'" in err
    assert _nothing_in_team_namespaces(platform)


def test_a_viewer_cannot_submit(platform, cli, tmp_path, clean):
    """vera (ml-platform) views research: she reads its contract, and RBAC refuses the create."""
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-viewer"), "--kubeconfig", platform.kubeconfigs["vera"])
    assert code == 1 and only_error_lines(err)
    assert "you may not create jobsets in namespace team-research (403 Forbidden" in err
    assert 'User "vera" cannot create resource "jobsets"' in err
    assert _nothing_in_team_namespaces(platform)


def test_credentials_the_api_server_does_not_accept(platform, cli, tmp_path, clean):
    """An expired cloud token is a bearer token the API server does not know; a client certificate of another CA is
    not one of its users either: both 401."""
    from tools.cluster.pki import Authority

    expired = kubeconfig_variant(platform, "alice", tmp_path / "expired", auth={"token": "k8s-aws-v1.expired"})
    cert, key = Authority.create(tmp_path / "other-ca").client("alice", ("ml-research",))
    stranger = kubeconfig_variant(platform, "alice", tmp_path / "stranger",
                                  auth={"client-certificate": str(cert), "client-key": str(key)})
    for kubeconfig in (expired, stranger):
        code, _, err = cli("submit", job_spec(tmp_path, name="sub-expired"), "--kubeconfig", kubeconfig)
        assert code == 1 and only_error_lines(err), err
        assert "did not accept your credentials (401 Unauthorized) to read the platform contract" in err
    assert _nothing_in_team_namespaces(platform)


def test_an_unknown_pool_names_the_platforms_pools(platform, cli, tmp_path, clean):
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-pool", pool="h100"), "--kubeconfig",
                       platform.kubeconfigs["alice"])
    assert code == 2 and only_error_lines(err)
    assert "job.pool 'h100' is not one of gpuPools[].name (l4-spot, l40s-spot)" in err
    assert _nothing_in_team_namespaces(platform)


def test_a_job_its_teams_quota_can_never_admit_is_refused_before_sending(platform, cli, tmp_path, clean):
    """The team's nominal quota covers MIN nodes (the stack's check passes), but Kueue admits a JobSet whole, MAX
    pods at once, and a cluster queue of 2 GPUs can never hold 4: the command says so and sends nothing."""
    def two_gpus(doc):
        doc["teams"][0]["gpuQuota"]["l4-spot"] = 2
        cq = next(q for q in doc["kueue"]["clusterQueues"] if q["metadata"]["name"] == NS)
        (gpu,) = [r for f in cq["spec"]["resourceGroups"][0]["flavors"] if f["name"] == "l4-spot"
                  for r in f["resources"] if r["name"] == "nvidia.com/gpu"]
        gpu.update(nominalQuota=2, lendingLimit=2)

    code, _, err = cli("submit", job_spec(tmp_path, name="sub-never", nodes="1:4", globalBatchTokens=196608),
                       "--platform", _contract_file(platform, tmp_path, two_gpus),
                       "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 2 and only_error_lines(err)
    assert "Kueue would not admit job 'sub-never' from queue research-queue of team 'research'" in err
    assert "insufficient quota for nvidia.com/gpu in flavor l4-spot: 4 pods x 1 = 4 > maximum capacity 2" in err
    assert _nothing_in_team_namespaces(platform)


def test_an_image_from_elsewhere_is_refused_and_one_from_the_registry_is_created(platform, cli, tmp_path, clean):
    alice, (registry,) = platform.kubeconfigs["alice"], platform.contract["registries"]
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-image"), "--kubeconfig", alice,
                       "--image", "docker.io/library/python@sha256:" + "1" * 64)
    assert code == 2 and "team namespaces admit only images from the platform registry" in err
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-image"), "--kubeconfig", alice,
                       "--image", registry + "custom:latest")
    assert code == 2 and "must be pinned by digest" in err
    assert _nothing_in_team_namespaces(platform)
    mine = registry + "research/custom@sha256:" + "2" * 64
    code, _, err = cli("submit", job_spec(tmp_path, name="sub-image"), "--kubeconfig", alice, "--image", mine)
    assert code == 0, err
    pod = jobset_of(platform, "sub-image")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == mine  # admitted by the namespace's policies, stored as sent


def test_the_clusters_admission_policy_has_the_last_word(platform, cli, tmp_path, clean):
    """A stale contract that still names an old registry: the command's own check passes, the API server's
    ValidatingAdmissionPolicy refuses (403, reason Forbidden), and the command prints the server's reason."""
    def stale(doc):
        doc["image"] = OLD_REGISTRY + "old-trainer@sha256:" + "d" * 64
        doc["registries"] = [OLD_REGISTRY]

    code, _, err = cli("submit", job_spec(tmp_path, name="sub-stale"), "--platform",
                       _contract_file(platform, tmp_path, stale), "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 2 and only_error_lines(err)
    assert "the cluster refused to create jobsets in namespace team-research (403 Forbidden)" in err
    assert "ValidatingAdmissionPolicy 'gpu-train-team-jobsets' with binding 'gpu-train-team-jobsets' denied " \
           "request: image-registry:" in err
    assert "member" not in err
    assert _nothing_in_team_namespaces(platform)


def test_a_team_not_on_the_cluster(platform, cli, tmp_path, clean):
    """No namespace team-nlp: RBAC refuses a team member before anything else (403); an administrator, whom RBAC
    lets read any namespace, learns that no contract is there (404)."""
    spec = job_spec(tmp_path, name="sub-nlp", team="nlp")
    code, _, err = cli("submit", spec, "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 1 and only_error_lines(err)
    assert 'User "alice" cannot get resource "configmaps" in API group "" in the namespace "team-nlp"' in err
    code, _, err = cli("submit", spec, "--kubeconfig", platform.plane.admin_kubeconfig)
    assert code == 2 and only_error_lines(err)
    assert "no platform contract in namespace team-nlp" in err and "team 'nlp' is not on this cluster" in err
    assert not [js for js in platform.list(*JOBSET) if js["metadata"]["name"] == "sub-nlp"]


@pytest.mark.parametrize("example", ("plain-loop", "hf-gpt2"))
def test_the_team_namespaces_admission_policies_admit_an_examples_job(example, platform, cli, tmp_path, clean):
    """An example's job (examples/*/job.yaml) with its image in the team's repository of the platform registry is
    admitted by the real API server's policies; from a registry the platform does not allow it is refused before
    anything is sent."""
    (registry,) = platform.contract["registries"]
    image = f"{registry}research/{example}@sha256:" + "e" * 64
    spec = ROOT / "examples" / example / "job.yaml"
    code, _, err = cli("submit", spec, "--kubeconfig", platform.kubeconfigs["alice"], "--image", image)
    assert code == 0, err
    name = yaml.safe_load(spec.read_text())["name"]
    created = jobset_of(platform, name)
    assert created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == image
    other = {**yaml.safe_load(spec.read_text()), "name": f"{name}-x"}
    elsewhere = tmp_path / f"{name}-x.yaml"
    elsewhere.write_text(yaml.safe_dump(other))
    code, _, err = cli("submit", elsewhere, "--kubeconfig", platform.kubeconfigs["alice"], "--image",
                       "docker.io/acme/train@sha256:" + "e" * 64)
    assert code == 2 and "team namespaces admit only images from the platform registry" in err
    assert jobset_of(platform, f"{name}-x") is None
