"""The stack settings that only make sense on AWS, checked before the AWS layer creates anything.

Usage: `problems(settings)` -> one line per problem, each with its full key; `infra.aws.build_platform` refuses
settings with any (gpu_train.spec.settings has already checked every value's type and the cloud-neutral rules).

Held against AWS's own definitions: regions where EKS has an endpoint (botocore's endpoint data, every
partition), Availability Zone names, the Kubernetes minors EKS offers, EC2 instance type and capacity reservation
id syntax, IAM principal ARNs for EKS access entries, CloudWatch Logs' retention periods, and the deploy runner.
"""

from __future__ import annotations

import difflib
import functools
import re

from gpu_train.spec.naming import PROJECT
from gpu_train.spec.settings import StackSettings, TeamSettings
from gpu_train.spec.settings_checks import kubernetes_version_problems

K = f"{PROJECT}:"
# Kubernetes minors EKS offers for new clusters, standard and extended support (February 2026,
# https://docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html); the platform takes those from
# gpu_train.spec.settings_checks.PLATFORM_MIN_KUBERNETES on.
KUBERNETES_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
# Retention periods CloudWatch Logs accepts (PutRetentionPolicy's retentionInDays, botocore's logs model).
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                      2922, 3288, 3653)
# An IAM role or user ARN (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference-arns.html); an assumed-role
# session (arn:aws:sts::...:assumed-role/...) is temporary and cannot have an access entry.
IAM_PRINCIPAL = re.compile(r"arn:aws(-cn|-us-gov)?:iam::[0-9]{12}:(role|user)/[A-Za-z0-9+=,.@_/-]{1,512}")


@functools.cache
def regions() -> frozenset[str]:
    """Regions where EKS has an endpoint, in every partition (botocore's endpoint data)."""
    import botocore.session

    session = botocore.session.get_session()
    return frozenset(r for partition in ("aws", "aws-cn", "aws-us-gov")
                     for r in session.get_available_regions("eks", partition_name=partition))


def log_retention_days(s: StackSettings) -> int:
    """Days the team namespaces' container logs are kept in CloudWatch Logs."""
    return s.logs.retention_days if s.logs.retention_days is not None else 30


def team_access_entries(teams: tuple[TeamSettings, ...]) -> dict[str, tuple[str, ...]]:
    """IAM principal -> the Kubernetes groups of its EKS access entry: the submitters (or viewers) groups of every
    team that lists it. One principal may hold one access entry per cluster, so a member of several teams gets one
    entry with every team's groups."""
    out: dict[str, set[str]] = {}
    for team in teams:
        for member in team.members:
            groups = team.submitters if member.role == "submitter" else team.viewers
            out.setdefault(member.principal, set()).update(groups)
    return {principal: tuple(sorted(groups)) for principal, groups in sorted(out.items())}


def problems(s: StackSettings) -> list[str]:
    p = region_problems(s)
    if s.project:
        p.append(f"{K}project is a GCP setting; remove it for cloud aws")
    if s.network.nat == "single" and s.is_prod:
        p.append(f"{K}network.nat must be 'per-zone' in a prod stack (one NAT per AZ survives an AZ outage)")
    p += kubernetes_version_problems(s.cluster.kubernetes_version, KUBERNETES_VERSIONS, "EKS")
    node_type = s.cluster.system_node_type
    if node_type and not re.fullmatch(r"[a-z][a-z0-9-]*\.[0-9a-z-]+", node_type):
        p.append(f"{K}cluster.systemNodeType {node_type!r} is not an EC2 instance type name (like 'm6i.xlarge')")
    for i, pool in enumerate(s.gpu_pools):
        # EC2 capacity reservation ids (capacity blocks too) are cr- and 17 hex digits.
        if pool.reservation_id and not re.fullmatch(r"cr-[0-9a-f]{17}", pool.reservation_id):
            p.append(f"{K}gpuPools[{i}].reservationId {pool.reservation_id!r} is not an EC2 capacity reservation id "
                     "(cr- and 17 hex digits)")
    p += member_problems(s)
    days = s.logs.retention_days
    if days is not None and days not in LOG_RETENTION_DAYS:
        p.append(f"{K}logs.retentionDays {days} is not a retention CloudWatch Logs offers "
                 f"({', '.join(map(str, LOG_RETENTION_DAYS))})")
    p += deploy_runner_problems(s)
    return p


def region_problems(s: StackSettings) -> list[str]:
    p = []
    known = regions()
    if s.region not in known:
        close = difflib.get_close_matches(s.region, sorted(known), n=1)
        p.append(f"{K}region {s.region!r} is not an AWS region" + (f" (did you mean {close[0]!r}?)" if close else ""))
    else:
        for i, zone in enumerate(s.zones):
            if not re.fullmatch(re.escape(s.region) + "[a-z]", zone):
                p.append(f"{K}zones[{i}] {zone!r} is not a zone of region {s.region!r}")
    if len(set(s.zones)) < 2:
        # EKS wants the cluster's subnets in at least two Availability Zones, and so does an RDS subnet group
        # (https://docs.aws.amazon.com/eks/latest/userguide/network-reqs.html).
        p.append(f"{K}zones must list at least two zones on AWS (EKS and RDS need subnets in two Availability Zones; "
                 f"got {list(s.zones)})")
    return p


def member_problems(s: StackSettings) -> list[str]:
    p = []
    for i, team in enumerate(s.teams):
        for j, member in enumerate(team.members):
            mk = f"{K}teams[{i}].members[{j}]"
            if not IAM_PRINCIPAL.fullmatch(member.principal):
                p.append(f"{mk}.principal {member.principal!r} is not an IAM role or user ARN "
                         "(arn:aws:iam::<account>:role/<name>); an STS session ARN cannot have an access entry")
            groups = team.submitters if member.role == "submitter" else team.viewers
            if not groups:
                p.append(f"{mk}.role {member.role!r} needs {K}teams[{i}].{member.role}s to name at least one group: "
                         "the access entry gives the principal those Kubernetes groups")
    return p


def deploy_runner_problems(s: StackSettings) -> list[str]:
    k = f"{K}deployRunner"
    r = s.deploy_runner
    p = []
    if r.kind == "codebuild":
        if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", r.repository):
            p.append(f"{k}.repository must be a GitHub <owner>/<name> (got {r.repository!r})")
        if not re.fullmatch(r"arn:aws[a-z-]*:(codeconnections|codestar-connections):[a-z0-9-]+:[0-9]{12}:"
                            r"connection/[A-Za-z0-9-]+", r.connection_arn):
            p.append(f"{k}.connectionArn must be a CodeConnections connection ARN "
                     f"(arn:aws:codeconnections:<region>:<account>:connection/<id>; got {r.connection_arn!r})")
    elif r.repository or r.connection_arn:
        p.append(f"{k}.repository and connectionArn only apply with kind 'codebuild'")
    if s.deploy and r.kind != "codebuild":
        p.append(f"{k}.kind must be 'codebuild' in an AWS stack marked deploy: true: the workflows reach the private "
                 "EKS endpoint through that runner (docs/ci.md)")
    return p
