"""Least-privilege Google service accounts bound to Kubernetes service accounts (Workload Identity).

Usage (inside the Pulumi program; `build_platform` does this):
    ids = Identities("identities", IdentitiesArgs(
        stack=cfg.stack, project=cfg.project, identities=identities(["research"], serving=False),
        buckets=storage.buckets), opts)
    ids.contract["trainer/research"].annotations["iam.gke.io/gcp-service-account"]

Who gets what (the bucket grants are built by the pure `bucket_grants`):
- trainer/<team> (team-<team>/trainer): read datasets; read/write objects under
  <checkpoints>/<team>/ only (an IAM condition on the object name); list the checkpoints bucket.
- data-prep/<team> (team-<team>/data-prep, `gpu-train prepare --cluster`'s Ray pods): read datasets; read/write
  objects under <datasets>/<team>/ only.
- cache (alluxio/alluxio): read datasets.
- mlflow (mlflow/mlflow): read/write the artifacts bucket.
- serving/<team> (team-<team>/model-server, with serving enabled): read objects under <artifacts>/mlflow/ only
  (the model versions MLflow keeps there); list the artifacts bucket (KServe's storage initializer lists a
  version's files before it reads them).

Listing nuance: `storage.objects.list` is checked on the bucket, not on object names, so an IAM
condition on `resource.name` cannot narrow it to a prefix. Trainers therefore also get
roles/storage.legacyBucketReader (list + bucket metadata, no object reads) on the checkpoints
bucket: they can see other teams' object names, never their contents or write to them. Model servers get the same
on the artifacts bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming
from infra.gcp.cluster import workload_pool
from infra.platform import WorkloadIdentity

OBJECT_VIEWER = "roles/storage.objectViewer"
OBJECT_USER = "roles/storage.objectUser"
BUCKET_LISTER = "roles/storage.legacyBucketReader"
WI_USER = "roles/iam.workloadIdentityUser"
GSA_ANNOTATION = "iam.gke.io/gcp-service-account"


@dataclass(frozen=True, kw_only=True)
class BucketGrant:
    bucket: str  # purpose: datasets | checkpoints | artifacts
    role: str
    prefix: str = ""  # "" = whole bucket; else objects under <prefix>/ only


def identities(teams: Sequence[str], serving: bool) -> dict[str, tuple[str, str]]:
    """Identity key -> (namespace, Kubernetes service account), for these team names (and their model
    servers when serving is on)."""
    ids = {"cache": (naming.CACHE_NAMESPACE, naming.CACHE_SERVICE_ACCOUNT),
           "mlflow": (naming.MLFLOW_NAMESPACE, naming.MLFLOW_SERVICE_ACCOUNT)}
    for team in teams:
        ids[f"trainer/{team}"] = (naming.team_namespace(team), naming.TRAINER_SERVICE_ACCOUNT)
        # The team's in-cluster sweep controllers (gpu-train sweep submit).
        ids[f"sweeps/{team}"] = (naming.team_namespace(team), naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT)
        # The team's Ray pods preparing data (gpu-train prepare --cluster).
        ids[f"data-prep/{team}"] = (naming.team_namespace(team), naming.DATA_PREP_SERVICE_ACCOUNT)
    if serving:
        for team in teams:
            ids[f"serving/{team}"] = (naming.team_namespace(team), naming.MODEL_SERVER_SERVICE_ACCOUNT)
    return ids


def bucket_grants(key: str) -> list[BucketGrant]:
    """The bucket roles of one identity."""
    if key == "cache":
        return [BucketGrant(bucket="datasets", role=OBJECT_VIEWER)]
    if key == "mlflow":
        return [BucketGrant(bucket="artifacts", role=OBJECT_USER)]
    if key.startswith("trainer/"):
        team = key.split("/", 1)[1]
        return [BucketGrant(bucket="datasets", role=OBJECT_VIEWER),
                BucketGrant(bucket="checkpoints", role=OBJECT_USER, prefix=team),
                BucketGrant(bucket="checkpoints", role=BUCKET_LISTER)]
    if key.startswith("sweeps/"):  # its trials' budgets and statuses and its journal: the team's prefix only
        team = key.split("/", 1)[1]
        return [BucketGrant(bucket="checkpoints", role=OBJECT_USER, prefix=team),
                BucketGrant(bucket="checkpoints", role=BUCKET_LISTER)]
    if key.startswith("data-prep/"):  # the inputs and datasets to read; its datasets under the team's prefix
        team = key.split("/", 1)[1]
        return [BucketGrant(bucket="datasets", role=OBJECT_VIEWER),
                BucketGrant(bucket="datasets", role=OBJECT_USER, prefix=team)]
    if key.startswith("serving/"):
        return [BucketGrant(bucket="artifacts", role=OBJECT_VIEWER, prefix=naming.MLFLOW_ARTIFACTS_PREFIX),
                BucketGrant(bucket="artifacts", role=BUCKET_LISTER)]
    raise KeyError(f"no bucket grants defined for identity {key!r}")


def prefix_condition(bucket: str, prefix: str) -> dict[str, str]:
    """IAM condition limiting an object role to <bucket>/<prefix>/..."""
    return {"title": f"only-{prefix}-prefix",
            "description": f"objects under gs://{bucket}/{prefix}/ only",
            "expression": f'resource.name.startsWith("projects/_/buckets/{bucket}/objects/{prefix}/")'}


def wi_member(project: str, namespace: str, ksa: str) -> str:
    return f"serviceAccount:{workload_pool(project)}[{namespace}/{ksa}]"


def account_id(stack: str, key: str) -> str:
    """A 6-30 character service account id, unique per stack and identity."""
    return naming.resource_name(stack, key.replace("/", "-"), max_len=30)


@dataclass(frozen=True, kw_only=True)
class IdentitiesArgs:
    stack: str  # the Pulumi stack name (part of every service account id)
    project: str  # GCP project id (the accounts' project and the Workload Identity pool)
    identities: Mapping[str, tuple[str, str]]  # identity key -> (namespace, Kubernetes SA): identities()
    buckets: dict[str, gcp.storage.Bucket]  # purpose -> bucket


class Identities(pulumi.ComponentResource):
    """One Google service account per workload identity, with Workload Identity and bucket IAM."""

    def __init__(self, name: str, args: IdentitiesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:Identities", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.accounts: dict[str, gcp.serviceaccount.Account] = {}
        self.contract: dict[str, WorkloadIdentity] = {}
        for key, (namespace, ksa) in args.identities.items():
            slug = key.replace("/", "-")
            gsa = gcp.serviceaccount.Account(
                f"{name}-{slug}", account_id=account_id(args.stack, key), project=args.project,
                display_name=f"{args.stack} {key} ({namespace}/{ksa})", opts=child)
            gcp.serviceaccount.IAMMember(
                f"{name}-{slug}-wi", service_account_id=gsa.name, role=WI_USER,
                member=wi_member(args.project, namespace, ksa), opts=child)
            member = gsa.email.apply(lambda e: f"serviceAccount:{e}")
            for grant in bucket_grants(key):
                bucket = args.buckets[grant.bucket]
                role_slug = grant.role.rsplit(".", 1)[-1].lower()
                condition = None
                if grant.prefix:
                    cond = bucket.name.apply(lambda b, p=grant.prefix: prefix_condition(b, p))
                    condition = gcp.storage.BucketIAMMemberConditionArgs(
                        title=cond["title"], description=cond["description"], expression=cond["expression"])
                gcp.storage.BucketIAMMember(
                    f"{name}-{slug}-{grant.bucket}-{role_slug}", bucket=bucket.name, role=grant.role,
                    member=member, condition=condition, opts=child)
            self.accounts[key] = gsa
            self.contract[key] = WorkloadIdentity(namespaces=[namespace], name=ksa,
                                                  annotations={GSA_ANNOTATION: gsa.email})
        self.register_outputs({"accounts": {k: a.email for k, a in self.accounts.items()}})
