"""`gpu-train lint` and `gpu-train apply`: a folder of job specs in git, checked as `submit` checks one, and made
true on the cluster (docs/gitops.md).

Usage:
    gpu-train lint jobs/ --platform platform.json           # or one file; every problem names file and field
    gpu-train apply jobs/ --team research --prune           # create, leave, replace / report, cancel
    gpu-train apply jobs/ --dry-run                         # what it would do, with each job's carbon estimate

Each spec file goes the way `gpu-train submit` takes it (gpu_train.client.jobs.read_spec, check_spec: the one job
model and check_job), plus the file-level rules of gpu_train.jobs.gitops (jobs/<team>/<name>.yaml). The JobSet is
the one renderer's, with the spec's path, the git commit and the config hash as annotations. What apply does to a
changed, deleted or hand-edited JobSet is gpu_train.jobs.gitops.plan's rule.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpu_train.carbon.estimate import job_estimate
from gpu_train.client.cluster import Session, call, team_namespace
from gpu_train.client.errors import ClientError
from gpu_train.client.gitrepo import provenance
from gpu_train.client.jobs import check_spec, read_spec, render
from gpu_train.client.status import JOBSET_GROUP, JOBSET_VERSION, get_jobset, list_jobsets, no_job
from gpu_train.jobs import gitops
from gpu_train.jobs.jobset import COMMIT_ANNOTATION
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.job import JobSpec

DELETE_WAIT_S = 120  # a replaced JobSet's deletion, before its successor is created


def _specs(root: Path, teams: set[str] | None) -> tuple[list[tuple[Path, str, Mapping[str, Any]]], list[str]]:
    """Every spec file under root with its team folder and raw settings, and the file-level problems."""
    files, problems = gitops.spec_files(root)
    out, entries = [], []
    for path, team in files:
        if teams is not None and team not in teams:
            continue
        try:
            raw = read_spec(str(path))
        except ClientError as exc:
            problems.append(str(exc))
            continue
        problems += gitops.file_problems(str(path), team, raw)
        entries.append((str(path), team, str(raw.get("name"))))
        out.append((path, team, raw))
    problems += gitops.duplicate_problems(entries)
    if not out and not problems:
        problems.append(f"{root}: no job specs (jobs/<team>/<name>.yaml)")
    return out, problems


def _team_problems(root: Path, teams: list[str], contracts: Callable[[str], PlatformContract]) -> list[str]:
    """`--team` values that name no team: held against the platform's teams (every team's contract lists them all;
    the first one readable is asked), or against the jobs folder's team folders when no contract can be read."""
    folders = sorted({team for _, team in gitops.spec_files(root)[0]})
    known: list[str] | None = None
    for team in dict.fromkeys([*teams, *folders]):
        try:
            known = [t.name for t in contracts(team).teams]
            break
        except ClientError:  # not this team's namespace (unknown, or not readable with this kubeconfig)
            continue
    where, names = ("this platform", known) if known is not None else (f"{root}'s team folders", folders)
    return [f"--team {team!r} is not a team of {where} (teams: {', '.join(names) or 'none'})"
            for team in teams if team not in names]


def _checked(specs, contracts: Callable[[str], PlatformContract]) -> tuple[list[tuple[Path, JobSpec]], list[str]]:
    jobs, problems = [], []
    for path, team, raw in specs:
        try:
            jobs.append((path, check_spec(raw, contracts(team), str(path))))
        except ClientError as exc:
            problems += str(exc).splitlines()
    return jobs, problems


def _carbon(contract: PlatformContract, job: JobSpec) -> str:
    return job_estimate(job, cloud=contract.cloud, region=contract.region,
                        instance_type=contract.pool(job.pool).instance_type).line()


def lint(target: str, contracts: Callable[[str], PlatformContract], out=None) -> int:
    """Every problem of every spec under `target`, each naming its file and field; exit 2 when there is one."""
    out = out or sys.stdout
    specs, problems = _specs(Path(target), None)
    jobs, more = _checked(specs, contracts)
    problems += more
    if problems:
        raise ClientError("\n".join(problems))
    for path, job in jobs:
        out.write(f"ok  {path}  ({job.team}/{job.name}, pool {job.pool}, nodes {job.nodes})\n"
                  f"    {_carbon(contracts(job.team), job)}\n")
    out.write(f"{len(jobs)} job spec{'s pass' if len(jobs) != 1 else ' passes'} every check\n")
    return 0


def apply(session: Session | None, root: str, *, teams: list[str], contracts: Callable[[str], PlatformContract],
          prune: bool, dry_run: bool, replace_running: bool, commit: str = "", out=None, unread: str = "") -> int:
    """Make each team's namespace match its spec files; returns 1 when something needs a person (drift, a name
    taken by a JobSet apply did not create), else 0. `unread`: why a dry run has no cluster to compare with (said
    on one line once the specs are checked)."""
    out = out or sys.stdout
    unknown = _team_problems(Path(root), teams, contracts) if teams else []
    if unknown:
        raise ClientError("\n".join(unknown))
    specs, problems = _specs(Path(root), set(teams) if teams else None)
    jobs, more = _checked(specs, contracts)
    if problems + more:
        raise ClientError("\n".join(problems + more))
    by_team: dict[str, dict[str, Mapping[str, Any]]] = {t: {} for t in teams}
    for path, job in jobs:
        where = provenance(path, applied=True, commit=commit)
        if not where.commit:
            raise ClientError(f"{path}: no git commit for this file (not in a git checkout, or changed since the last "
                           "commit): apply deploys what git holds; commit it, or pass --commit")
        by_team.setdefault(job.team, {})[job.name] = render(contracts(job.team), job, provenance=where)
    if unread:
        print(f"gpu-train: apply --dry-run: not compared with a cluster ({unread}): every job shows as create, and "
              "nothing as changed, drifted or pruned", file=sys.stderr)
    needs_person = 0
    totals: dict[str, int] = {}
    for team, desired in sorted(by_team.items()):
        live = [] if session is None else list_jobsets(session, team_namespace(team), team)
        for action in gitops.plan(desired, live, prune=prune, replace_running=replace_running):
            totals[action.kind] = totals.get(action.kind, 0) + 1
            needs_person += action.kind in ("drift", "conflict")
            _report(out, team, action, contracts, jobs, dry_run)
            if action.writes and not dry_run:
                _execute(session, team, action)
    out.write("apply" + (" (dry run)" if dry_run else "") + ": " +
              (", ".join(f"{n} {k}" for k, n in sorted(totals.items())) or "nothing to do") + "\n")
    return 1 if needs_person else 0


def _report(out, team: str, action: gitops.Action, contracts, jobs, dry_run: bool) -> None:
    commit = gitops.annotations(action.manifest or {}).get(COMMIT_ANNOTATION, "")
    at = f" @ {commit[:12]}" if commit and action.kind in ("create", "replace") else ""
    out.write(f"{action.kind:<10} {team}/{action.name}{at}" + (f"  {action.reason}" if action.reason else "") + "\n")
    if dry_run and action.kind in ("create", "replace"):
        job = next(j for _, j in jobs if j.team == team and j.name == action.name)
        out.write(f"           {_carbon(contracts(team), job)}\n")


def _execute(session: Session, team: str, action: gitops.Action) -> None:
    ns = team_namespace(team)
    if action.kind in ("replace", "cancel"):
        call(session, session.custom.delete_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets",
             action.name, propagation_policy="Background", doing=f"delete job {action.name!r}", namespace=ns,
             team=team)
    if action.kind == "replace":
        _wait_gone(session, ns, team, action.name)
    if action.kind in ("create", "replace"):
        call(session, session.custom.create_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets",
             dict(action.manifest or {}), doing=f"create job {action.name!r}", namespace=ns, team=team)


def _wait_gone(session: Session, ns: str, team: str, name: str) -> None:
    """Until the deleted JobSet is gone (its finalizers done), so that its successor's create is not refused."""
    deadline = time.monotonic() + DELETE_WAIT_S
    while True:
        try:
            get_jobset(session, ns, name, team)
        except ClientError as exc:
            if no_job(exc, name):
                return
            raise
        if time.monotonic() > deadline:
            raise ClientError(f"job {name!r} in {ns} was deleted but is still there after {DELETE_WAIT_S} s; run apply "
                           "again once it is gone", code=1)
        time.sleep(1)  # the API server's deletion is asynchronous; poll it, a second apart
