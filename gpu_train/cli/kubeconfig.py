"""`gpu-train kubeconfig`: a kubeconfig scoped to one team, from the platform contract.

Usage:
    gpu-train kubeconfig --platform platform.json --team research [--aws-profile P | --role-arn ARN] [--output F]
    export KUBECONFIG=~/.kube/gpu-train-<cluster>-research.yaml

The cluster entry and the user's exec plugin are the stack's own kubeconfig (the contract carries it:
the AWS layer's runs `aws eks get-token`, the GCP layer's runs
gke-gcloud-auth-plugin), so the file holds no credential: each request authenticates as the person running
it, and the cluster maps that identity to the team's groups (an EKS access entry, or Google Groups for
RBAC). What this adds: one context named gpu-train-<cluster>-<team> whose namespace is the team's, so
kubectl and gpu-train act on the team's namespace by default; on AWS optionally the profile (AWS_PROFILE)
or the IAM role (`aws eks get-token --role-arn`) the member signs in with.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from gpu_train.client.cluster import team_namespace
from gpu_train.client.errors import ClientError
from gpu_train.spec.contract import ContractError


def team_kubeconfig(contract, team: str, *, aws_profile: str = "", role_arn: str = "") -> dict[str, Any]:
    """The contract's kubeconfig with one context: the team's namespace, the member's AWS profile or role."""
    try:
        info = contract.team(team)
        base = copy.deepcopy(dict(contract.cluster.kubeconfig))
    except ContractError as exc:
        raise ClientError(str(exc)) from None
    clusters, users = base.get("clusters") or [], base.get("users") or []
    if len(clusters) != 1 or len(users) != 1:
        raise ClientError(f"{contract.source}: the contract's kubeconfig must name one cluster and one user")
    user = users[0]["user"]
    exec_ = user.get("exec") or {}
    if (aws_profile or role_arn) and contract.cloud != "aws":
        raise ClientError("--aws-profile and --role-arn apply to EKS; on GKE sign in with gcloud")
    if role_arn:
        exec_["args"] = [*exec_.get("args", []), "--role-arn", role_arn]
    if aws_profile:
        exec_["env"] = [*(exec_.get("env") or []), {"name": "AWS_PROFILE", "value": aws_profile}]
    name = f"gpu-train-{contract.cluster.name or clusters[0]['name']}-{team}"
    clusters[0]["name"] = users[0]["name"] = name
    base["contexts"] = [{"name": name, "context": {"cluster": name, "user": name, "namespace": info.namespace}}]
    base["current-context"] = name
    return base


def default_output(contract, team: str) -> Path:
    return Path.home() / ".kube" / f"gpu-train-{contract.cluster.name}-{team}.yaml"


def write_kubeconfig(contract, team: str, *, output: str = "", aws_profile: str = "", role_arn: str = "",
                     out=None) -> int:
    out = out or sys.stdout
    doc = team_kubeconfig(contract, team, aws_profile=aws_profile, role_arn=role_arn)
    path = Path(output).expanduser() if output else default_output(contract, team)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A kubeconfig may name an exec plugin that runs as the user: keep the file theirs alone.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(doc, sort_keys=False))
    out.write(f"wrote {path}: context {doc['current-context']} (namespace {team_namespace(team)})\n"
              f"  export KUBECONFIG={path}\n  gpu-train list\n")
    return 0
