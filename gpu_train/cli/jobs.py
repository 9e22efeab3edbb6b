"""A team's jobs: submit (render, check, create), list, status, pause, resume, cancel.

Usage: the `gpu-train` subcommands call `submit(...)`, `list_jobs(...)`, `status(...)`, `set_active(...)` and
`cancel(...)` with a Session (gpu_train/cli/cluster.py) and a platform contract.

A job spec file holds the stack's `job` settings (docs/configuration.md, "job"), read by the one job model
(gpu_train.spec.job), checked as the plan checks the stack's job (gpu_train.jobs.check: against the contract's
pools and teams, then whether the team's queue could ever admit it and its pods fit their nodes) and rendered by
the one JobSet renderer (gpu_train.jobs.jobset). The one difference from the stack's job: a submitted job waits
in its team's LocalQueue, where the stack's job has a LocalQueue of its own so that `pulumi up` can pause it.

Pause and resume go through what Kueue supports for a single workload: its Workload's `spec.active`
(false: Kueue evicts it, the pods get SIGTERM and checkpoint, the quota is released; true: it queues
again). The Workload is found by its owner: Kueue labels it with the JobSet's UID
(kueue.x-k8s.io/job-uid, pkg/controller/constants at v0.19.2) and owns it from the JobSet.
Queue positions come from Kueue's visibility API (visibility.kueue.x-k8s.io/v1beta2
localqueues/<queue>/pendingworkloads); step, loss and throughput from rank 0's metrics endpoint, read
through the API server's pod proxy.

One module for the single-job commands, a little over 400 lines: they share the JobSet and Workload readers
(state, workload_of), and splitting them would split those.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpu_train.cli.cluster import CliError, Session, call, team_namespace
from gpu_train.jobs.check import check_job
from gpu_train.jobs.jobset import (
    COMMIT_ANNOTATION,
    CONTAINER,
    HASH_ANNOTATION,
    JOBSET_API,
    PATH_ANNOTATION,
    JobSpecError,
    Placement,
    Provenance,
    image_digest,
    jobset,
)
from gpu_train.spec import naming
from gpu_train.spec.contract import ContractError, PlatformContract
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.job import JobSpec, gpus_per_node, memory_line, read_job
from gpu_train.spec.pod_rules import image_allowed
from gpu_train.spec.settings_checks import BUCKET_SCHEME

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
VISIBILITY = "/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{namespace}/localqueues/{name}/pendingworkloads"
# Kubernetes sets this label on every pod of an Indexed Job (KEP-3329): the pod's index, here the node rank.
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def _jobset_api() -> tuple[str, str]:
    group, version = JOBSET_API.split("/")
    return group, version


# ------------------------------------------------------------------------------------------ specs


def read_spec(path: str) -> Mapping[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise CliError(f"{path}: no such job spec file")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if isinstance(raw, Mapping) and set(raw) == {"job"}:
        raw = raw["job"]  # a spec may also wrap the settings in `job:`, as the stack file does
    if not isinstance(raw, Mapping):
        raise CliError(f"{path}: a job spec is a mapping of the job settings (name, team, pool, ...), got "
                       f"{type(raw).__name__}")
    return raw


def check_spec(raw: Mapping[str, Any], contract: PlatformContract, source: str) -> JobSpec:
    """The spec as a JobSpec, with every check the stack's plan runs on its own job: the settings against the
    platform's pools and teams, then the rendered JobSet against the team's queue and the pool's nodes
    (gpu_train.jobs.check)."""
    try:
        job = read_job(dict(raw), key="job")
    except SettingsError as exc:
        raise CliError("\n".join(f"{source}: {p}" for p in exc.problems)) from None
    problems = check_job(job, pools=contract.pools, teams=contract.teams, kueue=contract.kueue,
                         nvme_host_path=contract.nvme_host_path, scheme=BUCKET_SCHEME[contract.cloud],
                         pod_env=contract.pod_env, key="job")
    if problems:
        raise CliError("\n".join(f"{source}: {p}" for p in problems))
    return job


def render(contract: PlatformContract, job: JobSpec, image: str = "",
           provenance: Provenance | None = None) -> dict[str, Any]:
    """The JobSet of a submitted job: the one renderer fed by the contract, in the team's queue, annotated with
    where its spec came from."""
    try:
        return jobset(job, Placement.from_contract(contract, job, image=image, provenance=provenance))
    except ContractError as exc:
        raise CliError(str(exc)) from None
    except JobSpecError as exc:
        raise CliError(f"job {job.name!r}: {exc}") from None


def check_image(contract: PlatformContract, image: str) -> None:
    try:
        image_digest(image)
    except JobSpecError as exc:
        raise CliError(f"--image: {exc}") from None
    if not image_allowed(image, contract.registries, contract.repositories):
        raise CliError(f"--image {image}: team namespaces admit only images from the platform registry "
                       f"({', '.join([*contract.registries, *contract.repositories])})")


def submit(session: Session | None, contract, spec_path: str, *, dry_run: bool, image: str = "",
           out=None) -> int:
    out = out or sys.stdout
    raw = read_spec(spec_path)
    job = check_spec(raw, contract, spec_path)
    if image:
        check_image(contract, image)
    from gpu_train.cli.gitrepo import provenance
    from gpu_train.spec.carbon.estimate import job_estimate

    manifest = render(contract, job, image, provenance(Path(spec_path)))
    pool = contract.pool(job.pool)
    estimate = job_estimate(job, cloud=contract.cloud, region=contract.region,
                            instance_type=pool.instance_type).line()
    memory = memory_line(job, gpus=gpus_per_node(job, pool), gpu_type=pool.gpu_type)
    if dry_run:
        out.write(yaml.safe_dump(manifest, sort_keys=False))
        sys.stderr.write(f"{estimate}\n{memory}\n")  # stdout stays the JobSet alone, for kubectl apply -f -
        return 0
    if session is None:
        raise CliError("no cluster to submit to (pass --dry-run to only print the JobSet)")
    ns = manifest["metadata"]["namespace"]
    group, version = _jobset_api()
    try:
        call(session, session.custom.create_namespaced_custom_object, group, version, ns, "jobsets", manifest,
             doing="create jobsets", namespace=ns, team=job.team)
    except CliError as exc:
        if "(409)" in str(exc):
            raise CliError(f"job {job.name!r} already exists in {ns}: `gpu-train status {job.name}` shows it, "
                           f"`gpu-train cancel {job.name}` removes it", code=1) from None
        raise
    team = contract.team(job.team)
    out.write(f"submitted job {job.name!r} to {ns}, queue {team.local_queue} (pool {job.pool}, nodes {job.nodes})\n"
              f"  {estimate}\n"
              f"  {memory}\n"
              f"  gpu-train status {job.name}     queue position, step, loss, tokens/s, ETA\n"
              f"  gpu-train logs {job.name} -f    rank 0's log, live\n")
    return 0


# ------------------------------------------------------------------------------------------ reading state


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def _true(obj: Mapping[str, Any], kind: str) -> bool:
    c = _condition(obj, kind)
    return bool(c) and c.get("status") == "True"


def workload_of(jobset: Mapping[str, Any], workloads: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The Workload Kueue made for this JobSet: owned by it (kind, name and UID)."""
    meta = jobset.get("metadata") or {}
    for wl in workloads:
        for ref in (wl.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("kind") == "JobSet" and ref.get("name") == meta.get("name") and ref.get("uid") == meta.get("uid"):
                return wl
    return None


def state(jobset: Mapping[str, Any], workload: Mapping[str, Any] | None) -> str:
    """Completed, Failed, Paused, Running, Evicted, Queued, or Pending (Kueue has not made its Workload yet)."""
    if _true(jobset, "Completed"):
        return "Completed"
    if _true(jobset, "Failed"):
        return "Failed"
    if workload is None:
        return "Pending"
    if (workload.get("spec") or {}).get("active") is False:
        return "Paused"
    if _true(workload, "Finished"):
        return "Finished"
    if _true(workload, "Admitted"):
        return "Running"
    if _true(workload, "Evicted"):
        return "Evicted"
    return "Queued"


def _age(ts: str | None, now: dt.datetime | None = None) -> str:
    if not ts:
        return "-"
    then = dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    seconds = int(((now or dt.datetime.now(dt.UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _get_jobset(session: Session, ns: str, name: str, team: str) -> Mapping[str, Any]:
    group, version = _jobset_api()
    try:
        return call(session, session.custom.get_namespaced_custom_object, group, version, ns, "jobsets", name,
                    doing=f"read job {name!r}", namespace=ns, team=team)
    except CliError as exc:
        if "(404)" in str(exc):
            raise CliError(f"no job {name!r} in {ns} (`gpu-train list` shows the team's jobs)") from None
        raise


def _workloads(session: Session, ns: str, team: str, selector: str = "") -> list[Mapping[str, Any]]:
    return call(session, session.custom.list_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, ns, "workloads",
                label_selector=selector, doing="list workloads", namespace=ns, team=team).get("items") or []


def _find_workload(session: Session, ns: str, team: str, jobset: Mapping[str, Any]) -> Mapping[str, Any] | None:
    uid = (jobset.get("metadata") or {}).get("uid", "")
    return workload_of(jobset, _workloads(session, ns, team, f"{JOB_UID_LABEL}={uid}" if uid else ""))


def _worker_job(jobset: Mapping[str, Any]) -> Mapping[str, Any]:
    """The Job spec of a JobSet's first replicated job ({} for a JobSet without one)."""
    jobs = (jobset.get("spec") or {}).get("replicatedJobs") or [{}]
    return (jobs[0].get("template") or {}).get("spec") or {}


def list_jobs(session: Session, team: str, out=None) -> int:
    out = out or sys.stdout
    ns = team_namespace(team)
    group, version = _jobset_api()
    jobsets = call(session, session.custom.list_namespaced_custom_object, group, version, ns, "jobsets",
                   doing="list jobsets", namespace=ns, team=team).get("items") or []
    workloads = _workloads(session, ns, team)
    rows = [("NAME", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH", "HASH")]
    for js in sorted(jobsets, key=lambda j: j["metadata"]["name"]):
        spec = _worker_job(js)
        pool = ((spec.get("template") or {}).get("spec", {}).get("nodeSelector") or {}).get(naming.POOL_LABEL, "-")
        notes = (js["metadata"].get("annotations") or {})
        rows.append((js["metadata"]["name"], state(js, workload_of(js, workloads)), str(spec.get("parallelism", "-")),
                     pool, _age(js["metadata"].get("creationTimestamp")), notes.get(COMMIT_ANNOTATION, "-")[:12],
                     notes.get(PATH_ANNOTATION, "-"), notes.get(HASH_ANNOTATION, "-").removeprefix("sha256:")[:12]))
    if len(rows) == 1:
        out.write(f"no jobs in {ns}\n")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")
    return 0


def _setting(jobset: Mapping[str, Any], key: str) -> float | None:
    """A trainer override (section.key=value) from the JobSet's trainer arguments."""
    pod = (_worker_job(jobset).get("template") or {}).get("spec") or {}
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


def _queue_position(session: Session, ns: str, queue: str, workload: str) -> str:
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


def status(session: Session, team: str, name: str, out=None) -> int:
    out = out or sys.stdout
    ns = team_namespace(team)
    jobset = _get_jobset(session, ns, name, team)
    workload = _find_workload(session, ns, team, jobset)
    now_state = state(jobset, workload)
    queue = (jobset["metadata"].get("labels") or {}).get("kueue.x-k8s.io/queue-name", "?")
    out.write(f"job {name} in {ns}: {now_state}\n")
    if workload is not None:
        wl_name = workload["metadata"]["name"]
        admission = (workload.get("status") or {}).get("admission") or {}
        if now_state == "Queued":
            out.write(f"  {_queue_position(session, ns, queue, wl_name)}\n")
            reserved = _condition(workload, "QuotaReserved")
            if reserved and reserved.get("message"):
                out.write(f"  Kueue: {reserved['message']}\n")
        elif admission:
            flavors = sorted({f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})
            out.write(f"  admitted by cluster queue {admission.get('clusterQueue')} on pool {', '.join(flavors)}\n")
        evicted = _condition(workload, "Evicted")
        if evicted and evicted.get("status") == "True":
            out.write(f"  evicted: {evicted.get('reason')}: {evicted.get('message', '')}\n")
    else:
        out.write("  Kueue has not taken the job in yet (no Workload owned by it)\n")
    pods = call(session, session.core.list_namespaced_pod, ns, label_selector=f"{naming.JOBSET_NAME_LABEL}={name}",
                doing="list pods", namespace=ns, team=team).items
    rank0 = None
    for pod in sorted(pods, key=lambda p: (int((p.metadata.labels or {}).get(INDEX_LABEL, "0")), p.metadata.name)):
        rank = (pod.metadata.labels or {}).get(INDEX_LABEL, "?")
        restarts = sum(cs.restart_count or 0 for cs in pod.status.container_statuses or [])
        out.write(f"  rank {rank}  {pod.metadata.name}  {pod.status.phase}  node {pod.spec.node_name or '-'}  "
                  f"restarts {restarts}\n")
        if rank == "0" and pod.status.phase == "Running":
            rank0 = pod
    if rank0 is not None:
        # The raw body: the client's "str" deserialisation of this endpoint returns the bytes' repr.
        try:
            resp = call(session, session.core.connect_get_namespaced_pod_proxy_with_path,
                        f"{rank0.metadata.name}:{naming.METRICS_PORT}", ns, "metrics", _preload_content=False,
                        doing="read rank 0's metrics through the pod proxy", namespace=ns, team=team)
        except CliError as exc:
            if "(403 Forbidden" in str(exc):
                raise
            # A trainer still starting (image pull, rendezvous) serves no metrics yet: say so, keep the rest.
            out.write(f"  no progress yet: {exc}\n")
            return 0
        try:
            metrics = read_metrics(resp.data.decode("utf-8", errors="replace"))
        except ValueError as exc:
            raise CliError(f"rank 0's metrics endpoint ({rank0.metadata.name}:{naming.METRICS_PORT}) did not answer "
                           f"in the Prometheus text format: {exc}", code=1) from None
        out.write("  " + progress(metrics, _setting(jobset, "train.steps"),
                                  _setting(jobset, "train.global_batch_tokens")) + "\n")
    return 0


def set_active(session: Session, team: str, name: str, active: bool, out=None) -> int:
    out = out or sys.stdout
    """Pause (active false) or resume (true) a job through its Workload's spec.active."""
    ns = team_namespace(team)
    jobset = _get_jobset(session, ns, name, team)
    if _true(jobset, "Completed") or _true(jobset, "Failed"):
        raise CliError(f"job {name!r} has {'completed' if _true(jobset, 'Completed') else 'failed'}; there is nothing "
                       f"to {'resume' if active else 'pause'}")
    workload = _find_workload(session, ns, team, jobset)
    if workload is None:
        raise CliError(f"job {name!r} has no Workload yet (Kueue creates one as soon as it sees the JobSet); try "
                       "again in a few seconds", code=1)
    wl = workload["metadata"]["name"]
    call(session, session.custom.patch_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, ns, "workloads", wl,
         {"spec": {"active": active}}, doing=f"{'resume' if active else 'pause'} workload {wl}", namespace=ns, team=team)
    if active:
        out.write(f"resumed job {name!r}: it queues again in {jobset['metadata']['labels'].get('kueue.x-k8s.io/queue-name')}"
                  " and continues from its newest checkpoint\n")
    else:
        out.write(f"paused job {name!r}: Kueue evicts it, its pods checkpoint and stop, its quota is released "
                  f"(`gpu-train resume {name}` queues it again)\n")
    return 0


def cancel(session: Session, team: str, name: str, out=None) -> int:
    out = out or sys.stdout
    ns = team_namespace(team)
    group, version = _jobset_api()
    try:
        call(session, session.custom.delete_namespaced_custom_object, group, version, ns, "jobsets", name,
             propagation_policy="Background", doing=f"delete job {name!r}", namespace=ns, team=team)
    except CliError as exc:
        if "(404)" in str(exc):
            raise CliError(f"no job {name!r} in {ns} (`gpu-train list` shows the team's jobs)") from None
        raise
    out.write(f"cancelled job {name!r}: its pods stop (SIGTERM, then a final checkpoint) and Kueue releases its quota; "
              "its checkpoints stay in the bucket\n")
    return 0


def job_name_ok(name: str) -> str:
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?", name):
        raise CliError(f"{name!r} is not a job name (a lowercase DNS label of at most 32 characters)")
    return name
