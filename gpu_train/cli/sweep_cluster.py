"""`gpu-train sweep` on the cluster: the first trials' JobSets (--dry-run), the in-cluster controller's Deployment
(`sweep submit`), its removal (`sweep stop --cluster`) and the journal's copy in the object store (`sweep status
--cluster`). The trials and the controller's backend are gpu_train.sweeps.cluster's; the controller's Deployment is
gpu_train.jobs.sweep_platform's.

Usage:
    gpu-train sweep run SPEC --dry-run [--platform FILE | --kubeconfig ...]   # print the first trials' JobSets
    gpu-train sweep submit SPEC [--dry-run]       # the controller as a Deployment in the team's namespace
    gpu-train sweep status SPEC --cluster         # the table, from the journal's copy in the object store
    gpu-train sweep stop SPEC --cluster           # the controller removed, its running trials paused
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gpu_train.client import jobs
from gpu_train.client.cluster import Session, call
from gpu_train.client.errors import ClientError
from gpu_train.client.status import job_workload
from gpu_train.jobs.jobset import PRIORITY_LABEL
from gpu_train.jobs.sweep_platform import controller_name, sweep_deployment
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.sweep import SweepSpec
from gpu_train.sweeps.cluster import checkpoints_store, journal_mirror, trial_jobsets
from gpu_train.sweeps.journal import ACTIVE, JOURNAL, SweepState, read_journal
from gpu_train.sweeps.mirror import MirrorError


def dry_run(contract: PlatformContract, sweep: SweepSpec, source: str, out=None) -> int:
    out = out or sys.stdout
    docs = trial_jobsets(contract, sweep, source)
    out.write(yaml.safe_dump_all(docs, sort_keys=False))
    team = contract.team(sweep.template.team)
    sys.stderr.write(f"sweep {sweep.name!r}: {len(docs)} of {sweep.trial_config.num_trials} trials shown, in queue "
                     f"{team.local_queue} of {team.namespace} with priority class "
                     f"{docs[0]['metadata']['labels'][PRIORITY_LABEL]}\n")
    return 0


def controller_deployment(contract: PlatformContract, sweep: SweepSpec, source: str) -> dict[str, Any]:
    """The sweep's controller Deployment (its spec inline, the trial template included), after the trials are checked
    as `sweep run --dry-run` checks them and the platform is found to run controllers for the team."""
    trial_jobsets(contract, sweep, source)
    team = contract.team(sweep.template.team)
    identity = contract.identities.get(f"sweeps/{team.name}")
    if identity is None or identity.service_account != naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT:
        raise ClientError(f"this platform ({contract.source}) runs no sweep controllers for team {team.name!r} (no "
                          f"identity sweeps/{team.name}): `gpu-train sweep run {source}` runs the controller here")
    checkpoints_store(contract)  # an s3:// or gs:// bucket, where the controller keeps its journal
    spec_yaml = yaml.safe_dump(sweep.model_dump(by_alias=True, mode="json", exclude_unset=True), sort_keys=False)
    return sweep_deployment(team.namespace, sweep.name, image=contract.image, spec_yaml=spec_yaml,
                            tracking_uri=contract.endpoints.tracking, pod_env=contract.pod_env)


def _apply(session: Session, obj: Mapping[str, Any], team: str) -> str:
    """Create the Deployment, or replace the one of the same name: 'created' or 'replaced'."""
    from kubernetes import client as k8s

    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    apps = k8s.AppsV1Api(session.api)
    try:
        call(session, apps.create_namespaced_deployment, ns, obj, doing=f"create deployment {name}", namespace=ns,
             team=team)
        return "created"
    except ClientError as exc:
        if "(409" not in str(exc) and "AlreadyExists" not in str(exc):
            raise
    current = call(session, apps.read_namespaced_deployment, name, ns, doing=f"read deployment {name}", namespace=ns,
                   team=team)
    body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current.metadata.resource_version}}
    call(session, apps.replace_namespaced_deployment, name, ns, body, doing=f"replace deployment {name}", namespace=ns,
         team=team)
    return "replaced"


def submit(session: Session, contract: PlatformContract, sweep: SweepSpec, source: str, *, dry_run_only: bool,
           out=None) -> int:
    out = out or sys.stdout
    deployment = controller_deployment(contract, sweep, source)
    if dry_run_only:
        out.write(yaml.safe_dump(deployment, sort_keys=False))
        return 0
    team, name = sweep.template.team, deployment["metadata"]["name"]
    ns = naming.team_namespace(team)
    done = _apply(session, deployment, team)
    out.write(f"sweep {sweep.name!r}: controller deployment {ns}/{name} {done}; it runs as {ns}'s "
              f"{naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT} account (`kubectl -n {ns} logs deploy/{name} -f`); "
              f"`gpu-train sweep status {source} --cluster` shows its trials\n")
    return 0


def stop(session: Session, sweep: SweepSpec, sweep_dir: Path, contract: PlatformContract, out=None) -> int:
    """Delete the controller (it stops; nothing is lost, its journal is in the object store), then pause the trials
    its journal has running, so they checkpoint and release the team's quota; `sweep submit` continues."""
    from kubernetes import client as k8s

    out = out or sys.stdout
    team, name = sweep.template.team, controller_name(sweep.name)
    ns = naming.team_namespace(team)
    apps = k8s.AppsV1Api(session.api)
    try:
        call(session, apps.delete_namespaced_deployment, name, ns, doing=f"delete deployment {name}", namespace=ns,
             team=team)
    except ClientError as exc:
        if "(404" not in str(exc):
            raise
        raise ClientError(f"sweep {sweep.name!r} has no controller in {ns} (deployment {name})", code=1) from None
    state = pull_state(contract, sweep, sweep_dir)
    paused, unpaused = [], []
    for t in state.by_state(*ACTIVE):
        found = job_workload(session, team, t.id)
        if found is None or found[0] in ("Paused", "Completed", "Failed"):
            continue
        if found[1] is None:  # Kueue has not seen it yet: nothing holds quota, and nothing can be paused
            unpaused.append(t.id)
            continue
        jobs.patch_active(session, team, found[1], False)
        paused.append(t.id)
    out.write(f"sweep {sweep.name!r}: controller {ns}/{name} deleted; trials paused (checkpoint kept, quota released):"
              f" {', '.join(paused) or 'none'}; `gpu-train sweep submit` continues the sweep\n")
    if unpaused:
        out.write(f"not paused, since Kueue has no Workload for them yet (`gpu-train pause NAME` once it has): "
                  f"{', '.join(unpaused)}\n")
    return 0


def pull_state(contract: PlatformContract, sweep: SweepSpec, sweep_dir: Path) -> SweepState:
    """The sweep's state from the journal's copy in the object store (kept in sweep_dir)."""
    try:
        journal_mirror(checkpoints_store(contract), sweep, sweep_dir).pull()
    except MirrorError as exc:
        raise ClientError(str(exc)) from None
    if not (sweep_dir / JOURNAL).exists():
        raise ClientError(f"sweep {sweep.name!r} has no journal in the object store yet (`gpu-train sweep submit` "
                          "starts it)", code=1)
    return SweepState.replay(read_journal(sweep_dir / JOURNAL))
