"""`gpu-train prepare --cluster` through the real control plane, as a member of the team: the RayJob is stored against
KubeRay's CRD (tests/schemas/crds, from the pinned kuberay-operator chart), the real Kueue (integration
ray.io/rayjob, whose controller Kueue starts once the CRD appears after it) makes a Workload of its head and worker
groups, admits it on the CPU flavor only (the system nodes, never a GPU pool) against the team's `prepareQuota`
setting, and unsuspends it with a node selector that only the system nodes satisfy; a second one over that quota
waits with Kueue's own reason; cancelling the first frees the quota and the second is admitted. `gpu-train list` and
`status` show the RayJobs, to a member and to a viewer, as the API server has them.

The KubeRay operator does not run here (no binary is built for the lane): no Ray cluster, pods or Ray job are made
once Kueue unsuspends a RayJob; what KubeRay does with it is upstream's (docs/testing.md). Where a test needs the
status KubeRay would write, it writes those fields through the status subresource, as the operator does.

Run: .venv/bin/pytest tests/cluster/test_prepare_cluster.py -q
"""

from __future__ import annotations

import sys
import time
from fractions import Fraction
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpu_train.jobs.fit import quantity
from gpu_train.jobs.prepare import PREPARE_LABEL
from gpu_train.spec import naming
from gpu_train.spec.settings import StackSettings
from gpu_train.spec.settings_checks import parse
from tests.cluster import jobs
from tests.cluster.conftest import STACK, wait_for
from tests.cluster.jobs import NS, RAYJOB, WORKLOAD, condition

HEAD_CPU = 2  # every request here: a 2-CPU head and one worker


@pytest.fixture(scope="module")
def settings(plan_out) -> StackSettings:
    """The stack settings the lane's platform was planned from (tests/cluster/conftest.py)."""
    raw = yaml.safe_load((plan_out / f"Pulumi.{STACK}.yaml").read_text())["config"]
    return parse(raw, STACK)


def datasets(platform) -> str:
    return platform.contract["buckets"]["datasets"]


def suspended(platform, name: str) -> bool:
    """The RayJob's spec.suspend; Kueue writes it back through KubeRay's Go types, where false is omitted
    (`json:"suspend,omitempty"`), so an absent field is false."""
    return bool(platform.get(*RAYJOB, name, NS)["spec"].get("suspend", False))


def admitted(platform, name: str) -> bool:
    return jobs.admitted(platform, name, kind=RAYJOB)


def cpu_reserved(platform, flavor: str) -> Fraction:
    """CPUs Kueue counts as reserved in research's ClusterQueue on a flavor (its own status)."""
    cq = platform.get("kueue.x-k8s.io/v1beta2", "ClusterQueue", "team-research")
    for f in (cq.get("status") or {}).get("flavorsReservation") or []:
        if f["name"] == flavor:
            return sum((quantity(r["total"]) for r in f["resources"] if r["name"] == "cpu"), Fraction(0))
    return Fraction(0)


def assigned_flavors(wl: dict) -> dict[str, set[str]]:
    """Per pod set of an admitted Workload: the flavors Kueue assigned its resources."""
    return {a["name"]: set(a["flavors"].values()) for a in wl["status"]["admission"]["podSetAssignments"]}


@pytest.fixture
def no_rayjobs(platform):
    """No RayJob in research's namespace before or after; Kueue's CPU reservation back where it was."""
    rayjobs = platform.plane.client().resources.get(api_version=RAYJOB[0], kind=RAYJOB[1])

    def wipe() -> None:
        for job in platform.list(*RAYJOB, NS):
            rayjobs.delete(name=job["metadata"]["name"], namespace=NS, body={"propagationPolicy": "Foreground"})
        wait_for("no RayJob and no Workload of one in team-research", lambda: not platform.list(*RAYJOB, NS) and not [
            w for w in platform.list(*WORKLOAD, NS)
            if any(o["kind"] == "RayJob" for o in w["metadata"].get("ownerReferences") or [])])
    wipe()
    yield
    wipe()


def prepare(cli, platform, name: str, worker_cpu: int, user: str = "alice") -> tuple[int, str, str]:
    return cli("prepare", "--cluster", f"{datasets(platform)}/raw/{name}/", "--out",
               f"{datasets(platform)}/research/{name}", "--name", name, "--workers", 1, "--worker-cpu",
               worker_cpu, "--worker-memory", "2Gi", "--head-cpu", HEAD_CPU, "--head-memory", "1Gi",
               "--kubeconfig", platform.kubeconfigs[user])


def test_a_prepare_job_is_admitted_on_the_cpu_nodes_only_and_one_over_its_quota_waits(platform, cli, settings,
                                                                                     no_rayjobs):
    research = settings.team("research")
    nominal = research.prepare_quota.cpus
    borrowable = sum(t.prepare_quota.cpus for t in settings.teams if t.name != "research")
    gpu_pools = {p.name for p in settings.gpu_pools}
    assert cpu_reserved(platform, naming.CPU_FLAVOR) == 0
    on_pools = {pool: cpu_reserved(platform, pool) for pool in gpu_pools}
    # The first leaves 2 of research's own CPUs; the second asks for more than those and all it may borrow, but no
    # more than it could ever be admitted, so that the command's own quota check lets both through.
    first_cpu = nominal - 2 - HEAD_CPU
    second_cpu = 2 + borrowable + 2 - HEAD_CPU
    assert first_cpu >= 1 and HEAD_CPU + second_cpu <= nominal + borrowable, (nominal, borrowable)

    t0 = time.monotonic()
    code, out, err = prepare(cli, platform, "first", first_cpu)
    assert code == 0, err
    assert "submitted data preparation 'first' to team-research, queue research-queue" in out
    wait_for("Kueue to admit 'first' and unsuspend it", lambda: admitted(platform, "first") and
             not suspended(platform, "first"), timeout=180)
    # The figure docs/testing.md quotes (past the `cli` fixture's capture of stdout).
    print(f"\n'first' admitted and unsuspended {time.monotonic() - t0:.1f} s after gpu-train prepare --cluster",
          file=sys.__stderr__)
    wl = jobs.workload_of(platform, "first", kind=RAYJOB)
    assert wl["status"]["admission"]["clusterQueue"] == "team-research"
    flavors = assigned_flavors(wl)
    assert set(flavors) == {"head", "workers"}
    assert all(f == {naming.CPU_FLAVOR} for f in flavors.values()), flavors
    assert not set().union(*flavors.values()) & gpu_pools
    wait_for("Kueue to count the first's CPUs on the CPU flavor",
             lambda: cpu_reserved(platform, naming.CPU_FLAVOR) == nominal - 2)
    assert {pool: cpu_reserved(platform, pool) for pool in gpu_pools} == on_pools
    # The unsuspended Ray pods' templates select only nodes without a GPU: of the lane's nodes, the system ones.
    cluster = platform.get(*RAYJOB, "first", NS)["spec"]["rayClusterSpec"]
    nodes = platform.core().list_node().items
    for template in (cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])):
        selector = template["spec"]["nodeSelector"]
        fit = [n for n in nodes if selector.items() <= (n.metadata.labels or {}).items()]
        assert fit and all(naming.GPU_NODE_LABEL not in n.metadata.labels and
                           naming.GPU_RESOURCE not in (n.status.allocatable or {}) for n in fit), selector

    code, out, err = prepare(cli, platform, "second", second_cpu)
    assert code == 0, err
    wl = wait_for("Kueue's verdict on 'second'", lambda: (w := jobs.workload_of(platform, "second", kind=RAYJOB))
                  and condition(w, "QuotaReserved") and w)
    reserved = condition(wl, "QuotaReserved")
    assert reserved["status"] == "False" and reserved["reason"] == "Pending"
    # Kueue's own reasons: no GPU pool's flavor for pods that do not tolerate its nodes' taint; no room on `cpu`.
    for pool in gpu_pools:
        assert f"untolerated taint {{{naming.GPU_TAINT['key']} {naming.GPU_TAINT['value']} " \
               f"{naming.GPU_TAINT['effect']} <nil>}} in flavor {pool}" in reserved["message"], reserved["message"]
    assert suspended(platform, "second") and cpu_reserved(platform, naming.CPU_FLAVOR) == nominal - 2

    t0 = time.monotonic()
    code, out, err = cli("prepare", "--cancel", "first", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("'second' admitted once 'first' is cancelled",
             lambda: admitted(platform, "second") and not suspended(platform, "second"), timeout=180)
    print(f"'second' admitted {time.monotonic() - t0:.1f} s after gpu-train prepare --cancel first",
          file=sys.__stderr__)
    # Within research's own CPUs and what the platform team lends it there, on the CPU flavor alone.
    assert set().union(*assigned_flavors(jobs.workload_of(platform, "second", kind=RAYJOB)).values()) == {
        naming.CPU_FLAVOR}
    wait_for("Kueue to count only the second's CPUs", lambda: cpu_reserved(platform, naming.CPU_FLAVOR) ==
             HEAD_CPU + second_cpu)


def _row(out: str, name: str) -> dict[str, str]:
    lines = out.splitlines()
    header = lines[0].split()
    return next(dict(zip(header, line.split(), strict=True)) for line in lines[1:] if line.split()[0] == name)


def _kuberay_writes(platform, name: str, status: dict) -> None:
    """The status fields the KubeRay operator would set (ray-operator/apis/ray/v1/rayjob_types.go at v1.7.0)."""
    api = k8s_config.new_client_from_config(str(platform.plane.admin_kubeconfig))
    k8s.CustomObjectsApi(api).patch_namespaced_custom_object_status("ray.io", "v1", NS, "rayjobs", name,
                                                                    {"status": status})


def test_list_and_status_show_data_preparations_to_members_and_viewers(platform, cli, settings, no_rayjobs):
    alice, vera = platform.kubeconfigs["alice"], platform.kubeconfigs["vera"]
    nominal = settings.team("research").prepare_quota.cpus
    borrowable = sum(t.prepare_quota.cpus for t in settings.teams if t.name != "research")
    assert prepare(cli, platform, "listed", 2)[0] == 0
    wait_for("'listed' admitted", lambda: admitted(platform, "listed") and not suspended(platform, "listed"))
    # More than all that is left of research's own and borrowable CPUs: it waits.
    waiting_cpu = nominal + borrowable - (HEAD_CPU + 2) - HEAD_CPU + 1
    assert prepare(cli, platform, "waiting", waiting_cpu)[0] == 0
    wait_for("'waiting' pending", lambda: (w := jobs.workload_of(platform, "waiting", kind=RAYJOB)) and
                  (c := condition(w, "QuotaReserved")) and c["status"] == "False" and w)

    for user in (alice, vera):  # a member, and a viewer of the team
        code, out, err = cli("list", "--kubeconfig", user)
        assert code == 0, err
        assert out.splitlines()[0].split() == ["NAME", "KIND", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH",
                                               "HASH"]
        listed, waiting = _row(out, "listed"), _row(out, "waiting")
        stored = jobs.workload_of(platform, "listed", kind=RAYJOB)
        assert (listed["KIND"], listed["STATE"], listed["POOL"]) == ("prepare", "Running", ",".join(
            sorted(set().union(*assigned_flavors(stored).values()))))
        rj = platform.get(*RAYJOB, "listed", NS)["spec"]["rayClusterSpec"]
        assert listed["NODES"] == str(1 + sum(g["replicas"] for g in rj["workerGroupSpecs"]))
        assert (waiting["KIND"], waiting["STATE"], waiting["POOL"]) == ("prepare", "Queued", "-")

        # Kueue rewrites its message each time it tries again (naming the head's pod set or the workers'): status
        # shows the one it read, which the Workload still holds unless Kueue tried again in between.
        def shown(user: Any = user) -> str | None:
            code, out, err = cli("status", "waiting", "--kubeconfig", user)
            assert code == 0, err
            message = condition(jobs.workload_of(platform, "waiting", kind=RAYJOB), "QuotaReserved")["message"]
            return out if f"  Kueue: {message}\n" in out else None

        out = wait_for("status showing Kueue's message", shown, timeout=60)
        assert out.startswith("data preparation waiting in team-research: Queued\n")
        assert "KubeRay has set no status on it yet" in out

    # What KubeRay sets once the Ray cluster runs the job, then once it ends.
    _kuberay_writes(platform, "listed", {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                         "rayClusterName": "listed-raycluster-abcde"})
    code, out, err = cli("status", "listed", "--kubeconfig", vera)
    assert code == 0, err
    assert out.splitlines() == [
        "data preparation listed in team-research: Running",
        f"  admitted by cluster queue team-research on flavor {naming.CPU_FLAVOR}",
        "  KubeRay: jobDeploymentStatus Running, jobStatus RUNNING, rayClusterName listed-raycluster-abcde"]
    _kuberay_writes(platform, "listed", {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"})
    wait_for("'listed' Completed in gpu-train list",
             lambda: _row(cli("list", "--kubeconfig", alice)[1], "listed")["STATE"] == "Completed")
    # Kueue sees the RayJob finished and releases its quota: the waiting one is admitted.
    wait_for("'waiting' admitted once 'listed' finished", lambda: admitted(platform, "waiting"))

    # A viewer reads RayJobs but may not create or cancel one.
    code, out, err = prepare(cli, platform, "viewed", 1, user="vera")
    assert code == 1 and "you may not create rayjobs in namespace team-research (403 Forbidden" in err
    code, out, err = cli("prepare", "--cancel", "waiting", "--kubeconfig", vera)
    assert code == 1 and "403 Forbidden" in err
    assert platform.get(*RAYJOB, "waiting", NS) is not None


def test_bad_input_is_refused_before_sending(platform, cli, settings, no_rayjobs):
    research = settings.team("research")
    most = research.prepare_quota.cpus + sum(t.prepare_quota.cpus for t in settings.teams if t.name != "research")
    code, out, err = prepare(cli, platform, "huge", most)  # the head's CPUs on top: one too many
    assert code == 2 and "more than team research's queue can ever admit" in err
    assert f"({most} on flavor {naming.CPU_FLAVOR}" in err
    assert platform.list(*RAYJOB, NS) == []


# -- --runner job: the Indexed Job, which needs no operator --------------------------------------------------------
JOB = ("batch/v1", "Job")
MEMBER_POD_SET = "main"  # the one pod set Kueue makes of a batch Job (kueue's DefaultPodSetName)


@pytest.fixture
def no_prepare_jobs(platform):
    """No data preparation Job in research's namespace before or after, nor a Workload of one."""
    batch = platform.plane.client().resources.get(api_version=JOB[0], kind=JOB[1])

    def wipe() -> None:
        for job in platform.list(*JOB, NS, label_selector=PREPARE_LABEL):
            batch.delete(name=job["metadata"]["name"], namespace=NS, body={"propagationPolicy": "Foreground"})
        wait_for("no prepare Job and no Workload of a Job in team-research", lambda: not platform.list(
            *JOB, NS, label_selector=PREPARE_LABEL) and not [
            w for w in platform.list(*WORKLOAD, NS)
            if any(o["kind"] == "Job" for o in w["metadata"].get("ownerReferences") or [])])
    wipe()
    yield
    wipe()


def prepare_job(cli, platform, name: str, workers: int, worker_cpu: int, user: str = "alice") -> tuple[int, str, str]:
    return cli("prepare", "--cluster", f"{datasets(platform)}/raw/{name}/", "--out",
               f"{datasets(platform)}/research/{name}", "--name", name, "--runner", "job", "--workers", workers,
               "--worker-cpu", worker_cpu, "--worker-memory", "2Gi", "--kubeconfig", platform.kubeconfigs[user])


def test_an_indexed_job_is_admitted_on_the_cpu_flavor_one_over_its_quota_waits_and_cancel_frees_it(
        platform, cli, settings, no_prepare_jobs):
    nominal = settings.team("research").prepare_quota.cpus
    borrowable = sum(t.prepare_quota.cpus for t in settings.teams if t.name != "research")
    gpu_pools = {p.name for p in settings.gpu_pools}
    on_pools = {pool: cpu_reserved(platform, pool) for pool in gpu_pools}
    # The RayJobs of the tests before are deleted; Kueue releases their quota on its own time.
    wait_for("no CPU reserved on the cpu flavor", lambda: cpu_reserved(platform, naming.CPU_FLAVOR) == 0)
    # Two members leaving at least 2 of research's own CPUs; then one member needing one CPU more than is left of
    # research's own and borrowable CPUs, but no more than the queue could ever admit (the command's own check).
    first_cpu = (nominal - 2) // 2
    second_cpu = nominal + borrowable - 2 * first_cpu + 1
    assert first_cpu >= 1 and second_cpu <= nominal + borrowable

    t0 = time.monotonic()
    code, out, err = prepare_job(cli, platform, "first", 2, first_cpu)
    assert code == 0, err
    assert "submitted data preparation 'first' to team-research, queue research-queue (2 Indexed Job members" in out
    wait_for("Kueue to admit the Job 'first' and unsuspend it", lambda: jobs.admitted(platform, "first", kind=JOB)
             and not platform.get(*JOB, "first", NS)["spec"].get("suspend", False), timeout=180)
    print(f"\nJob 'first' admitted and unsuspended {time.monotonic() - t0:.1f} s after gpu-train prepare --cluster "
          "--runner job", file=sys.__stderr__)
    wl = jobs.workload_of(platform, "first", kind=JOB)
    assert wl["status"]["admission"]["clusterQueue"] == "team-research"
    (members,) = wl["status"]["admission"]["podSetAssignments"]
    assert members["name"] == MEMBER_POD_SET and members["count"] == 2
    assert set(members["flavors"].values()) == {naming.CPU_FLAVOR}
    wait_for("Kueue to count the members' CPUs on the CPU flavor",
             lambda: cpu_reserved(platform, naming.CPU_FLAVOR) == 2 * first_cpu)
    assert {pool: cpu_reserved(platform, pool) for pool in gpu_pools} == on_pools
    # The Job controller makes one pod per index, through the namespace's admission (Pod Security, the policies),
    # each told its index in JOB_COMPLETION_INDEX, which `prepare --member env/2` reads.
    pods = wait_for("the Job controller to create the members' pods", lambda: (
        found := platform.core().list_namespaced_pod(NS, label_selector="batch.kubernetes.io/job-name=first").items
    ) and len(found) == 2 and found)
    assert {p.metadata.labels["batch.kubernetes.io/job-completion-index"] for p in pods} == {"0", "1"}
    nodes = platform.core().list_node().items
    for pod in pods:
        (c,) = pod.spec.containers
        assert "JOB_COMPLETION_INDEX" in {e.name for e in c.env or []}
        assert c.command[c.command.index("--member") + 1] == "env/2"
        fit = [n for n in nodes if pod.spec.node_selector.items() <= (n.metadata.labels or {}).items()]
        assert fit and all(naming.GPU_NODE_LABEL not in n.metadata.labels and
                           naming.GPU_RESOURCE not in (n.status.allocatable or {}) for n in fit)

    code, out, err = prepare_job(cli, platform, "second", 1, second_cpu)
    assert code == 0, err
    wl = wait_for("Kueue's verdict on 'second'", lambda: (w := jobs.workload_of(platform, "second", kind=JOB))
                  and condition(w, "QuotaReserved") and w)
    reserved = condition(wl, "QuotaReserved")
    assert reserved["status"] == "False" and reserved["reason"] == "Pending"
    assert platform.get(*JOB, "second", NS)["spec"]["suspend"] is True
    assert cpu_reserved(platform, naming.CPU_FLAVOR) == 2 * first_cpu

    # A viewer sees the Jobs but may not create or cancel one.
    vera = platform.kubeconfigs["vera"]
    code, out, err = cli("list", "--kubeconfig", vera)
    assert code == 0, err
    first, second = _row(out, "first"), _row(out, "second")
    assert (first["KIND"], first["STATE"], first["NODES"], first["POOL"]) == ("prepare", "Running", "2",
                                                                             naming.CPU_FLAVOR)
    assert (second["KIND"], second["STATE"], second["POOL"]) == ("prepare", "Queued", "-")
    code, out, err = cli("status", "second", "--kubeconfig", vera)
    assert code == 0, err
    assert out.startswith("data preparation second in team-research: Queued\n")
    assert f"Kueue: {reserved['message']}" in out
    code, out, err = prepare_job(cli, platform, "viewed", 1, 1, user="vera")
    assert code == 1 and "you may not create jobs in namespace team-research (403 Forbidden" in err
    code, out, err = cli("prepare", "--cancel", "first", "--kubeconfig", vera)
    assert code == 1 and "403 Forbidden" in err

    t0 = time.monotonic()
    code, out, err = cli("prepare", "--cancel", "first", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("'second' admitted once 'first' is cancelled", lambda: jobs.admitted(platform, "second", kind=JOB) and
             not platform.get(*JOB, "second", NS)["spec"].get("suspend", False), timeout=180)
    print(f"Job 'second' admitted {time.monotonic() - t0:.1f} s after gpu-train prepare --cancel first",
          file=sys.__stderr__)
    (members,) = jobs.workload_of(platform, "second", kind=JOB)["status"]["admission"]["podSetAssignments"]
    assert set(members["flavors"].values()) == {naming.CPU_FLAVOR}
    wait_for("Kueue to count only the second's CPUs", lambda: cpu_reserved(platform, naming.CPU_FLAVOR) == second_cpu)
    code, out, err = cli("status", "second", "--kubeconfig", vera)
    assert code == 0 and out.startswith("data preparation second in team-research: Running\n"), (out, err)
    assert f"admitted by cluster queue team-research on flavor {naming.CPU_FLAVOR}" in out

    # Over what the queue could ever admit: refused before anything is sent.
    code, out, err = prepare_job(cli, platform, "huge", 1, nominal + borrowable + 1)
    assert code == 2 and f"--workers 1 x --worker-cpu {nominal + borrowable + 1} = " in err
    assert platform.get(*JOB, "huge", NS) is None
