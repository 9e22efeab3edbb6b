"""Team jobs on the cluster lane's plane, as the tests read them: a JobSet's Kueue Workload and its conditions, its
pods, the GPUs a ClusterQueue has reserved, and `gpu-train submit` as a team member. (The `clean` fixture of
tests/cluster/conftest.py starts and ends a test with the team queues empty.)

Usage (in a tests/cluster module):
    from tests.cluster.jobs import admitted, submit, running_pods
    def test_x(platform, cli, tmp_path, clean):
        assert submit(cli, platform, tmp_path, name="x", nodes="2:2")[0] == 0
        wait_for("'x' admitted", lambda: admitted(platform, "x"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.cluster.conftest import job_spec

JOBSET = ("jobset.x-k8s.io/v1alpha2", "JobSet")
RAYJOB = ("ray.io/v1", "RayJob")
WORKLOAD = ("kueue.x-k8s.io/v1beta2", "Workload")
NS = "team-research"


def workload_of(platform, name: str, ns: str = NS, kind: tuple[str, str] = JOBSET) -> dict[str, Any] | None:
    """The Workload Kueue made for the job `name` of `kind` (a JobSet unless said), found by the job's UID label."""
    job = platform.get(*kind, name, ns)
    if job is None:
        return None
    found = platform.list(*WORKLOAD, ns, label_selector=f"kueue.x-k8s.io/job-uid={job['metadata']['uid']}")
    return found[0] if found else None


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return None


def admitted(platform, name: str, ns: str = NS, kind: tuple[str, str] = JOBSET) -> bool:
    return is_true(workload_of(platform, name, ns, kind), "Admitted")


def pods_of(platform, name: str, ns: str = NS) -> list[Any]:
    return platform.core().list_namespaced_pod(ns, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items


def running_pods(platform, name: str, ns: str = NS) -> list[Any]:
    return [p for p in pods_of(platform, name, ns) if p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def gpu_usage(platform, cq: str = "team-research") -> int:
    """GPUs Kueue counts as reserved in the ClusterQueue (its own status)."""
    obj = platform.get("kueue.x-k8s.io/v1beta2", "ClusterQueue", cq)
    total = 0
    for flavor in (obj.get("status") or {}).get("flavorsReservation") or []:
        for res in flavor["resources"]:
            if res["name"] == "nvidia.com/gpu":
                total += int(res["total"])
    return total


def submit(cli, platform, tmp_path, user: str = "alice", **spec: Any) -> tuple[int, str, str]:
    return cli("submit", job_spec(tmp_path, **spec), "--kubeconfig", platform.kubeconfigs[user])


def jobset_of(platform: Any, name: str, ns: str = NS) -> dict[str, Any] | None:
    return platform.get(*JOBSET, name, ns)


def is_true(obj: dict[str, Any] | None, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in ((obj or {}).get("status") or {}).get("conditions")
               or [])


def pending(platform: Any, name: str) -> bool:
    """Kueue has looked at the job and reserved no quota for it: it waits in its queue (its JobSet suspended)."""
    wl = workload_of(platform, name)
    return any(c["type"] == "QuotaReserved" and c["status"] == "False"
               for c in ((wl or {}).get("status") or {}).get("conditions") or [])


def fail_pod(platform: Any, pod: Any, exit_code: int) -> None:
    """kwok's failure stage ends the pod's containers with this exit code (tools/cluster/controllers.py)."""
    from tools.cluster.controllers import FAIL_EXIT_CODE, FAIL_LABEL

    platform.core().patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace, {"metadata": {
        "labels": {FAIL_LABEL: "true"}, "annotations": {FAIL_EXIT_CODE: str(exit_code)}}})


def delete_jobset(platform: Any, name: str, ns: str = NS) -> None:
    platform.plane.client().resources.get(api_version=JOBSET[0], kind=JOBSET[1]).delete(
        name=name, namespace=ns, body={"propagationPolicy": "Foreground"})


def kubeconfig_variant(platform: Any, user: str, path: Path, *, namespace: str | None = None,
                       auth: dict[str, Any] | None = None) -> Path:
    """`user`'s kubeconfig with its context's namespace (None: as it is, "": none) or its credential replaced."""
    doc = yaml.safe_load(platform.kubeconfigs[user].read_text())
    if namespace is not None:
        doc["contexts"][0]["context"]["namespace"] = namespace
    if auth is not None:
        doc["users"][0]["user"] = auth
    path.write_text(yaml.safe_dump(doc))
    return path


def service_account_kubeconfig(platform: Any, account: str, ns: str = NS) -> Path:
    """The identity a pod of `account` has: the API server sees system:serviceaccount:NS:ACCOUNT in the
    service-account groups (a client certificate stands in for the token, the authorizer sees the same user)."""
    return platform.plane.user_kubeconfig(f"system:serviceaccount:{ns}:{account}",
                                          ("system:serviceaccounts", f"system:serviceaccounts:{ns}"), ns)
