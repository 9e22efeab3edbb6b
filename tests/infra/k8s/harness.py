"""Test harness: a ClusterPlatform per cloud, its GPU nodes described by the cloud layer's own pure functions, and
a runner that builds the Kubernetes layer under Pulumi mocks, recording every registered resource like the plan
tool does.

Usage: `records = build_layer("aws-prod")` -> list of {"type","name","parent","inputs"};
`fake_platform(cfg)` for a platform that looks like what infra/aws or infra/gcp return.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml
from pulumi.runtime import mocks as runtime_mocks

from gpu_train.spec import naming
from gpu_train.spec.settings import StackSettings
from gpu_train.spec.settings_checks import parse
from infra.mocks import MockContext, PlanMocks
from infra.plan import _plain, kubernetes_objects, redact
from infra.platform import (
    Buckets,
    ClusterPlatform,
    EgressTarget,
    ManagedDatabase,
    Registry,
    StorageClassSpec,
    WorkloadIdentity,
)

ROOT = Path(__file__).resolve().parents[3]
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))


def load_stack(stack: str) -> StackSettings:
    """A stack's settings, checked as the program checks them before any resource (infra/clouds.py)."""
    from infra import clouds

    raw = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    cfg = parse(raw, stack)
    clouds.require_valid(cfg)
    return cfg


def cloud_parts(cfg: StackSettings) -> dict[str, Any]:
    """What the cloud layer's pure functions say about the stack's GPU nodes, as build_platform hands it over:
    the pools as jobs see them, the node add-ons, the NVMe root and the pods' environment. GKE's fabric network
    objects name their VPCs and subnets by Outputs, as the real layer's do (must run with mocks set)."""
    if cfg.cloud == "aws":
        from infra.aws import node_addons as aws
        from infra.aws.gpu_nodes import NVME_HOST_PATH

        pools = aws.gpu_pools(cfg)
        return {"gpu_pools": pools, "node_addons": aws.node_addons(pools), "nvme_host_path": NVME_HOST_PATH,
                "pod_env": {"AWS_REGION": cfg.region}}
    from infra.gcp import NVME_HOST_PATH
    from infra.gcp import node_addons as gcp
    from infra.gcp.network import fabric_sets

    sets = fabric_sets(cfg) if any(p.fabric for p in cfg.gpu_pools) else {}
    names = {n: pulumi.Output.from_input(n) for fset in sets.values() for vpc, sub in fset.nics()
             for n in (vpc.name, sub.name)}
    return {"gpu_pools": gcp.gpu_pools(cfg), "node_addons": gcp.node_addons(cfg, names),
            "nvme_host_path": NVME_HOST_PATH, "pod_env": {}}


def fake_platform(cfg: StackSettings) -> ClusterPlatform:
    """A platform like the cloud layers build (must run with mocks set): the GPU nodes from the cloud layer's own
    pure functions (cloud_parts), the cloud resources' values made up."""
    aws = cfg.cloud == "aws"
    provider = k8s.Provider("k8s", kubeconfig="apiVersion: v1\nkind: Config\n")

    def bucket(p):
        return (pulumi.Output.from_input(f"{'s3' if aws else 'gs'}://gpu-train-{cfg.stack}-{p}"))
    identities: dict[str, WorkloadIdentity] = {
        "cache": WorkloadIdentity(namespaces=[naming.CACHE_NAMESPACE], name=naming.CACHE_SERVICE_ACCOUNT,
                                  annotations={} if aws else {
                                      "iam.gke.io/gcp-service-account": "cache@acme-ml.iam.gserviceaccount.com"}),
        "mlflow": WorkloadIdentity(namespaces=[naming.MLFLOW_NAMESPACE], name=naming.MLFLOW_SERVICE_ACCOUNT,
                                   annotations={} if aws else {
                                       "iam.gke.io/gcp-service-account": "mlflow@acme-ml.iam.gserviceaccount.com"}),
    }
    for team in cfg.teams:
        ann = ({"eks.amazonaws.com/role-arn": pulumi.Output.from_input(f"arn:aws:iam::123456789012:role/{team.name}")}
               if aws else {"iam.gke.io/gcp-service-account": f"trainer-{team.name}@acme-ml.iam.gserviceaccount.com"})
        identities[f"trainer/{team.name}"] = WorkloadIdentity(
            namespaces=[naming.team_namespace(team.name)], name=naming.TRAINER_SERVICE_ACCOUNT, annotations=ann)
    return ClusterPlatform(
        cloud=cfg.cloud, region=cfg.region, cluster_name=pulumi.Output.from_input(f"gpu-train-{cfg.stack}"),
        kubernetes_version=cfg.cluster.kubernetes_version, provider=provider,
        kubeconfig=pulumi.Output.secret("kubeconfig"),
        system_node_selector={naming.SYSTEM_LABEL: "true"},
        buckets=Buckets(datasets=bucket("datasets"), checkpoints=bucket("checkpoints"), artifacts=bucket("artifacts")),
        object_store_endpoint="https://s3.us-east-1.amazonaws.com" if aws else "https://storage.googleapis.com",
        object_store_cidrs=["52.216.0.0/15", "3.5.0.0/19"] if aws else ["199.36.153.8/30"],
        api_server_cidrs=[cfg.network.vpc_cidr] if aws else [cfg.cluster.master_cidr],
        vpc_cidr=cfg.network.vpc_cidr, pod_cidr=cfg.network.pod_cidr,
        storage_class=StorageClassSpec(
            name="encrypted-rwo",
            provisioner="ebs.csi.aws.com" if aws else "pd.csi.storage.gke.io",
            parameters={"type": "gp3", "encrypted": "true", "kmsKeyId": "arn:aws:kms:us-east-1:123:key/abc"}
            if aws else {"type": "pd-balanced", "disk-encryption-kms-key": "projects/p/locations/l/keyRings/r/cryptoKeys/k"}),
        identities=identities,
        registry=Registry(repository=pulumi.Output.from_input("registry/trainer"),
                          server=pulumi.Output.from_input("registry"), username=pulumi.Output.from_input("u"),
                          password=pulumi.Output.secret("p")),
        internal_lb_annotations={"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"} if aws
        else {"networking.gke.io/load-balancer-type": "Internal"},
        workload_identity_egress=[EgressTarget("169.254.170.23/32", 80)] if aws
        else [EgressTarget("169.254.169.254/32", 80), EgressTarget("169.254.169.252/32", 988)],
        mlflow_database=ManagedDatabase(host="mlflow.db.internal", username="mlflow", password=pulumi.Output.secret(
            "p"), cidrs=[cfg.network.vpc_cidr]) if cfg.mlflow.database == "managed" else None,
        **cloud_parts(cfg),
    )


class _Recorder(runtime_mocks.MockMonitor):
    def __init__(self, mocks, records: list[dict[str, Any]]):
        super().__init__(mocks)
        self.records = records

    def RegisterResource(self, request):  # noqa: N802 - gRPC method name
        from pulumi.runtime import rpc

        response = super().RegisterResource(request)
        self.records.append({"urn": response.urn, "type": request.type, "name": request.name,
                             "parent": request.parent or None,
                             "inputs": _plain(redact(rpc.deserialize_properties(request.object)))})
        return response


def build_layer(stack: str, mutate=None, edit_platform=None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build the layer for a stack under mocks; returns (records, resolved layer fields).
    `mutate(cfg) -> cfg` changes the settings first; `edit_platform(platform) -> platform` the platform."""
    from pulumi.runtime.sync_await import _sync_await

    from infra.k8s import build_kubernetes

    cfg = load_stack(stack)
    if mutate is not None:
        cfg = mutate(cfg)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    records: list[dict[str, Any]] = []
    mocks = PlanMocks(MockContext(region=cfg.region, project=cfg.project or "acme-ml"))
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack=stack, preview=False,
                             monitor=_Recorder(mocks, records))
    fields: dict[str, Any] = {}

    def program():
        platform = fake_platform(cfg)
        if edit_platform is not None:
            platform = edit_platform(platform)
        layer = build_kubernetes(platform, cfg, image="registry/trainer@sha256:" + "0" * 64)
        fields["layer"], fields["platform"] = layer, platform

    from pulumi.runtime.stack import run_pulumi_func

    _sync_await(run_pulumi_func(program))
    layer = fields["layer"]
    fields["grafana_url"] = _sync_await(pulumi.Output.from_input(layer.grafana_url).future())
    loop.close()
    asyncio.set_event_loop(None)  # a closed loop left current breaks the next Pulumi test in this process
    return records, fields


def objects(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Kubernetes objects among the records, as the plan tool writes them."""
    return kubernetes_objects({"resources": records})


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects(records) if o["kind"] == kind]


def releases(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["inputs"]["name"]: r["inputs"] for r in records if r["type"] == "kubernetes:helm.sh/v3:Release"}


