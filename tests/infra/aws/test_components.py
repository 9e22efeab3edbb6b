"""AWS components under Pulumi mocks: `pytest tests/infra/aws/test_components.py`.

Runs `build_platform` for stacks the committed ones do not cover (an on-demand p4d fabric pool, an
ODCR pool, and an elastic on-demand pool), then checks registered resources and the contract.
"""

from __future__ import annotations

import asyncio
import base64
import email

import pulumi
import yaml
from pulumi.runtime import mocks as runtime_mocks

from infra import naming
from infra.mocks import MockContext, PlanMocks
from tests.infra.aws.conftest import stack_cfg


class Recorder(runtime_mocks.MockMonitor):
    def __init__(self, mocks):
        super().__init__(mocks)
        self.seen: list[tuple[str, str, dict]] = []

    def RegisterResource(self, request):  # noqa: N802 - gRPC method name
        from pulumi.runtime import rpc
        self.seen.append((request.type, request.name, rpc.deserialize_properties(request.object)))
        return super().RegisterResource(request)

    def of(self, typ: str) -> list[tuple[str, dict]]:
        return [(n, i) for t, n, i in self.seen if t == typ]


def _run(cfg):
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region=cfg.region))
    monitor = Recorder(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack=cfg.stack, preview=False, monitor=monitor)
    from infra.aws import build_platform
    return build_platform(cfg, naming.common_tags(cfg)), monitor


POOLS = [
    {"name": "a100", "instanceType": "p4d.24xlarge", "capacity": "on-demand", "maxNodes": 2, "fabric": True,
     "zone": "us-west-2b"},
    {"name": "l40s-odcr", "instanceType": "g6e.12xlarge", "capacity": "reservation", "reservationId": "cr-0abc",
     "maxNodes": 2, "minNodes": 1},
    {"name": "l4-od", "instanceType": "g6.2xlarge", "capacity": "on-demand", "maxNodes": 3},
]


@pulumi.runtime.test
def test_build_platform_with_p4d_odcr_and_elastic_pools():
    cfg = stack_cfg(POOLS)
    platform, monitor = _run(cfg)
    return _after_registration(platform, lambda values: _check_full(platform, monitor, values))


def _after_registration(platform, check):
    """Run `check` once every resource the contract names has registered with the mock monitor."""
    waits = [platform.cluster_name, platform.kubeconfig, *[r.urn for r in platform.ready],
             platform.buckets.checkpoints, platform.registry.server, platform.registry.password,
             platform.storage_class.parameters["kmsKeyId"]]
    return pulumi.Output.all(*waits).apply(check)


def _check_full(platform, monitor, values):

    # Network: a NAT per AZ, 2 AZs, pod subnets on the secondary range, flow logs encrypted.
    assert len(monitor.of("aws:ec2/natGateway:NatGateway")) == 2
    pod_subnets = [i for _, i in monitor.of("aws:ec2/subnet:Subnet") if i["cidrBlock"].startswith("100.64.")]
    assert len(pod_subnets) == 2
    node_subnets = [i for _, i in monitor.of("aws:ec2/subnet:Subnet") if i["tags"].get("gpu-train.io/tier") == "nodes"]
    assert all(i["tags"]["karpenter.sh/discovery"] == "gpu-train-aws-test" for i in node_subnets)
    assert all(i["tags"]["kubernetes.io/role/internal-elb"] == "1" for i in node_subnets)

    lts = dict(monitor.of("aws:ec2/launchTemplate:LaunchTemplate"))
    p4d = lts["gpu-a100"]
    assert [(n["networkCardIndex"], n["deviceIndex"], n["interfaceType"]) for n in p4d["networkInterfaces"]] == \
        [(0, 0, "efa"), (1, 1, "efa-only"), (2, 1, "efa-only"), (3, 1, "efa-only")]
    assert p4d["placement"]["availabilityZone"] == "us-west-2b"
    assert p4d["imageId"].startswith("ami-")
    odcr = lts["gpu-l40s-odcr"]
    assert odcr["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"] == "cr-0abc"
    assert "instanceMarketOptions" not in odcr or not odcr["instanceMarketOptions"]
    assert len(odcr["networkInterfaces"]) == 1 and "interfaceType" not in odcr["networkInterfaces"][0]

    # User data: nodeadm NodeConfig carrying the real (mocked) endpoint and the pool labels.
    doc = email.message_from_string(base64.b64decode(p4d["userData"]).decode())
    node_config = yaml.safe_load(doc.get_payload()[0].get_payload())
    assert node_config["spec"]["cluster"]["apiServerEndpoint"].startswith("https://")
    assert any(f"{naming.POOL_LABEL}=a100" in f for f in node_config["spec"]["kubelet"]["flags"])

    groups = {n: i for n, i in monitor.of("aws:eks/nodeGroup:NodeGroup")}
    assert groups["gpu-a100"]["capacityType"] == "ON_DEMAND"
    assert groups["gpu-l40s-odcr"]["scalingConfig"] == {"desiredSize": 1, "maxSize": 2, "minSize": 1}
    assert groups["gpu-a100"]["taints"] == [{"effect": "NO_SCHEDULE", "key": "nvidia.com/gpu", "value": "present"}]

    # Only the on-demand non-fabric pool goes to Karpenter.
    node_pools = monitor.of("kubernetes:karpenter.sh/v1:NodePool")
    assert [n for n, _ in node_pools] == ["karpenter-pool-l4-od"]
    assert node_pools[0][1]["spec"]["limits"] == {"nvidia.com/gpu": "3"}

    by_name = {p.name: p for p in platform.gpu_pools}
    assert by_name["a100"].provisioner == "node-group" and by_name["l4-od"].provisioner == "karpenter"
    assert by_name["a100"].fabric.resources == {"vpc.amazonaws.com/efa": 4}
    assert by_name["a100"].fabric.nccl_env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert by_name["l40s-odcr"].fabric.kind == "none"
    assert by_name["l4-od"].node_selector == {naming.POOL_LABEL: "l4-od"}
    assert set(platform.identities) == {"trainer/vision", "cache", "mlflow"}
    assert platform.identities["trainer/vision"].namespaces == ["team-vision"]
    assert platform.nvme_host_path == "/mnt/k8s-disks/0" and platform.nvme_setup == "bootstrap"
    assert platform.api_server_cidrs == ["10.30.0.0/16"]

    checkpoints, server, password, kms = values[-4:]
    assert checkpoints == "s3://gpu-train-aws-test-checkpoints-123456789012-us-west-2"
    assert server == "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    assert password.startswith("mock-")
    assert kms.startswith("arn:aws:kms:us-west-2:")


@pulumi.runtime.test
def test_spot_only_dev_stack_has_no_managed_gpu_groups():
    cfg = stack_cfg([{"name": "l4", "instanceType": "g6.xlarge", "capacity": "spot", "maxNodes": 8}],
                    environment="dev", nat="single")
    platform, monitor = _run(cfg)
    return _after_registration(platform, lambda values: _check_dev(platform, monitor, values))


def _check_dev(platform, monitor, values):
    assert len(monitor.of("aws:ec2/natGateway:NatGateway")) == 1
    assert [n for n, _ in monitor.of("aws:eks/nodeGroup:NodeGroup")] == ["cluster-system"]
    assert not monitor.of("aws:ec2/securityGroup:SecurityGroup")[1:]  # only the endpoint group, no EFA group
    assert platform.pool("l4").provisioner == "karpenter"
    release = dict(monitor.of("kubernetes:helm.sh/v3:Release"))["karpenter"]
    assert release["chart"].startswith("oci://public.ecr.aws/karpenter/") and release["version"]
    assert yaml.safe_load(values[1])["users"][0]["user"]["exec"]["command"] == "aws"
