"""A sweep's trials on the cluster: JobSets from the one renderer (gpu_train.client.jobs.render), in the team's LocalQueue,
with the sweep's priority class, each checked as `gpu-train submit` checks a job.

Usage:
    gpu-train sweep run SPEC --dry-run [--platform FILE | --kubeconfig ...]   # print the first trials' JobSets
    gpu-train sweep run SPEC [--kubeconfig ...]                               # the controller here, trials there

Which trials --dry-run prints: the first trialConfig.parallelTrials the sweep's sampler asks for (a fresh study
with the sweep's seed, so the parameters are the ones a run starts with); one trial at each bound and choice of
the search space is checked as well, so a value the cluster would refuse (a batch that does not divide, a pool
the team has no quota on) is named before anything runs.

A trial's budget object lives in the checkpoints bucket beside its checkpoints
(`<bucket>/<team>/<sweep>/<trial>/budget.json`), where the trainer writes its status.json; the controller reads
and writes both through the S3 API (boto3), so the cluster controller needs an s3:// checkpoints bucket (an AWS
platform). Pausing a trial is `gpu-train pause` (its Workload's spec.active false: Kueue evicts it, its pods
checkpoint and stop, the quota is released), promoting a paused one is `gpu-train resume`, and a trial that is
stopped for good is `gpu-train cancel`: the same functions (gpu_train.client).
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import yaml

from gpu_train.cli import show
from gpu_train.client import jobs
from gpu_train.client.cluster import ClientError, Session
from gpu_train.client.jobs import check_spec, render
from gpu_train.client.status import job_state
from gpu_train.jobs.jobset import PRIORITY_LABEL
from gpu_train.spec.contract import PlatformContract
from gpu_train.sweeps.spec import SweepSpec, bound_trials, trial_job, trial_name


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


def dry_run(contract: PlatformContract, sweep: SweepSpec, source: str, out=None) -> int:
    out = out or sys.stdout
    docs = trial_jobsets(contract, sweep, source)
    out.write(yaml.safe_dump_all(docs, sort_keys=False))
    team = contract.team(sweep.template.team)
    sys.stderr.write(f"sweep {sweep.name!r}: {len(docs)} of {sweep.trial_config.num_trials} trials shown, in queue "
                     f"{team.local_queue} of {team.namespace} with priority class "
                     f"{docs[0]['metadata']['labels'][PRIORITY_LABEL]}\n")
    return 0


class ClusterBackend:
    """The controller's side of cluster trials (gpu_train.sweeps.controller.Backend; module docstring)."""

    poll_s = 10.0

    def __init__(self, session: Session, contract: PlatformContract, sweep: SweepSpec, *, source: str,
                 tracking_uri: str = "", parent_run_id: str | None = None, out=None) -> None:
        bucket = contract.bucket("checkpoints")
        if not bucket.startswith("s3://"):
            raise ClientError(f"the cluster sweep controller keeps its trials' budgets in the checkpoints bucket through "
                           f"the S3 API; this platform's is {bucket or 'not set'} (`--dry-run` still renders the "
                           "trials)")
        import boto3

        self.session, self.contract, self.sweep, self.source = session, contract, sweep, source
        self.team = sweep.template.team
        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id
        self.s3 = boto3.client("s3", endpoint_url=contract.endpoints.object_store or None,
                               region_name=contract.region or None)
        self.out = out or io.StringIO()  # the lines `gpu-train pause/resume/cancel` print, kept off the output

    def settings(self, t) -> dict[str, Any]:
        out = trial_settings(self.contract, self.sweep, t.id)
        if self.tracking_uri:
            out["tracking.uri"] = self.tracking_uri
        if self.parent_run_id:
            out["tracking.parent_run_id"] = self.parent_run_id
        return out

    def _object(self, t, name: str) -> tuple[str, str]:
        uri = trial_settings(self.contract, self.sweep, t.id)["train.budget_uri"]
        bucket, _, key = uri[len("s3://"):].partition("/")
        return bucket, key.rpartition("/")[0] + "/" + name

    def write_budget(self, t, tokens: int) -> None:
        bucket, key = self._object(t, "budget.json")
        self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps({"tokens": tokens}).encode() + b"\n",
                           ContentType="application/json")

    def read_status(self, t) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError as S3Error

        bucket, key = self._object(t, "status.json")
        try:
            return json.loads(self.s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except S3Error as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None  # not written yet
            raise
        except ValueError:
            return None  # being replaced: read again at the next pass

    def launch(self, t, job) -> None:
        """Create its JobSet, or resume it (`gpu-train resume`) if it exists paused; a running one is left alone."""
        state = job_state(self.session, self.team, t.id)
        if state is None:
            checked = check_spec(job.model_dump(by_alias=True, mode="json"), self.contract, self.source)
            jobs.create_jobset(self.session, render(self.contract, checked), self.team)
        elif state == "Paused":
            show.resumed(t.id, jobs.set_active(self.session, self.team, t.id, True), out=self.out)

    def pause(self, t) -> None:
        show.paused(t.id, jobs.set_active(self.session, self.team, t.id, False), out=self.out)

    def stop(self, t) -> None:
        if job_state(self.session, self.team, t.id) is not None:
            jobs.cancel(self.session, self.team, t.id)
            show.cancelled(t.id, out=self.out)

    def ended(self, t) -> str | None:
        """None while its JobSet is queued, running, evicted or paused (Kueue requeues an evicted trial itself)."""
        state = job_state(self.session, self.team, t.id)
        if state is None:
            return "not running"
        if state == "Failed":
            return f"its JobSet failed (`gpu-train logs {t.id}`)"
        if state == "Completed":
            return "its JobSet completed without a final status.json"
        return None

    def shutdown(self) -> None:
        """The trials keep running in the cluster; the same `gpu-train sweep run` takes them up again."""
