"""`gpu-train prepare --cluster`: create or cancel a team's data preparation RayJob (gpu_train/jobs/prepare.py).

Usage (gpu_train.client.Client wraps these):
    rayjob = build(contract, request)      # checked and built, nothing sent; ClientError naming each bad flag
    create(session, rayjob, team)          # the RayJob in the team's namespace, suspended in its queue
    cancel(session, team, name)            # delete it (Kueue's Workload and KubeRay's Ray cluster go with it)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_train.client.cluster import ClientError, Session, call, team_namespace
from gpu_train.jobs.prepare import RAY_API, PrepareRequest, check_request, ray_job
from gpu_train.spec.contract import ContractError, PlatformContract

GROUP, VERSION = RAY_API.split("/")
PLURAL = "rayjobs"


def build(contract: PlatformContract, request: PrepareRequest) -> dict[str, Any]:
    problems = check_request(request, contract)
    if problems:
        raise ClientError("\n".join(problems))
    try:
        return ray_job(request, contract)
    except ContractError as exc:
        raise ClientError(str(exc)) from None


def create(session: Session, rayjob: Mapping[str, Any], team: str) -> None:
    ns, name = rayjob["metadata"]["namespace"], rayjob["metadata"]["name"]
    try:
        call(session, session.custom.create_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, dict(rayjob),
             doing="create rayjobs", namespace=ns, team=team)
    except ClientError as exc:
        if "(409)" in str(exc):
            raise ClientError(f"data preparation {name!r} already exists in {ns}: `gpu-train prepare --cancel {name}` "
                              "removes it", code=1) from None
        raise


def cancel(session: Session, team: str, name: str) -> None:
    ns = team_namespace(team)
    try:
        call(session, session.custom.delete_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, name,
             propagation_policy="Background", doing=f"delete rayjob {name!r}", namespace=ns, team=team)
    except ClientError as exc:
        if "(404)" in str(exc):
            raise ClientError(f"no data preparation {name!r} in {ns}") from None
        raise
