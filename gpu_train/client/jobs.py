"""A team's jobs: read and check a spec, render and create its JobSet, pause, resume and cancel it.

Usage (gpu_train.client.Client wraps these; each takes a Session, gpu_train/client/cluster.py):
    raw = read_spec("job.yaml")                                   # the file's mapping
    prepared = prepare(contract, raw, "job.yaml", path=Path("job.yaml"))   # checked and rendered, nothing sent
    created = create(session, prepared)                           # the JobSet in the team's namespace
    set_active(session, "research", "gpt2-smoke", active=False)   # pause; True resumes
    cancel(session, "research", "gpt2-smoke")

A job spec file holds the stack's `job` settings (docs/configuration.md, "job"), read by the one job model
(gpu_train.spec.job), checked as the plan checks the stack's job (gpu_train.jobs.check: against the contract's
pools, teams and registries, then whether the team's queue could ever admit it and its pods fit their nodes) and
rendered by the one JobSet renderer (gpu_train.jobs.jobset). The one difference from the stack's job: a submitted
job waits in its team's LocalQueue, where the stack's job has a LocalQueue of its own so that `pulumi up` can
pause it.

Pause and resume go through what Kueue supports for a single workload: its Workload's `spec.active`
(false: Kueue evicts it, the pods get SIGTERM and checkpoint, the quota is released; true: it queues
again). The Workload is found by its owner (gpu_train.client.status.find_workload).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_train.client.cluster import Session, call, team_namespace
from gpu_train.client.errors import ClientError
from gpu_train.client.status import (
    JOBSET_GROUP,
    JOBSET_VERSION,
    KUEUE_GROUP,
    KUEUE_VERSION,
    find_workload,
    get_jobset,
    succeeded,
)
from gpu_train.jobs.check import check_job
from gpu_train.jobs.jobset import JobSpecError, Placement, Provenance, jobset
from gpu_train.spec.contract import ContractError, PlatformContract
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.job import JobSpec, read_job, read_job_file
from gpu_train.spec.settings_checks import BUCKET_SCHEME

JOB_NAME = re.compile(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?")
WORKLOAD_POLL_S = 0.5


def read_spec(path: str | Path) -> Mapping[str, Any]:
    """A job spec file's settings (gpu_train.spec.job.read_job_file), its problems as one ClientError."""
    try:
        return read_job_file(path)
    except SettingsError as exc:
        raise ClientError("\n".join(exc.problems)) from None


def check_spec(raw: Mapping[str, Any], contract: PlatformContract, source: str) -> JobSpec:
    """The spec as a JobSpec, with every check the stack's plan runs on its own job: the settings against the
    platform's pools, teams and image registries, then the rendered JobSet against the team's queue and the pool's
    nodes (gpu_train.jobs.check)."""
    try:
        job = read_job(dict(raw), key="job")
    except SettingsError as exc:
        raise ClientError("\n".join(f"{source}: {p}" for p in exc.problems)) from None
    problems = check_job(job, pools=contract.pools, teams=contract.teams, kueue=contract.kueue,
                         nvme_host_path=contract.nvme_host_path, scheme=BUCKET_SCHEME[contract.cloud],
                         pod_env=contract.pod_env, key="job", registries=contract.registries,
                         repositories=contract.repositories)
    if problems:
        raise ClientError("\n".join(f"{source}: {p}" for p in problems))
    return job


def render(contract: PlatformContract, job: JobSpec, provenance: Provenance | None = None) -> dict[str, Any]:
    """The JobSet of a submitted job: the one renderer fed by the contract, in the team's queue, annotated with
    where its spec came from."""
    try:
        return jobset(job, Placement.from_contract(contract, job, provenance=provenance))
    except ContractError as exc:
        raise ClientError(str(exc)) from None
    except JobSpecError as exc:
        raise ClientError(f"job {job.name!r}: {exc}") from None


@dataclass(frozen=True)
class Submitted:
    """A job checked and rendered and, once `created`, in its team's namespace."""

    job: JobSpec
    namespace: str
    queue: str  # the team's LocalQueue
    manifest: Mapping[str, Any]  # the JobSet
    estimate: str  # the carbon estimate's one line (gpu_train.carbon.estimate)
    memory: str = ""  # the memory a GPU needs under the job's layout (gpu_train.sizing.job.memory_line)
    notes: tuple[str, ...] = ()  # what the user should know before it runs (one line each)
    created: bool = False


def prepare(contract: PlatformContract, raw: Mapping[str, Any], source: str, *, image: str = "",
            path: Path | None = None) -> Submitted:
    """A spec checked and rendered for this platform, nothing sent; `image` replaces the spec's `image` (and is
    checked as the spec's would be), `path` is the spec file for the JobSet's provenance annotations."""
    if image:
        raw = {**raw, "image": image}
    job = check_spec(raw, contract, source)
    from gpu_train.carbon.estimate import job_estimate
    from gpu_train.client.gitrepo import provenance
    from gpu_train.sizing.job import memory_line
    from gpu_train.spec.job import gpus_per_node

    manifest = render(contract, job, provenance(path) if path is not None else None)
    pool = contract.pool(job.pool)
    estimate = job_estimate(job, cloud=contract.cloud, region=contract.region,
                            instance_type=pool.instance_type).line()
    memory = memory_line(job, gpus=gpus_per_node(job, pool), gpu_type=pool.gpu_type)
    notes = () if job.bundled or job.image else (
        f"{source}: command {' '.join(job.argv)!r} runs in the platform's trainer image ({contract.image}), which holds "
        "the trainer library but not your code: build your image on it and set `image` (docs/your-code.md)",)
    return Submitted(job=job, namespace=manifest["metadata"]["namespace"], queue=contract.team(job.team).local_queue,
                     manifest=manifest, estimate=estimate, memory=memory, notes=notes)


def create(session: Session, prepared: Submitted) -> Submitted:
    """Create a prepared job's JobSet in its team's namespace; a second job of the same name is refused."""
    create_jobset(session, prepared.manifest, prepared.job.team)
    return dataclasses.replace(prepared, created=True)


def create_jobset(session: Session, manifest: Mapping[str, Any], team: str) -> None:
    """Create a rendered JobSet in its namespace; an existing one of the same name is a conflict (exit 1)."""
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        call(session, session.custom.create_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets",
             dict(manifest), doing="create jobsets", namespace=ns, team=team)
    except ClientError as exc:
        if "(409)" in str(exc):
            raise ClientError(f"job {name!r} already exists in {ns}: `gpu-train status {name}` shows it, "
                              f"`gpu-train cancel {name}` removes it", code=1) from None
        raise


def set_active(session: Session, team: str, name: str, active: bool, *, wait_s: float = 0.0) -> str:
    """Pause (active False) or resume (True) a job through its Workload's spec.active; returns the queue it waits
    in. A JobSet Kueue has not made a Workload for yet is refused at once, or after wait_s seconds of looking for
    it again every WORKLOAD_POLL_S (the sweep controller waits: it pauses a trial it has just created)."""
    ns = team_namespace(team)
    js = get_jobset(session, ns, name, team)
    done = succeeded(js)
    if done is not None:
        raise ClientError(f"job {name!r} has {'completed' if done else 'failed'}; there is nothing "
                          f"to {'resume' if active else 'pause'}")
    workload = find_workload(session, ns, team, js)
    deadline = time.monotonic() + wait_s
    while workload is None and time.monotonic() < deadline:
        time.sleep(WORKLOAD_POLL_S)
        workload = find_workload(session, ns, team, js)
    if workload is None:
        raise ClientError(f"job {name!r} has no Workload yet (Kueue creates one as soon as it sees the JobSet); try "
                          "again in a few seconds", code=1)
    patch_active(session, team, workload, active)
    return (js["metadata"].get("labels") or {}).get("kueue.x-k8s.io/queue-name", "")


def patch_active(session: Session, team: str, workload: Mapping[str, Any], active: bool) -> None:
    """Set a Workload's spec.active: Kueue evicts an inactive one (its pods stop, its quota is released)."""
    ns, wl = team_namespace(team), workload["metadata"]["name"]
    call(session, session.custom.patch_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, ns, "workloads", wl,
         {"spec": {"active": active}}, doing=f"{'resume' if active else 'pause'} workload {wl}", namespace=ns,
         team=team)


def cancel(session: Session, team: str, name: str) -> None:
    """Delete a job's JobSet (Kueue's Workload goes with it); its checkpoints stay in the bucket."""
    ns = team_namespace(team)
    try:
        call(session, session.custom.delete_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", name,
             propagation_policy="Background", doing=f"delete job {name!r}", namespace=ns, team=team)
    except ClientError as exc:
        if "(404)" in str(exc):
            raise ClientError(f"no job {name!r} in {ns} (`gpu-train list` shows the team's jobs)") from None
        raise


def job_name_ok(name: str) -> str:
    """A job name, or ClientError: a lowercase DNS label of at most 32 characters."""
    if not JOB_NAME.fullmatch(name):
        raise ClientError(f"{name!r} is not a job name (a lowercase DNS label of at most 32 characters)")
    return name
