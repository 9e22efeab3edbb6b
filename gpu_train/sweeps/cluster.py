"""A sweep's trials on the cluster: JobSets from the one renderer (gpu_train.client.jobs.render), in the team's
LocalQueue, with the sweep's priority class, each checked as `gpu-train submit` checks a job; and the controller
that drives them, wherever it runs (`gpu-train sweep run SPEC` on a laptop, `python -m gpu_train.sweeps` in the
team namespace after `gpu-train sweep submit`).

Usage:
    trial_jobsets(contract, sweep, source)      # the first trials' JobSets; every bound trial checked as well
    controller, backend = cluster_controller(session, contract, sweep, source, sweep_dir, tracking_uri=uri)

A trial's budget object lives in the checkpoints bucket beside its checkpoints
(`<bucket>/<team>/<sweep>/<trial>/budget.json`), where the trainer writes its status.json; the sweep's journal is
copied to `<bucket>/<team>/<sweep>/controller/` after every record (gpu_train.sweeps.mirror), so the controller can
move between a laptop and the cluster, or lose its pod, and go on with the same sweep. All of it goes through the
one object-store layer (gpu_train.storage: s3://, or gs:// through GCS's XML API). Pausing a trial is what
`gpu-train pause` does (its Workload's spec.active false: Kueue evicts it, its pods checkpoint and stop, the quota
is released), promoting a paused one is `gpu-train resume`, and a trial stopped for good is `gpu-train cancel`: the
same functions (gpu_train.client.jobs).

Which trials trial_jobsets renders: the first trialConfig.parallelTrials the sweep's sampler asks for (a fresh
study with the sweep's seed, so the parameters are the ones a run starts with); one trial at each bound and choice
of the search space is checked as well, so a value the cluster would refuse (a batch that does not divide, a pool
the team has no quota on) is named before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_train.client import jobs
from gpu_train.client.cluster import Session
from gpu_train.client.errors import ClientError
from gpu_train.client.jobs import check_spec, render
from gpu_train.client.status import job_state
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.sweep import SweepSpec, bound_trials, trial_job, trial_name
from gpu_train.sweeps.controller import Controller
from gpu_train.sweeps.mirror import MirrorError, StateMirror

WORKLOAD_WAIT_S = 60.0  # Kueue makes a Workload in well under a second; a minute covers a busy control plane


def trial_settings(contract: PlatformContract, sweep: SweepSpec, trial: str) -> dict[str, Any]:
    """What ties a cluster trial to its sweep: its budget object and the sweep's MLflow experiment."""
    bucket = contract.bucket("checkpoints").rstrip("/")
    if not bucket:
        raise ClientError(f"the platform contract ({contract.source}) names no checkpoints bucket: a sweep trial keeps "
                          "its budget and status there")
    return {"train.budget_uri": f"{bucket}/{sweep.template.team}/{sweep.name}/{trial}/budget.json",
            "tracking.experiment": sweep.name}


def first_params(sweep: SweepSpec) -> list[dict[str, Any]]:
    """The parameters of the trials a run starts with (a fresh in-memory study with the sweep's seed)."""
    import optuna

    from gpu_train.sweeps.algorithms import Policy

    policy = Policy(sweep, optuna.storages.InMemoryStorage())
    count = min(sweep.trial_config.parallel_trials, sweep.trial_config.num_trials)
    return [policy.suggest(n) for n in range(count)]


def trial_jobsets(contract: PlatformContract, sweep: SweepSpec, source: str) -> list[dict[str, Any]]:
    """The first trials' JobSets; every bound trial checked as well (module docstring)."""
    first = first_params(sweep)
    out = []
    for number, params in enumerate([*first, *bound_trials(sweep)]):
        name = trial_name(sweep, number if number < len(first) else 0)
        job = trial_job(sweep, name, params, trial_settings(contract, sweep, name))
        where = ", ".join(f"{k}={v}" for k, v in params.items())
        try:
            checked = check_spec(job.model_dump(by_alias=True, mode="json"), contract, f"{source} (trial with {where})")
        except ClientError as exc:
            raise ClientError(str(exc).replace(": job.", ": trialTemplate.")) from None
        if number < len(first):
            out.append(render(contract, checked))
    return out


def checkpoints_store(contract: PlatformContract):
    """The platform's checkpoints bucket (s3:// or gs://) through the one object-store layer (gpu_train.storage),
    at the contract's object store endpoint, signed with this process's cloud credentials."""
    from gpu_train.storage import StorageError, StoreOptions, open_store

    root = contract.bucket("checkpoints").rstrip("/")
    if not root.startswith(("s3://", "gs://")):
        raise ClientError(f"the platform contract ({contract.source}) names no s3:// or gs:// checkpoints bucket "
                          f"({root or 'none'}): a sweep keeps its trials' budgets and its journal there")
    try:
        return open_store(root, endpoint_url=contract.endpoints.object_store or None,
                          options=StoreOptions(region=(contract.region or None) if root.startswith("s3://") else None,
                                               auth="sigv4"))
    except StorageError as exc:
        raise ClientError(f"checkpoints bucket {root}: {exc}") from None


class ClusterBackend:
    """The controller's side of cluster trials (gpu_train.sweeps.controller.Backend; module docstring)."""

    poll_s = 10.0

    def __init__(self, session: Session, contract: PlatformContract, sweep: SweepSpec, *, source: str,
                 tracking_uri: str = "", parent_run_id: str | None = None) -> None:
        self.session, self.contract, self.sweep, self.source = session, contract, sweep, source
        self.team = sweep.template.team
        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id
        self.store = checkpoints_store(contract)

    def settings(self, t) -> dict[str, Any]:
        out = trial_settings(self.contract, self.sweep, t.id)
        if self.tracking_uri:
            out["tracking.uri"] = self.tracking_uri
        if self.parent_run_id:
            out["tracking.parent_run_id"] = self.parent_run_id
        return out

    def _key(self, t, name: str) -> str:
        """The key beside the trial's budget object, under the bucket's root."""
        return f"{self.team}/{self.sweep.name}/{t.id}/{name}"

    def write_budget(self, t, tokens: int) -> None:
        self.store.put_bytes(self._key(t, "budget.json"), json.dumps({"tokens": tokens}).encode() + b"\n")

    def read_status(self, t) -> dict[str, Any] | None:
        from gpu_train.storage import ObjectNotFoundError

        try:
            return json.loads(self.store.get_bytes(self._key(t, "status.json")))
        except ObjectNotFoundError:
            return None  # not written yet
        except ValueError:
            return None  # being replaced: read again at the next pass

    def launch(self, t, job) -> None:
        """Create its JobSet, or resume it (`gpu-train resume`) if it exists paused; a running one is left alone."""
        state = job_state(self.session, self.team, t.id)
        if state is None:
            checked = check_spec(job.model_dump(by_alias=True, mode="json"), self.contract, self.source)
            jobs.create_jobset(self.session, render(self.contract, checked), self.team)
        elif state == "Paused":
            jobs.set_active(self.session, self.team, t.id, True)

    def pause(self, t) -> None:
        """Kueue makes a JobSet's Workload within moments of its creation; a trial launched in the pass before
        may still be without one, so this waits up to WORKLOAD_WAIT_S for it rather than fail the sweep."""
        jobs.set_active(self.session, self.team, t.id, False, wait_s=WORKLOAD_WAIT_S)

    def stop(self, t) -> None:
        if job_state(self.session, self.team, t.id) is not None:
            jobs.cancel(self.session, self.team, t.id)

    def ended(self, t) -> str | None:
        """None while its JobSet is queued, running or evicted (Kueue requeues an evicted trial itself). The
        controller asks this of the trials it has running only: one it finds paused was paused from outside
        (`gpu-train sweep stop --cluster` pauses them all, or a member's `gpu-train pause`), and is "preempted": the
        controller launches it again, which resumes it."""
        state = job_state(self.session, self.team, t.id)
        if state is None:
            return "not running"
        if state == "Paused":
            return "preempted"
        if state == "Failed":
            return f"its JobSet failed (`gpu-train logs {t.id}`)"
        if state == "Completed":
            return "its JobSet completed without a final status.json"
        return None

    def shutdown(self) -> None:
        """The trials keep running in the cluster; the same controller takes them up again."""


def journal_mirror(store: Any, sweep: SweepSpec, sweep_dir: Path) -> StateMirror:
    """The sweep's journal copy: <checkpoints bucket>/<team>/<sweep>/controller/."""
    return StateMirror(store, f"{sweep.template.team}/{sweep.name}/controller", sweep_dir)


def cluster_controller(session: Session, contract: PlatformContract, sweep: SweepSpec, source: str, sweep_dir: Path,
                       *, tracking_uri: str = "", tracker: Any = None, out: Any = None,
                       heartbeat: Path | None = None) -> tuple[Controller, ClusterBackend]:
    """The controller of a cluster sweep, its state taken from the object store's copy when that is further on
    (a controller that ran elsewhere), and copied back there after every journal record."""
    backend = ClusterBackend(session, contract, sweep, source=source, tracking_uri=tracking_uri)
    try:
        mirror = journal_mirror(backend.store, sweep, sweep_dir)
        mirror.pull()
    except MirrorError as exc:
        raise ClientError(str(exc)) from None
    controller = Controller(sweep, sweep_dir, backend, tracker=tracker, out=out, on_record=mirror.push,
                            heartbeat=heartbeat)
    mirror.push()
    backend.parent_run_id = controller.parent_run_id
    return controller, backend
