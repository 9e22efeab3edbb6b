"""The Python client: what `gpu-train` does, for a notebook, a pipeline step or a controller.

Usage:
    from gpu_train.client import Client
    client = Client(kubeconfig="~/.kube/gpu-train-research.yaml")      # team from the context, or team="research"
    job = client.submit("examples/plain-loop/job.yaml")                # a path, a mapping or a JobSpec -> Job
    job.status().state                                                 # "Queued", "Running", "Completed", ...
    for text in job.logs(follow=True): print(text, end="")
    job.pause(); job.resume(); job.cancel()
    client.submit(spec, dry_run=True).manifest                         # the JobSet, nothing sent
    client.status("gpt2-smoke"); client.list()                         # by name, any job of the team
    run_local("examples/plain-loop/job.yaml", nproc=2)                 # this machine, as `gpu-train run --local`

Every failure is a ClientError with one line per problem (the message names the setting, file or field) and a
`code`: 2 for input to fix, 1 for a cluster or cloud that refused or failed. The platform contract comes from
`platform` (a file, or a PlatformContract) or, by default, from the ConfigMap the platform publishes in the
team's namespace; the cluster is reached only through the kubeconfig (the cloud CLI's exec plugin signs in), and
only when an operation needs it: `submit(..., dry_run=True)` with a `platform` file needs no cluster at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gpu_train.client import jobs, status
from gpu_train.client.cluster import Session, connect, load_contract, resolve_team
from gpu_train.client.errors import ClientError
from gpu_train.jobs.prepare import PrepareRequest
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.job import JobSpec


class Client:
    """A team member's handle on the platform (module docstring); cheap to build, connects on first use."""

    def __init__(self, *, kubeconfig: str | None = None, context: str | None = None, team: str | None = None,
                 platform: str | Path | PlatformContract | None = None, session: Session | None = None) -> None:
        self.kubeconfig, self.context = kubeconfig, context
        self._team, self._platform, self._session = team, platform, session
        self._contracts: dict[str, PlatformContract] = {}

    @property
    def session(self) -> Session:
        """The connection through the kubeconfig, made on first use."""
        if self._session is None:
            self._session = connect(self.kubeconfig, self.context)
        return self._session

    @property
    def team(self) -> str:
        """`team`, else the team whose namespace the kubeconfig context points at."""
        if self._team:
            return self._team
        return resolve_team(None, self.session)

    def contract(self, team: str | None = None) -> PlatformContract:
        """The platform contract (`platform`, else the one published in the team's namespace), read once."""
        if isinstance(self._platform, PlatformContract):
            return self._platform
        team = team or self.team
        if team not in self._contracts:
            local = self._platform is not None
            self._contracts[team] = load_contract(None if local else self.session, team,
                                                  str(self._platform) if local else None)
        return self._contracts[team]

    # ------------------------------------------------------------------------------------------ one job
    def submit(self, spec: str | Path | Mapping[str, Any] | JobSpec, *, image: str = "",
               dry_run: bool = False) -> Job:
        """Check a job spec (a file, its mapping or a JobSpec) as the stack checks its own job, render its JobSet
        and, unless `dry_run`, create it in the team's queue. `image` replaces the spec's own."""
        raw, source, path = _spec_input(spec)
        team = str(raw.get("team") or "")
        if not team:
            raise ClientError(f"{source}: job.team is required (your team's name)")
        prepared = jobs.prepare(self.contract(team), raw, source, image=image, path=path)
        if not dry_run:
            prepared = jobs.create(self.session, prepared)
        return Job(self, prepared.job.name, team, prepared)

    def prepare_cluster(self, request: PrepareRequest, *, dry_run: bool = False) -> dict[str, Any]:
        """Check a data preparation for the team's cluster and, unless `dry_run`, create its RayJob (or, with
        request.runner "job", its Indexed Job) in the team's queue (gpu_train/jobs/prepare.py); returns it."""
        from gpu_train.client import prepare

        obj = prepare.build(self.contract(request.team), request)
        if not dry_run:
            prepare.create(self.session, obj, request.team)
        return obj

    def cancel_prepare(self, name: str, team: str | None = None) -> None:
        """Delete a data preparation's RayJob or Job: Kueue releases its quota; KubeRay removes the Ray cluster, the
        garbage collector the Job's pods."""
        from gpu_train.client import prepare

        prepare.cancel(self.session, team or self.team, jobs.job_name_ok(name))

    def job(self, name: str, team: str | None = None) -> Job:
        """A handle on a job already on the cluster."""
        return Job(self, jobs.job_name_ok(name), team or self.team)

    def list(self, team: str | None = None) -> list[status.JobSummary]:
        """The team's jobs (kind job) and data preparations (kind prepare), by name."""
        from gpu_train.client import prepare

        team = team or self.team
        rows = [*status.list_jobs(self.session, team), *prepare.list_prepares(self.session, team)]
        return sorted(rows, key=lambda r: (r.name, r.kind))

    def status(self, name: str, team: str | None = None) -> status.JobStatus:
        """A job's status; for a name that is no job of the team, its data preparation of that name."""
        team, name = team or self.team, jobs.job_name_ok(name)
        try:
            return status.status(self.session, team, name)
        except ClientError as exc:
            if not status.no_job(exc, name):
                raise
            from gpu_train.client import prepare

            found = prepare.prepare_status(self.session, team, name)
            if found is None:
                raise
            return found

    def logs(self, name: str, *, team: str | None = None, rank: int = 0, follow: bool = False, container: str = "",
             since: str | None = None, tail: int | None = None) -> Iterator[str]:
        """One rank's log text: live from its pod while the pod exists, else from the platform's log store."""
        from gpu_train.client.logs import logs

        team = team or self.team
        return logs(self.session, lambda: self.contract(team), team, jobs.job_name_ok(name), rank=rank,
                    follow=follow, container=container, since=since, tail=tail)

    def pause(self, name: str, team: str | None = None) -> str:
        """Kueue evicts the job (its pods checkpoint and stop) and releases its quota; returns its queue."""
        return jobs.set_active(self.session, team or self.team, jobs.job_name_ok(name), active=False)

    def resume(self, name: str, team: str | None = None) -> str:
        """The job queues again and continues from its newest checkpoint; returns its queue."""
        return jobs.set_active(self.session, team or self.team, jobs.job_name_ok(name), active=True)

    def cancel(self, name: str, team: str | None = None) -> None:
        """Delete the job; its checkpoints stay in the bucket."""
        jobs.cancel(self.session, team or self.team, jobs.job_name_ok(name))

    def wait(self, name: str, *, team: str | None = None, timeout_s: float = 24 * 3600, poll_s: float = 30.0,
             on_change: Callable[[status.JobStatus], None] | None = None,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
             ) -> status.JobStatus:
        """Poll the job's status every `poll_s` seconds until it completed or failed; `on_change` gets each new
        state. TimeoutError after `timeout_s`."""
        deadline, seen = clock() + timeout_s, None
        while True:
            now = self.status(name, team)
            if now.state != seen and on_change is not None:
                on_change(now)
            seen = now.state
            if now.finished:
                return now
            if clock() >= deadline:
                raise TimeoutError(f"job {name!r} is still {now.state} after {timeout_s:g}s")
            sleep(poll_s)


class Job:
    """One job of a team: what submit returned, or Client.job(name)."""

    def __init__(self, client: Client, name: str, team: str, submitted: jobs.Submitted | None = None) -> None:
        self.client, self.name, self.team, self.submitted = client, name, team, submitted

    def __repr__(self) -> str:
        return f"Job({self.name!r}, team={self.team!r})"

    @property
    def manifest(self) -> Mapping[str, Any]:
        """The JobSet as rendered at submit time (ValueError for a handle made by name)."""
        if self.submitted is None:
            raise ValueError(f"job {self.name!r} was not submitted by this client: no rendered JobSet")
        return self.submitted.manifest

    def status(self) -> status.JobStatus:
        return self.client.status(self.name, self.team)

    def logs(self, **kwargs: Any) -> Iterator[str]:
        return self.client.logs(self.name, team=self.team, **kwargs)

    def pause(self) -> str:
        return self.client.pause(self.name, self.team)

    def resume(self) -> str:
        return self.client.resume(self.name, self.team)

    def cancel(self) -> None:
        self.client.cancel(self.name, self.team)

    def wait(self, **kwargs: Any) -> status.JobStatus:
        return self.client.wait(self.name, team=self.team, **kwargs)


def _spec_input(spec: str | Path | Mapping[str, Any] | JobSpec) -> tuple[Mapping[str, Any], str, Path | None]:
    """(the spec's settings, how errors name it, its file for the provenance annotations)."""
    if isinstance(spec, JobSpec):
        return spec.model_dump(mode="json", by_alias=True, exclude_unset=True), f"job {spec.name!r}", None
    if isinstance(spec, Mapping):
        return spec, f"job {spec.get('name', '')!r}", None
    return jobs.read_spec(spec), str(spec), Path(spec)
