"""A sweep's trials as the cluster would run them: JobSets from the one renderer (gpu_train.cli.jobs.render), in the
team's LocalQueue, with the sweep's priority class, each checked as `gpu-train submit` checks a job.

Usage:
    gpu-train sweep run SPEC --dry-run [--platform FILE | --kubeconfig ...]   # print the first trials' JobSets

Which trials: the first trialConfig.parallelTrials the sweep's sampler asks for (a fresh study with the sweep's seed,
so the parameters are the ones a run would start with), then one trial at each bound and choice of the search
space, so a value the cluster would refuse (a batch that does not divide, a pool the team has no quota on) is
named before anything runs. Only the first group is printed; the others are checked.

A trial's budget object lives in the checkpoints bucket beside its checkpoints
(`<bucket>/<team>/<sweep>/<trial>/budget.json`), where the trainer writes its status.json.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from gpu_train.cli.cluster import CliError
from gpu_train.cli.jobs import check_spec, render
from gpu_train.jobs.jobset import PRIORITY_LABEL
from gpu_train.spec.contract import PlatformContract
from gpu_train.sweeps.spec import SweepSpec, bound_trials, trial_job, trial_name


def trial_settings(contract: PlatformContract, sweep: SweepSpec, trial: str) -> dict[str, Any]:
    """What ties a cluster trial to its sweep: its budget object and the sweep's MLflow experiment."""
    bucket = contract.bucket("checkpoints").rstrip("/")
    if not bucket:
        raise CliError(f"the platform contract ({contract.source}) names no checkpoints bucket: a sweep trial keeps "
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
        except CliError as exc:
            raise CliError(str(exc).replace(": job.", ": trialTemplate.")) from None
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
