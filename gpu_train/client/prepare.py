"""`gpu-train prepare --cluster`: create, read or cancel a team's data preparation, a RayJob or (--runner job) an Indexed
Job (gpu_train/jobs/prepare.py).

Usage (gpu_train.client.Client wraps these):
    obj = build(contract, request)         # checked and built, nothing sent; ClientError naming each bad flag
    create(session, obj, team)             # the RayJob or Job in the team's namespace, suspended in its queue
    rows = list_prepares(session, team)             # `gpu-train list`'s rows (kind prepare), RayJobs and Jobs
    st = prepare_status(session, team, name)        # `gpu-train status NAME`; None when there is no such preparation
    cancel(session, team, name)            # delete it (Kueue's Workload and KubeRay's Ray cluster or the pods go too)

A data preparation is the RayJob of that name, else the Job of that name carrying the prepare label (a Job without
it, such as a JobSet's child Job, is none). Its state is a JobSet's (gpu_train.client.status.queue_state: Kueue's
Workload, found by its owner) until it ends: a RayJob's `status.jobDeploymentStatus` Complete with `jobStatus`
SUCCEEDED is Completed; Complete with any other Ray job status, or Failed, is Failed
(ray-operator/apis/ray/v1/rayjob_types.go at v1.7.0); a Job's condition Complete is Completed and Failed is Failed
(k8s.io/api/batch/v1 JobConditionType). `status` shows KubeRay's own fields, or the Job controller's counts.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from gpu_train.client.cluster import Session, call, team_namespace
from gpu_train.client.errors import ClientError
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
from gpu_train.jobs.prepare import PREPARE_LABEL, QUEUE_LABEL, RAY_API, PrepareRequest, check_request, render
from gpu_train.spec.contract import ContractError, PlatformContract

GROUP, VERSION = RAY_API.split("/")
PLURAL = "rayjobs"
# Where each kind of data preparation lives in the API (both through the custom objects client: it serves any group).
KINDS = {"RayJob": (GROUP, VERSION, PLURAL), "Job": ("batch", "v1", "jobs")}
KIND = "prepare"  # the kind `gpu-train list` and `status` give a data preparation
# What `status` shows of the RayJob's status, as KubeRay names the fields.
KUBERAY_FIELDS = ("jobDeploymentStatus", "jobStatus", "rayClusterName", "reason", "message")


def build(contract: PlatformContract, request: PrepareRequest) -> dict[str, Any]:
    problems = check_request(request, contract)
    if problems:
        raise ClientError("\n".join(problems))
    try:
        return render(request, contract)
    except ContractError as exc:
        raise ClientError(str(exc)) from None


def create(session: Session, obj: Mapping[str, Any], team: str) -> None:
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    group, version, plural = KINDS[obj["kind"]]
    try:
        call(session, session.custom.create_namespaced_custom_object, group, version, ns, plural, dict(obj),
             doing=f"create {plural}", namespace=ns, team=team)
    except ClientError as exc:
        if "(409)" in str(exc):
            raise ClientError(f"data preparation {name!r} already exists in {ns}: `gpu-train prepare --cancel {name}` "
                              "removes it", code=1) from None
        raise


def find(session: Session, team: str, name: str) -> dict[str, Any] | None:
    """The team's data preparation of that name: its RayJob, else its Job (one with the prepare label); None."""
    ns = team_namespace(team)
    for kind, (group, version, plural) in KINDS.items():
        try:
            obj = call(session, session.custom.get_namespaced_custom_object, group, version, ns, plural, name,
                       doing=f"read {plural[:-1]} {name!r}", namespace=ns, team=team)
        except ClientError as exc:
            if "(404)" in str(exc):  # none of that name, or (RayJob) KubeRay's CRD is not installed
                continue
            raise
        if kind == "RayJob" or PREPARE_LABEL in ((obj.get("metadata") or {}).get("labels") or {}):
            return {**obj, "kind": kind}
    return None


def cancel(session: Session, team: str, name: str) -> None:
    ns = team_namespace(team)
    obj = find(session, team, name)
    if obj is None:
        raise ClientError(f"no data preparation {name!r} in {ns}")
    group, version, plural = KINDS[obj["kind"]]
    try:
        call(session, session.custom.delete_namespaced_custom_object, group, version, ns, plural, name,
             propagation_policy="Background", doing=f"delete {plural[:-1]} {name!r}", namespace=ns, team=team)
    except ClientError as exc:
        if "(404)" in str(exc):
            raise ClientError(f"no data preparation {name!r} in {ns}") from None
        raise


def succeeded(obj: Mapping[str, Any]) -> bool | None:
    """True when the preparation succeeded, False when it failed (or was stopped), None while neither: a RayJob as
    KubeRay says (ray_succeeded), a Job by its Complete or Failed condition."""
    if obj.get("kind") != "Job":
        return ray_succeeded(obj)
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return cond["type"] == "Complete"
    return None


def ray_succeeded(rayjob: Mapping[str, Any]) -> bool | None:
    """True when KubeRay says the Ray job succeeded, False when it failed or was stopped, None while neither."""
    st = rayjob.get("status") or {}
    deployment, job = st.get("jobDeploymentStatus"), st.get("jobStatus")
    if deployment == "Complete":
        return job == "SUCCEEDED"
    return False if deployment == "Failed" else None


def _pods(obj: Mapping[str, Any]) -> int:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Job":
        return int(spec.get("parallelism") or 0)
    cluster = spec.get("rayClusterSpec") or {}
    return 1 + sum(int(g.get("replicas") or 0) for g in cluster.get("workerGroupSpecs") or [])


def _flavors(workload: Mapping[str, Any] | None) -> str:
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    found = sorted({f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})
    return ",".join(found) or "-"


def list_prepares(session: Session, team: str) -> list[JobSummary]:
    """`gpu-train list`'s rows of the team's data preparations (RayJobs, and Jobs with the prepare label), each with
    its Kueue Workload."""
    ns = team_namespace(team)
    items: list[dict[str, Any]] = []
    for kind, (group, version, plural) in KINDS.items():
        try:
            found = call(session, session.custom.list_namespaced_custom_object, group, version, ns, plural,
                         label_selector="" if kind == "RayJob" else PREPARE_LABEL, doing=f"list {plural}",
                         namespace=ns, team=team).get("items") or []
        except ClientError as exc:
            if "(404)" not in str(exc) or kind != "RayJob":
                raise
            print(f"gpu-train: note: the cluster serves no {PLURAL}.{GROUP} (KubeRay's CRD is not installed): no Ray "
                  "data preparations to list", file=sys.stderr)
            continue
        items += [{**obj, "kind": kind} for obj in found]  # a list's items carry no kind of their own
    found_wl = workloads(session, ns, team) if items else []
    rows = []
    for obj in items:
        wl = workload_of(obj, found_wl)
        rows.append(JobSummary(name=obj["metadata"]["name"], kind=KIND, state=queue_state(succeeded(obj), wl),
                               nodes=str(_pods(obj)), pool=_flavors(wl),
                               age=age(obj["metadata"].get("creationTimestamp"))))
    return rows


def kuberay_notes(rayjob: Mapping[str, Any]) -> list[str]:
    """The RayJob's status as KubeRay set it, one line; or that it has set none yet."""
    st = rayjob.get("status") or {}
    shown = [f"{key} {st[key]}" for key in KUBERAY_FIELDS if st.get(key) not in (None, "")]
    if not shown:
        return ["KubeRay has set no status on it yet (no Ray cluster before Kueue admits it)"]
    return ["KubeRay: " + ", ".join(shown)]


def job_notes(job: Mapping[str, Any]) -> list[str]:
    """The Job's status as the Job controller set it, one line: its members' counts and failed indexes."""
    st = job.get("status") or {}
    completions = (job.get("spec") or {}).get("completions", "?")
    if not st:
        return ["the Job controller has set no status on it yet (no member pods before Kueue admits it)"]
    line = (f"Job: {st.get('succeeded', 0)} of {completions} members succeeded, {st.get('active', 0)} running, "
            f"{st.get('failed', 0)} pods failed")
    if st.get("failedIndexes"):
        line += f", failed indexes {st['failedIndexes']}"
    return [line]


def prepare_status(session: Session, team: str, name: str) -> JobStatus | None:
    """`gpu-train status NAME` of a data preparation: its state, what Kueue says of it (the flavor it was admitted
    on, or why and where it waits) and KubeRay's status fields or the Job's counts; None when the team has no data
    preparation of that name."""
    ns = team_namespace(team)
    obj = find(session, team, name)
    if obj is None:
        return None
    uid = obj["metadata"].get("uid", "")
    wl = workload_of(obj, workloads(session, ns, team, f"{JOB_UID_LABEL}={uid}" if uid else ""))
    now = queue_state(succeeded(obj), wl)
    queue = (obj["metadata"].get("labels") or {}).get(QUEUE_LABEL, "?")
    own = kuberay_notes(obj) if obj["kind"] == "RayJob" else job_notes(obj)
    return JobStatus(name=name, namespace=ns, state=now, queue=queue, kind=KIND,
                     notes=[*kueue_notes(session, ns, queue, now, wl, where="flavor"), *own])
