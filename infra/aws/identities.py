"""Workload identities: one IAM role per workload, bound to its Kubernetes service account by EKS Pod Identity.

Usage:
    ids = WorkloadIdentities("identities", WorkloadIdentitiesArgs(...))
    ids.identities["trainer/research"]  # infra.platform.WorkloadIdentity

With Pod Identity the binding lives in EKS (aws.eks.PodIdentityAssociation), not on the service
account, so the WorkloadIdentity annotations are empty: the Kubernetes layer creates plain service
accounts with exactly these names and namespaces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from gpu_train.spec import naming
from infra.aws import iam
from infra.platform import WorkloadIdentity


@dataclass(frozen=True, kw_only=True)
class Binding:
    key: str  # platform.identities key: "cache", "mlflow", "trainer/<team>", "sweeps/<team>", "data-prep/<team>",
    # "serving/<team>"
    namespace: str  # Kubernetes namespace of the service account
    service_account: str  # Kubernetes service account name
    policy: Callable[[Mapping[str, str]], dict]  # resolved names/ARNs -> IAM policy document


def bindings(teams: Sequence[str], cache: bool, mlflow: bool, serving: bool = False) -> list[Binding]:
    """Which service accounts get which permissions (pure). With serving, each team's model servers may read the
    model versions in MLflow's artifact store."""
    out = [Binding(key=f"trainer/{team}", namespace=naming.team_namespace(team),
                   service_account=naming.TRAINER_SERVICE_ACCOUNT,
                   policy=lambda r, team=team: iam.trainer_policy(team, datasets_bucket=r["datasets"],
                                                                  checkpoints_bucket=r["checkpoints"],
                                                                  s3_key_arn=r["s3_key"]))
           for team in teams]
    # Each team's in-cluster sweep controllers (gpu-train sweep submit): its prefix of the checkpoints bucket.
    out += [Binding(key=f"sweeps/{team}", namespace=naming.team_namespace(team),
                    service_account=naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT,
                    policy=lambda r, team=team: iam.sweep_controller_policy(team, checkpoints_bucket=r["checkpoints"],
                                                                            s3_key_arn=r["s3_key"]))
            for team in teams]
    # Each team's Ray pods preparing data (gpu-train prepare --cluster): read datasets, write <datasets>/<team>/.
    out += [Binding(key=f"data-prep/{team}", namespace=naming.team_namespace(team),
                    service_account=naming.DATA_PREP_SERVICE_ACCOUNT,
                    policy=lambda r, team=team: iam.data_prep_policy(team, datasets_bucket=r["datasets"],
                                                                     s3_key_arn=r["s3_key"]))
            for team in teams]
    if cache:
        out.append(Binding(key="cache", namespace=naming.CACHE_NAMESPACE, service_account=naming.CACHE_SERVICE_ACCOUNT,
                           policy=lambda r: iam.cache_policy(datasets_bucket=r["datasets"], s3_key_arn=r["s3_key"])))
    if serving:
        out += [Binding(key=f"serving/{team}", namespace=naming.team_namespace(team),
                        service_account=naming.MODEL_SERVER_SERVICE_ACCOUNT,
                        policy=lambda r: iam.serving_policy(artifacts_bucket=r["artifacts"],
                                                            prefix=naming.MLFLOW_ARTIFACTS_PREFIX,
                                                            s3_key_arn=r["s3_key"]))
                for team in teams]
    if mlflow:
        out.append(Binding(key="mlflow", namespace=naming.MLFLOW_NAMESPACE,
                           service_account=naming.MLFLOW_SERVICE_ACCOUNT,
                           policy=lambda r: iam.mlflow_policy(artifacts_bucket=r["artifacts"], s3_key_arn=r["s3_key"])))
    return out


def pod_identity_role(res: str, *, parent: pulumi.Resource, role_name: str, account_id: str,
                      policy: pulumi.Input[str], cluster_name: pulumi.Input[str], namespace: str, service_account: str,
                      depends_on: Sequence[pulumi.Resource],
                      tags: Mapping[str, str]) -> tuple[aws.iam.Role, aws.eks.PodIdentityAssociation]:
    """One service account's IAM role through Pod Identity: the role, its inline `policy` and the association, each
    named `res` under `parent`; the association waits for `depends_on` (the Pod Identity agent)."""
    child = pulumi.ResourceOptions(parent=parent)
    role = aws.iam.Role(res, name=role_name, assume_role_policy=json.dumps(iam.pod_identity_trust(account_id)),
                        tags=dict(tags), opts=child)
    aws.iam.RolePolicy(res, role=role.id, policy=policy, opts=child)
    association = aws.eks.PodIdentityAssociation(
        res, cluster_name=cluster_name, namespace=namespace, service_account=service_account, role_arn=role.arn,
        tags=dict(tags), opts=pulumi.ResourceOptions(parent=parent, depends_on=list(depends_on)))
    return role, association


@dataclass(frozen=True, kw_only=True)
class WorkloadIdentitiesArgs:
    cluster_name: pulumi.Input[str]  # EKS cluster for the associations
    role_prefix: str  # IAM role names are <prefix>-<key>
    account_id: str  # trust policy source account
    bindings: Sequence[Binding]  # from `bindings()`
    resources: Mapping[str, pulumi.Input[str]]  # datasets, checkpoints, artifacts (bucket names), s3_key (ARN)
    depends_on: Sequence[pulumi.Resource]  # the Pod Identity agent add-on
    tags: Mapping[str, str]  # common tags


class WorkloadIdentities(pulumi.ComponentResource):
    def __init__(self, name: str, args: WorkloadIdentitiesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:WorkloadIdentities", name, None, opts)
        keys = sorted(args.resources)
        resolved = pulumi.Output.all(*[args.resources[k] for k in keys]).apply(lambda v: dict(zip(keys, v,
                                                                                                strict=True)))
        self.identities: dict[str, WorkloadIdentity] = {}
        self.role_arns: dict[str, pulumi.Output[str]] = {}
        self.associations: list[aws.eks.PodIdentityAssociation] = []
        for b in args.bindings:
            key = b.key.replace("/", "-")
            role, association = pod_identity_role(
                f"{name}-{key}", parent=self, role_name=f"{args.role_prefix}-{key}"[:64], account_id=args.account_id,
                policy=resolved.apply(lambda r, b=b: json.dumps(b.policy(r))), cluster_name=args.cluster_name,
                namespace=b.namespace, service_account=b.service_account, depends_on=args.depends_on, tags=args.tags)
            self.associations.append(association)
            self.role_arns[b.key] = role.arn
            self.identities[b.key] = WorkloadIdentity(namespaces=[b.namespace], name=b.service_account, annotations={})
        self.register_outputs({"role_arns": self.role_arns})
