"""Test harness: a hand-built ClusterPlatform per cloud and a runner that builds the Kubernetes layer
under Pulumi mocks, recording every registered resource like the plan tool does.

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

from infra import config, naming
from infra.aws.catalog import CATALOG as EC2
from infra.gcp.catalog import CATALOG as GCE
from infra.mocks import MockContext, PlanMocks
from infra.plan import _plain, kubernetes_objects, redact
from infra.platform import (
    Buckets,
    ClusterPlatform,
    EgressTarget,
    Fabric,
    GpuPool,
    Registry,
    StorageClassSpec,
    WorkloadIdentity,
)

ROOT = Path(__file__).resolve().parents[3]
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))


def load_stack(stack: str) -> config.StackSettings:
    raw = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    return config.parse(raw, stack)


def _fabric(cfg: config.StackSettings, pool: config.GpuPoolSettings) -> Fabric:
    if not pool.fabric:
        return Fabric(kind="none")
    if cfg.cloud == "aws":
        return Fabric(kind="efa", resources={"vpc.amazonaws.com/efa": EC2[pool.instance_type].network_cards},
                      nccl_env={"FI_PROVIDER": "efa"})
    kind = GCE[pool.instance_type].fabric
    networks = [{"name": f"{pool.zone}-gpu-nic-{i}", "vpc": pulumi.Output.from_input(f"fabric-vpc-{i}"),
                 "subnet": pulumi.Output.from_input(f"fabric-subnet-{i}"),
                 "deviceMode": "RDMA" if kind == "rdma" else "NetDevice"} for i in range(8)]
    return Fabric(kind=kind, networks=networks)


def fake_platform(cfg: config.StackSettings) -> ClusterPlatform:
    """A platform like the cloud layers build (must run with mocks set)."""
    aws = cfg.cloud == "aws"
    provider = k8s.Provider("k8s", kubeconfig="apiVersion: v1\nkind: Config\n")
    pools = []
    for pool in cfg.gpu_pools:
        spec = (EC2 if aws else GCE)[pool.instance_type]
        fabric = _fabric(cfg, pool)
        pools.append(GpuPool(
            name=pool.name, instance_type=pool.instance_type, capacity=pool.capacity, gpu_type=spec.gpu_type,
            gpus_per_node=spec.gpus, min_nodes=pool.min_nodes, max_nodes=pool.max_nodes, zone=pool.zone,
            node_selector={naming.POOL_LABEL: pool.name}, tolerations=[dict(naming.GPU_TAINT)],
            fabric=fabric, provisioner="karpenter" if aws else "node-pool"))
    def bucket(p):
        return (pulumi.Output.from_input(f"{'s3' if aws else 'gs'}://gpu-train-{cfg.stack}-{p}"))
    identities: dict[str, WorkloadIdentity] = {
        "cache": WorkloadIdentity(namespaces=[naming.CACHE_NAMESPACE], name=naming.CACHE_SERVICE_ACCOUNT,
                                  annotations={} if aws else {
                                      "iam.gke.io/gcp-service-account": "cache@acme-ml.iam.gserviceaccount.com"}),
        "mlflow": WorkloadIdentity(namespaces=[naming.MLFLOW_NAMESPACE], name=naming.MLFLOW_SERVICE_ACCOUNT),
    }
    for team in cfg.teams:
        ann = ({"eks.amazonaws.com/role-arn": pulumi.Output.from_input(f"arn:aws:iam::123456789012:role/{team.name}")}
               if aws else {"iam.gke.io/gcp-service-account": f"trainer-{team.name}@acme-ml.iam.gserviceaccount.com"})
        identities[f"trainer/{team.name}"] = WorkloadIdentity(
            namespaces=[naming.team_namespace(team.name)], name=naming.TRAINER_SERVICE_ACCOUNT, annotations=ann)
    return ClusterPlatform(
        cloud=cfg.cloud, region=cfg.region, cluster_name=pulumi.Output.from_input(f"gpu-train-{cfg.stack}"),
        kubernetes_version=cfg.cluster.kubernetes_version, provider=provider,
        kubeconfig=pulumi.Output.secret("kubeconfig"), gpu_pools=pools,
        system_node_selector={naming.SYSTEM_LABEL: "true"},
        nvme_host_path="/mnt/k8s-disks/0" if aws else "/mnt/stateful_partition/kube-ephemeral-ssd/nvme",
        nvme_setup="bootstrap" if aws else "daemonset",
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


def build_layer(stack: str, mutate=None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build the layer for a stack under mocks; returns (records, resolved layer fields).
    `mutate(cfg) -> cfg` changes the settings first."""
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
        layer = build_kubernetes(fake_platform(cfg), cfg)
        fields["layer"] = layer

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


