"""Where a team's jobs stand: each JobSet's state from its own conditions and Kueue's Workload, its queue position,
its pods, and rank 0's progress. The team's data preparations (RayJobs) are read by gpu_train/client/prepare.py with
the same Kueue helpers and shown in the same rows; gpu_train.client.Client puts both together.

Usage (gpu_train.client.Client wraps these; each takes a Session, gpu_train/client/cluster.py):
    rows = list_jobs(session, "research")          # [JobSummary(name, state, nodes, pool, age, ..., kind="job")]
    st = status(session, "research", "gpt2-smoke") # JobStatus: state, queue position, pods, progress

States: Completed, Failed (the JobSet's conditions), Pending (Kueue has not made its Workload yet), Paused
(the Workload's spec.active is false), Running (admitted), Evicted, Queued, Finished. The Workload is found by
its owner: Kueue labels it with the JobSet's UID (kueue.x-k8s.io/job-uid, pkg/controller/constants at v0.19.2)
and owns it from the JobSet. Queue positions come from Kueue's visibility API
(visibility.kueue.x-k8s.io/v1beta2 localqueues/<queue>/pendingworkloads); step, loss and throughput from rank
0's metrics endpoint (the `trainer_*` gauges of trainer/metrics.py; a job of its own code may serve the same
names), read through the API server's pod proxy.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_train.client.cluster import Session, call, team_namespace
from gpu_train.client.errors import ClientError
from gpu_train.jobs.jobset import COMMIT_ANNOTATION, CONTAINER, HASH_ANNOTATION, JOBSET_API, PATH_ANNOTATION
from gpu_train.spec import naming

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
JOBSET_GROUP, JOBSET_VERSION = JOBSET_API.split("/")
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
VISIBILITY = "/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{namespace}/localqueues/{name}/pendingworkloads"
# Kubernetes sets this label on every pod of an Indexed Job (KEP-3329): the pod's index, here the node rank.
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
TERMINAL = ("Completed", "Failed")


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def _true(obj: Mapping[str, Any], kind: str) -> bool:
    c = _condition(obj, kind)
    return bool(c) and c.get("status") == "True"


def succeeded(jobset: Mapping[str, Any]) -> bool | None:
    """True when the JobSet completed, False when it failed, None while it is neither."""
    if _true(jobset, "Completed"):
        return True
    return False if _true(jobset, "Failed") else None


def workload_of(job: Mapping[str, Any], workloads: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The Workload Kueue made for this job (a JobSet, or another kind it carries): owned by it (kind, name and
    UID)."""
    meta, kind = job.get("metadata") or {}, job.get("kind") or "JobSet"
    for wl in workloads:
        for ref in (wl.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("kind") == kind and ref.get("name") == meta.get("name") and ref.get("uid") == meta.get("uid"):
                return wl
    return None


def state(jobset: Mapping[str, Any], workload: Mapping[str, Any] | None) -> str:
    """Completed, Failed, Paused, Running, Evicted, Queued, Finished, or Pending (no Workload yet)."""
    return queue_state(succeeded(jobset), workload)


def queue_state(done: bool | None, workload: Mapping[str, Any] | None) -> str:
    """A job's state from whether it ended (`done`: True completed, False failed, None neither) and its Workload."""
    if done is not None:
        return "Completed" if done else "Failed"
    if workload is None:
        return "Pending"
    if (workload.get("spec") or {}).get("active") is False:
        return "Paused"
    for kind, name in (("Finished", "Finished"), ("Admitted", "Running"), ("Evicted", "Evicted")):
        if _true(workload, kind):
            return name
    return "Queued"


def age(ts: str | None, now: dt.datetime | None = None) -> str:
    if not ts:
        return "-"
    then = dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    seconds = int(((now or dt.datetime.now(dt.UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def no_job(exc: ClientError, name: str) -> bool:
    """The error get_jobset raises for a name that is no JobSet of the team."""
    return str(exc).startswith(f"no job {name!r}")


def get_jobset(session: Session, ns: str, name: str, team: str) -> Mapping[str, Any]:
    try:
        return call(session, session.custom.get_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets",
                    name, doing=f"read job {name!r}", namespace=ns, team=team)
    except ClientError as exc:
        if "(404)" in str(exc):
            raise ClientError(f"no job {name!r} in {ns} (`gpu-train list` shows the team's jobs)") from None
        raise


def list_jobsets(session: Session, ns: str, team: str) -> list[Mapping[str, Any]]:
    return call(session, session.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets",
                doing="list jobsets", namespace=ns, team=team).get("items") or []


def workloads(session: Session, ns: str, team: str, selector: str = "") -> list[Mapping[str, Any]]:
    return call(session, session.custom.list_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, ns, "workloads",
                label_selector=selector, doing="list workloads", namespace=ns, team=team).get("items") or []


def find_workload(session: Session, ns: str, team: str, jobset: Mapping[str, Any]) -> Mapping[str, Any] | None:
    uid = (jobset.get("metadata") or {}).get("uid", "")
    return workload_of(jobset, workloads(session, ns, team, f"{JOB_UID_LABEL}={uid}" if uid else ""))


def job_state(session: Session, team: str, name: str) -> str | None:
    """A job's state (as `state` says it), or None when there is no such JobSet."""
    found = job_workload(session, team, name)
    return None if found is None else found[0]


def job_workload(session: Session, team: str, name: str) -> tuple[str, Mapping[str, Any] | None] | None:
    """A job's state and its Kueue Workload (None before Kueue made one), or None when there is no such JobSet."""
    ns = team_namespace(team)
    try:
        jobset = get_jobset(session, ns, name, team)
    except ClientError as exc:
        if no_job(exc, name):
            return None
        raise
    workload = find_workload(session, ns, team, jobset)
    return state(jobset, workload), workload


def worker_job(jobset: Mapping[str, Any]) -> Mapping[str, Any]:
    """The Job spec of a JobSet's first replicated job ({} for a JobSet without one)."""
    jobs = (jobset.get("spec") or {}).get("replicatedJobs") or [{}]
    return (jobs[0].get("template") or {}).get("spec") or {}


@dataclass(frozen=True)
class JobSummary:
    """One row of `gpu-train list`."""

    name: str
    state: str
    nodes: str  # the JobSet's pods (MAX nodes); a RayJob's head and workers
    pool: str  # a RayJob's: the flavor Kueue admitted it on ("-" before)
    age: str
    commit: str = "-"
    path: str = "-"
    hash: str = "-"
    kind: str = "job"  # job (a JobSet) or prepare (a data preparation's RayJob)


def list_jobs(session: Session, team: str) -> list[JobSummary]:
    """The team's jobs (JobSets)."""
    ns = team_namespace(team)
    jobsets = list_jobsets(session, ns, team)
    found = workloads(session, ns, team)
    rows = []
    for js in jobsets:
        spec = worker_job(js)
        pool = ((spec.get("template") or {}).get("spec", {}).get("nodeSelector") or {}).get(naming.POOL_LABEL, "-")
        notes = js["metadata"].get("annotations") or {}
        rows.append(JobSummary(
            name=js["metadata"]["name"], state=state(js, workload_of(js, found)),
            nodes=str(spec.get("parallelism", "-")), pool=pool, age=age(js["metadata"].get("creationTimestamp")),
            commit=notes.get(COMMIT_ANNOTATION, "-")[:12], path=notes.get(PATH_ANNOTATION, "-"),
            hash=notes.get(HASH_ANNOTATION, "-").removeprefix("sha256:")[:12]))
    return rows


def setting(jobset: Mapping[str, Any], key: str) -> float | None:
    """A bundled trainer's setting (section.key=value) from the JobSet's container arguments; None for a job that
    runs its own code, which has no such argument."""
    pod = (worker_job(jobset).get("template") or {}).get("spec") or {}
    trainer = next((c for c in pod.get("containers") or [] if c.get("name") == CONTAINER), {})
    for arg in trainer.get("args") or []:
        if isinstance(arg, str) and arg.startswith(key + "="):
            try:
                return float(arg.split("=", 1)[1])
            except ValueError:
                return None
    return None


def read_metrics(text: str) -> dict[str, float]:
    """The trainer's gauges from a Prometheus text exposition (trainer/metrics.py names)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"trainer_step", "trainer_loss", "trainer_tokens_per_second", "trainer_last_step_timestamp_seconds"}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = float(sample.value)
    return out


def progress(metrics: Mapping[str, float], steps: float | None, batch_tokens: float | None) -> str:
    """`step 120/200  loss 3.412  tokens/s 12,345  ETA 0:05:31` from rank 0's gauges and the job's settings."""
    step = metrics.get("trainer_step")
    if step is None:
        return "no step yet"
    parts = [f"step {int(step)}" + (f"/{int(steps)}" if steps else "")]
    loss = metrics.get("trainer_loss")
    if loss is not None and math.isfinite(loss):
        parts.append(f"loss {loss:.4f}")
    rate = metrics.get("trainer_tokens_per_second")
    if rate is not None and math.isfinite(rate) and rate > 0:
        parts.append(f"tokens/s {rate:,.0f}")
        if steps and batch_tokens:
            remaining = max(0.0, steps - step) * batch_tokens / rate
            parts.append(f"ETA {dt.timedelta(seconds=round(remaining))}")
    return "  ".join(parts)


def queue_position(session: Session, ns: str, queue: str, workload: str) -> str:
    try:
        summary = session.api.call_api(VISIBILITY, "GET", path_params={"namespace": ns, "name": queue},
                                       header_params={"Accept": "application/json"},
                                       response_types_map={200: "object"}, auth_settings=["BearerToken"],
                                       _return_http_data_only=True)
    except Exception as exc:  # the position is a courtesy: say why it is missing, keep going
        return f"queue position unknown (Kueue's visibility API: {getattr(exc, 'status', '')} " \
               f"{getattr(exc, 'reason', exc)})".replace("  ", " ")
    for item in (summary or {}).get("items") or []:
        if (item.get("metadata") or {}).get("name") == workload:
            return (f"position {item.get('positionInLocalQueue', 0) + 1} in queue {queue}, "
                    f"{item.get('positionInClusterQueue', 0) + 1} in its cluster queue")
    return f"not among the pending workloads of queue {queue}"


@dataclass(frozen=True)
class PodState:
    rank: str  # the node rank (the pod's completion index)
    name: str
    phase: str
    node: str
    restarts: int


@dataclass(frozen=True)
class JobStatus:
    """A job as `gpu-train status` shows it; `notes` are its lines about Kueue (and a RayJob's about KubeRay), in
    order."""

    name: str
    namespace: str
    state: str
    queue: str
    notes: list[str] = field(default_factory=list)
    pods: list[PodState] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's gauges, when it serves them
    progress: str = ""  # from the metrics, or why there is none yet ("" before any pod runs)
    kind: str = "job"  # job (a JobSet) or prepare (a data preparation's RayJob)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


def kueue_notes(session: Session, ns: str, queue: str, now_state: str, workload: Mapping[str, Any] | None,
                where: str = "pool") -> list[str]:
    """What Kueue says of a job: why it waits and where, or the cluster queue and flavors (`where`: what a flavor
    is to this kind of job) that admitted it; and an eviction."""
    if workload is None:
        return ["Kueue has not taken the job in yet (no Workload owned by it)"]
    notes = []
    admission = (workload.get("status") or {}).get("admission") or {}
    if now_state == "Queued":
        notes.append(queue_position(session, ns, queue, workload["metadata"]["name"]))
        reserved = _condition(workload, "QuotaReserved")
        if reserved and reserved.get("message"):
            notes.append(f"Kueue: {reserved['message']}")
    elif admission:
        flavors = sorted({f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})
        notes.append(f"admitted by cluster queue {admission.get('clusterQueue')} on {where} {', '.join(flavors)}")
    evicted = _condition(workload, "Evicted")
    if evicted and evicted.get("status") == "True":
        notes.append(f"evicted: {evicted.get('reason')}: {evicted.get('message', '')}")
    return notes


def _rank0_progress(session: Session, ns: str, team: str, pod: Any, jobset: Mapping[str, Any]) -> tuple[dict, str]:
    """Rank 0's gauges through the pod proxy, and the progress line (or why there is none)."""
    try:
        # The raw body: the client's "str" deserialisation of this endpoint returns the bytes' repr.
        resp = call(session, session.core.connect_get_namespaced_pod_proxy_with_path,
                    f"{pod.metadata.name}:{naming.METRICS_PORT}", ns, "metrics", _preload_content=False,
                    doing="read rank 0's metrics through the pod proxy", namespace=ns, team=team)
    except ClientError as exc:
        if "(403 Forbidden" in str(exc):
            raise
        # A trainer still starting (image pull, rendezvous) serves no metrics yet: say so, keep the rest.
        return {}, f"no progress yet: {exc}"
    try:
        metrics = read_metrics(resp.data.decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise ClientError(f"rank 0's metrics endpoint ({pod.metadata.name}:{naming.METRICS_PORT}) did not answer "
                          f"in the Prometheus text format: {exc}", code=1) from None
    return metrics, progress(metrics, setting(jobset, "train.steps"), setting(jobset, "train.global_batch_tokens"))


def status(session: Session, team: str, name: str) -> JobStatus:
    """A job's state, what Kueue says of it, its pods by rank, and rank 0's progress while it runs."""
    ns = team_namespace(team)
    js = get_jobset(session, ns, name, team)
    workload = find_workload(session, ns, team, js)
    now_state = state(js, workload)
    queue = (js["metadata"].get("labels") or {}).get("kueue.x-k8s.io/queue-name", "?")
    notes = kueue_notes(session, ns, queue, now_state, workload)
    found = call(session, session.core.list_namespaced_pod, ns, label_selector=f"{naming.JOBSET_NAME_LABEL}={name}",
                 doing="list pods", namespace=ns, team=team).items
    pods, rank0 = [], None
    for pod in sorted(found, key=lambda p: (int((p.metadata.labels or {}).get(INDEX_LABEL, "0")), p.metadata.name)):
        rank = (pod.metadata.labels or {}).get(INDEX_LABEL, "?")
        pods.append(PodState(rank=rank, name=pod.metadata.name, phase=pod.status.phase, node=pod.spec.node_name or "-",
                             restarts=sum(cs.restart_count or 0 for cs in pod.status.container_statuses or [])))
        if rank == "0" and pod.status.phase == "Running":
            rank0 = pod
    metrics, line = _rank0_progress(session, ns, team, rank0, js) if rank0 is not None else ({}, "")
    return JobStatus(name=name, namespace=ns, state=now_state, queue=queue, notes=notes, pods=pods, metrics=metrics,
                     progress=line)
