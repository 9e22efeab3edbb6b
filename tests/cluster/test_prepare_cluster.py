"""`gpu-train prepare --cluster` through the real control plane, as a member of the team: the RayJob is stored against
KubeRay's CRD (tests/schemas/crds, from the pinned kuberay-operator chart), the real Kueue (integration
ray.io/rayjob, whose controller Kueue starts once the CRD appears after it) makes a Workload of its head and worker
groups, admits it against the team's CPU quota and unsuspends it; a second one over the CPU quota waits with Kueue's
own reason; cancelling the first frees the quota and the second is admitted.

The KubeRay operator does not run here (no binary is built for the lane): no Ray cluster, pods or Ray job are made
once Kueue unsuspends a RayJob; what KubeRay does with it is upstream's (docs/testing.md).

Run: .venv/bin/pytest tests/cluster/test_prepare_cluster.py -q
"""

from __future__ import annotations

import sys
import time
from fractions import Fraction

import pytest

from gpu_train.jobs.fit import quantity
from tests.cluster import jobs
from tests.cluster.conftest import wait_for
from tests.cluster.jobs import NS, RAYJOB, WORKLOAD, condition


def datasets(platform) -> str:
    return platform.contract["buckets"]["datasets"]


def suspended(platform, name: str) -> bool:
    """The RayJob's spec.suspend; Kueue writes it back through KubeRay's Go types, where false is omitted
    (`json:"suspend,omitempty"`), so an absent field is false."""
    return bool(platform.get(*RAYJOB, name, NS)["spec"].get("suspend", False))


def admitted(platform, name: str) -> bool:
    return jobs.admitted(platform, name, kind=RAYJOB)


def cpu_reserved(platform, flavor: str = "l4-spot") -> Fraction:
    """CPUs Kueue counts as reserved in research's ClusterQueue on a flavor (its own status)."""
    cq = platform.get("kueue.x-k8s.io/v1beta2", "ClusterQueue", "team-research")
    for f in (cq.get("status") or {}).get("flavorsReservation") or []:
        if f["name"] == flavor:
            return sum((quantity(r["total"]) for r in f["resources"] if r["name"] == "cpu"), Fraction(0))
    return Fraction(0)


def nominal_cpu(platform, flavor: str = "l4-spot") -> Fraction:
    cq = platform.get("kueue.x-k8s.io/v1beta2", "ClusterQueue", "team-research")
    (group,) = cq["spec"]["resourceGroups"]
    res = next(f for f in group["flavors"] if f["name"] == flavor)["resources"]
    return quantity(next(r for r in res if r["name"] == "cpu")["nominalQuota"])


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


def prepare(cli, platform, name: str, workers: int, worker_cpu: int, user: str = "alice") -> tuple[int, str, str]:
    return cli("prepare", "--cluster", f"{datasets(platform)}/raw/{name}/", "--out",
               f"{datasets(platform)}/research/{name}", "--name", name, "--workers", workers, "--worker-cpu",
               worker_cpu, "--worker-memory", "2Gi", "--head-cpu", 2, "--head-memory", "1Gi",
               "--kubeconfig", platform.kubeconfigs[user])


def test_a_prepare_job_is_admitted_by_kueue_and_unsuspended_and_one_over_cpu_quota_waits(platform, cli, no_rayjobs):
    # Whatever else holds research's CPU on l4-spot is counted: size the first to leave 8 CPUs, the second above
    # both that and the 64 CPUs research may borrow on l40s-spot (platform's share), each within what the queue
    # could ever admit, so that the command's own quota check lets both through.
    free = int(nominal_cpu(platform) - cpu_reserved(platform))
    before = cpu_reserved(platform)
    first_cpu = free - 8 - 2
    assert first_cpu >= 1, f"only {free} CPUs free on l4-spot"

    t0 = time.monotonic()
    code, out, err = prepare(cli, platform, "first", 1, first_cpu)
    assert code == 0, err
    assert "submitted data preparation 'first' to team-research, queue research-queue" in out
    assert suspended(platform, "first") or admitted(platform, "first")
    wait_for("Kueue to admit 'first' and unsuspend it", lambda: admitted(platform, "first") and
             not suspended(platform, "first"), timeout=180)
    # The figure docs/testing.md quotes (past the `cli` fixture's capture of stdout).
    print(f"\n'first' admitted and unsuspended {time.monotonic() - t0:.1f} s after gpu-train prepare --cluster",
          file=sys.__stderr__)
    wl = jobs.workload_of(platform, "first", kind=RAYJOB)
    assert wl["status"]["admission"]["clusterQueue"] == "team-research"
    sets = {a["name"]: a for a in wl["status"]["admission"]["podSetAssignments"]}
    assert set(sets) == {"head", "workers"}
    assert {a["flavors"]["cpu"] for a in sets.values()} == {"l4-spot"}
    wait_for("Kueue to count the first's CPUs", lambda: cpu_reserved(platform) == before + first_cpu + 2)

    # 72 CPUs: more than the 8 left on l4-spot and the 64 research may borrow on l40s-spot, less than its 128.
    code, out, err = prepare(cli, platform, "second", 1, 70)
    assert code == 0, err
    wl = wait_for("Kueue's verdict on 'second'", lambda: (w := jobs.workload_of(platform, "second", kind=RAYJOB)) and
                  condition(w, "QuotaReserved") and w)
    reserved = condition(wl, "QuotaReserved")
    assert reserved["status"] == "False" and reserved["reason"] == "Pending"
    assert "insufficient unused quota for cpu in flavor l4-spot" in reserved["message"]
    assert suspended(platform, "second")

    t0 = time.monotonic()
    code, out, err = cli("prepare", "--cancel", "first", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("'second' admitted once 'first' is cancelled",
             lambda: admitted(platform, "second") and not suspended(platform, "second"), timeout=180)
    print(f"'second' admitted {time.monotonic() - t0:.1f} s after gpu-train prepare --cancel first",
          file=sys.__stderr__)
    wait_for("Kueue to count only the second's CPUs", lambda: cpu_reserved(platform) == before + 72)


def test_a_viewer_may_not_prepare_and_bad_input_is_refused_before_sending(platform, cli, no_rayjobs):
    code, out, err = prepare(cli, platform, "viewed", 1, 4, user="vera")
    assert code == 1 and "you may not create rayjobs in namespace team-research (403 Forbidden" in err
    code, out, err = prepare(cli, platform, "huge", 40, 8)
    assert code == 2 and "more than team research's queue can ever admit" in err
    assert platform.list(*RAYJOB, NS) == []
