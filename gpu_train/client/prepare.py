"""`gpu-train prepare --cluster`: create, read or cancel a team's data preparation RayJob (gpu_train/jobs/prepare.py).

Usage (gpu_train.client.Client wraps these):
    rayjob = build(contract, request)      # checked and built, nothing sent; ClientError naming each bad flag
    create(session, rayjob, team)          # the RayJob in the team's namespace, suspended in its queue
    rows = list_rayjobs(session, team)              # `gpu-train list`'s rows (kind prepare)
    st = rayjob_status(session, team, name)         # `gpu-train status NAME`; None when there is no such RayJob
    cancel(session, team, name)            # delete it (Kueue's Workload and KubeRay's Ray cluster go with it)

A RayJob's state is a JobSet's (gpu_train.client.status.queue_state: Kueue's Workload, found by its owner) until
KubeRay ends it: `status.jobDeploymentStatus` Complete with `jobStatus` SUCCEEDED is Completed; Complete with any
other Ray job status, or Failed, is Failed (ray-operator/apis/ray/v1/rayjob_types.go at v1.7.0). `status` shows
KubeRay's own fields as it set them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from gpu_train.client.cluster import ClientError, Session, call, team_namespace
from gpu_train.client.status import (
    JOB_UID_LABEL,
    JobStatus,
    JobSummary,
    age,
    kueue_notes,
    queue_state,
    workload_of,
    workloads,
)
from gpu_train.jobs.prepare import QUEUE_LABEL, RAY_API, PrepareRequest, check_request, ray_job
from gpu_train.spec.contract import ContractError, PlatformContract

GROUP, VERSION = RAY_API.split("/")
PLURAL = "rayjobs"
KIND = "prepare"  # the kind `gpu-train list` and `status` give a data preparation
# What `status` shows of the RayJob's status, as KubeRay names the fields.
KUBERAY_FIELDS = ("jobDeploymentStatus", "jobStatus", "rayClusterName", "reason", "message")


def build(contract: PlatformContract, request: PrepareRequest) -> dict[str, Any]:
    problems = check_request(request, contract)
    if problems:
        raise ClientError("\n".join(problems))
    try:
        return ray_job(request, contract)
    except ContractError as exc:
        raise ClientError(str(exc)) from None


def create(session: Session, rayjob: Mapping[str, Any], team: str) -> None:
    ns, name = rayjob["metadata"]["namespace"], rayjob["metadata"]["name"]
    try:
        call(session, session.custom.create_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, dict(rayjob),
             doing="create rayjobs", namespace=ns, team=team)
    except ClientError as exc:
        if "(409)" in str(exc):
            raise ClientError(f"data preparation {name!r} already exists in {ns}: `gpu-train prepare --cancel {name}` "
                              "removes it", code=1) from None
        raise


def cancel(session: Session, team: str, name: str) -> None:
    ns = team_namespace(team)
    try:
        call(session, session.custom.delete_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, name,
             propagation_policy="Background", doing=f"delete rayjob {name!r}", namespace=ns, team=team)
    except ClientError as exc:
        if "(404)" in str(exc):
            raise ClientError(f"no data preparation {name!r} in {ns}") from None
        raise


def ray_succeeded(rayjob: Mapping[str, Any]) -> bool | None:
    """True when KubeRay says the Ray job succeeded, False when it failed or was stopped, None while neither."""
    st = rayjob.get("status") or {}
    deployment, job = st.get("jobDeploymentStatus"), st.get("jobStatus")
    if deployment == "Complete":
        return job == "SUCCEEDED"
    return False if deployment == "Failed" else None


def _pods(rayjob: Mapping[str, Any]) -> int:
    cluster = (rayjob.get("spec") or {}).get("rayClusterSpec") or {}
    return 1 + sum(int(g.get("replicas") or 0) for g in cluster.get("workerGroupSpecs") or [])


def _flavors(workload: Mapping[str, Any] | None) -> str:
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    found = sorted({f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})
    return ",".join(found) or "-"


def list_rayjobs(session: Session, team: str) -> list[JobSummary]:
    """`gpu-train list`'s rows of the team's data preparations, each with its Kueue Workload."""
    ns = team_namespace(team)
    try:
        items = call(session, session.custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                     doing="list rayjobs", namespace=ns, team=team).get("items") or []
    except ClientError as exc:
        if "(404)" not in str(exc):
            raise
        print(f"gpu-train: note: the cluster serves no {PLURAL}.{GROUP} (KubeRay's CRD is not installed): no data "
              "preparations to list", file=sys.stderr)
        return []
    found = workloads(session, ns, team) if items else []
    rows = []
    for rj in items:
        wl = workload_of(rj, found)
        rows.append(JobSummary(name=rj["metadata"]["name"], kind=KIND, state=queue_state(ray_succeeded(rj), wl),
                               nodes=str(_pods(rj)), pool=_flavors(wl),
                               age=age(rj["metadata"].get("creationTimestamp"))))
    return rows


def kuberay_notes(rayjob: Mapping[str, Any]) -> list[str]:
    """The RayJob's status as KubeRay set it, one line; or that it has set none yet."""
    st = rayjob.get("status") or {}
    shown = [f"{key} {st[key]}" for key in KUBERAY_FIELDS if st.get(key) not in (None, "")]
    if not shown:
        return ["KubeRay has set no status on it yet (no Ray cluster before Kueue admits it)"]
    return ["KubeRay: " + ", ".join(shown)]


def rayjob_status(session: Session, team: str, name: str) -> JobStatus | None:
    """`gpu-train status NAME` of a data preparation: its state, what Kueue says of it (the flavor it was admitted
    on, or why and where it waits) and KubeRay's status fields; None when the team has no RayJob of that name."""
    ns = team_namespace(team)
    try:
        rj = call(session, session.custom.get_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, name,
                  doing=f"read rayjob {name!r}", namespace=ns, team=team)
    except ClientError as exc:
        if "(404)" in str(exc):
            return None
        raise
    uid = rj["metadata"].get("uid", "")
    wl = workload_of(rj, workloads(session, ns, team, f"{JOB_UID_LABEL}={uid}" if uid else ""))
    now = queue_state(ray_succeeded(rj), wl)
    queue = (rj["metadata"].get("labels") or {}).get(QUEUE_LABEL, "?")
    return JobStatus(name=name, namespace=ns, state=now, queue=queue, kind=KIND,
                     notes=[*kueue_notes(session, ns, queue, now, wl, where="flavor"), *kuberay_notes(rj)])
