"""AWS components under Pulumi mocks: `pytest tests/infra/aws/test_components.py`.

Runs `build_platform` for stacks the committed ones do not cover (an on-demand p4d fabric pool, an
ODCR pool with minNodes, and an elastic on-demand pool; an account that already has its service-linked
roles; a stack with the deploy runner), then checks registered resources and the contract.
"""

from __future__ import annotations

import asyncio
import json

import pulumi
import yaml
from pulumi.runtime import mocks as runtime_mocks

from gpu_train.spec import naming
from gpu_train.spec.settings import DeployRunnerSettings
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


def _run(cfg, **ctx):
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region=cfg.region, **ctx))
    monitor = Recorder(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack=cfg.stack, preview=False, monitor=monitor)
    from infra.aws import build_platform
    return build_platform(cfg, naming.common_tags(cfg.stack, cfg.environment, cfg.tags)), monitor


POOLS = [
    {"name": "a100", "instanceType": "p4d.24xlarge", "capacity": "on-demand", "maxNodes": 2, "fabric": True,
     "zone": "us-west-2b"},
    {"name": "l40s-odcr", "instanceType": "g6e.12xlarge", "capacity": "reservation", "reservationId": "cr-0123456789abcdef0",
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

    # Every GPU pool is Karpenter's; the system group is the only managed node group.
    assert [n for n, _ in monitor.of("aws:eks/nodeGroup:NodeGroup")] == ["cluster-system"]
    classes = {i["metadata"]["name"]: i["spec"] for _, i in monitor.of("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")}
    a100 = classes["gpu-a100"]
    assert [(n["networkCardIndex"], n["deviceIndex"], n["interfaceType"]) for n in a100["networkInterfaces"]] == \
        [(0, 0, "interface"), (0, 1, "efa-only"), (1, 0, "efa-only"), (2, 0, "efa-only"), (3, 0, "efa-only")]
    assert a100["placementGroupSelector"] == {"name": "gpu-train-aws-test-a100"}
    (pg,) = [i for _, i in monitor.of("aws:ec2/placementGroup:PlacementGroup")]
    assert pg["name"] == "gpu-train-aws-test-a100" and pg["strategy"] == "cluster"
    assert a100["amiSelectorTerms"][0]["id"].startswith("ami-")
    odcr = classes["gpu-l40s-odcr"]
    assert odcr["capacityReservationSelectorTerms"] == [{"id": "cr-0123456789abcdef0"}]
    assert "networkInterfaces" not in odcr and "placementGroupSelector" not in odcr

    node_pools = {i["metadata"]["name"]: i["spec"] for _, i in monitor.of("kubernetes:karpenter.sh/v1:NodePool")}
    assert set(node_pools) == {"a100", "l40s-odcr-static", "l40s-odcr", "l4-od"}
    assert node_pools["l4-od"]["limits"] == {"nvidia.com/gpu": "3"}
    assert node_pools["l40s-odcr-static"]["replicas"] == 1
    # maxNodes 2 - minNodes 1 = one more g6e.12xlarge (4 GPUs) on demand.
    assert node_pools["l40s-odcr"]["limits"] == {"nvidia.com/gpu": "4"}
    release = dict(monitor.of("kubernetes:helm.sh/v3:Release"))["karpenter"]
    assert release["values"]["settings"]["featureGates"]["staticCapacity"] is True
    # No spot pool: only Auto Scaling's service-linked role is ensured.
    assert [i["awsServiceName"] for _, i in monitor.of("aws:iam/serviceLinkedRole:ServiceLinkedRole")] == \
        ["autoscaling.amazonaws.com"]

    by_name = {p.name: p for p in platform.gpu_pools}
    assert {p.provisioner for p in platform.gpu_pools} == {"karpenter"}
    assert by_name["a100"].fabric.resources == {"vpc.amazonaws.com/efa": 4}
    assert by_name["a100"].fabric.nccl_env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert by_name["l40s-odcr"].fabric.kind == "none"
    assert by_name["l4-od"].node_selector == {naming.POOL_LABEL: "l4-od"}
    assert set(platform.identities) == {"trainer/vision", "sweeps/vision", "data-prep/vision", "cache", "mlflow"}
    assert platform.identities["trainer/vision"].namespaces == ["team-vision"]
    assert (platform.identities["sweeps/vision"].namespaces, platform.identities["sweeps/vision"].name) == \
        (["team-vision"], "sweep-controller")
    # nodeadm mounts the instance store at the NVMe root itself: no raw devices for the Kubernetes layer to RAID.
    assert platform.nvme_host_path == "/mnt/k8s-disks/0" and platform.node_addons.nvme_device_glob == ""
    # What the GPU nodes need: NVIDIA's device plugin, the EFA plugin for the a100 pool, its 4 EFA devices in the
    # pre-flight; every training container gets the region.
    addons = platform.node_addons
    assert addons.device_plugin is True and [d.chart for d in addons.device_plugins] == ["aws-efa-k8s-device-plugin"]
    assert (addons.fabric_probes["a100"].probe, addons.fabric_probes["a100"].devices) == ("efa", 4)
    assert platform.pod_env == {"AWS_REGION": "us-west-2"}
    # Each pool tells a job what its nodes leave to a training pod.
    assert all(p.allocatable is not None for p in platform.gpu_pools)
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


@pulumi.runtime.test
def test_existing_service_linked_roles_are_looked_up_not_created():
    cfg = stack_cfg([{"name": "l4", "instanceType": "g6.xlarge", "capacity": "spot", "maxNodes": 2}],
                    environment="dev", nat="single")
    platform, monitor = _run(cfg, service_linked_roles=("autoscaling.amazonaws.com", "spot.amazonaws.com"))

    def check(_):
        assert monitor.of("aws:iam/serviceLinkedRole:ServiceLinkedRole") == []
        (ebs,) = [i for n, i in monitor.of("aws:kms/key:Key") if n == "keys-ebs"]
        principals = [s["Principal"] for s in json.loads(ebs["policy"])["Statement"]
                      if s["Sid"] == "ServiceLinkedRoleUse"]
        assert principals == [{"AWS": ["arn:aws:iam::123456789012:role/aws-service-role/autoscaling.amazonaws.com/"
                                       "AWSServiceRoleForAutoScaling"]}]

    return pulumi.Output.all(*[r.urn for r in platform.ready]).apply(check)


@pulumi.runtime.test
def test_deploy_runner_sits_in_the_vpc_and_alone_reaches_the_api_server():
    base = stack_cfg([{"name": "l4", "instanceType": "g6.xlarge", "capacity": "spot", "maxNodes": 2}],
                     environment="dev", nat="single")
    runner = DeployRunnerSettings(kind="codebuild", repository="acme/gpu-train",
                                connection_arn="arn:aws:codeconnections:us-west-2:123456789012:connection/abc")
    cfg = base.model_copy(update={"deploy_runner": runner})
    platform, monitor = _run(cfg)

    def check(_):
        (project,) = [i for _, i in monitor.of("aws:codebuild/project:Project")]
        assert project["name"] == "gpu-train-aws-test-deploy"
        assert project["source"]["location"] == "https://github.com/acme/gpu-train"
        assert project["source"]["auth"] == {"type": "CODECONNECTIONS", "resource": runner.connection_arn}
        assert project["environment"]["privilegedMode"] is True
        assert len(project["vpcConfig"]["subnets"]) == 2
        (hook,) = [i for _, i in monitor.of("aws:codebuild/webhook:Webhook")]
        assert hook["filterGroups"][0]["filters"] == [{"type": "EVENT", "pattern": "WORKFLOW_JOB_QUEUED"}]
        (sg,) = [i for n, i in monitor.of("aws:ec2/securityGroup:SecurityGroup") if n == "deploy-runner"]
        assert not sg.get("ingress") and [(e["fromPort"], e["toPort"]) for e in sg["egress"]] == [(443, 443)]
        (api,) = [i for n, i in monitor.of("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
                  if n == "deploy-runner-api"]
        assert (api["fromPort"], api["toPort"], api["ipProtocol"]) == (443, 443, "tcp")
        assert api["securityGroupId"].startswith("sg-0") and api["referencedSecurityGroupId"] == "deploy-runner-id"
        (logs,) = [i for n, i in monitor.of("aws:cloudwatch/logGroup:LogGroup") if n == "deploy-runner"]
        assert logs["kmsKeyId"].startswith("arn:aws:kms:us-west-2:")

    return pulumi.Output.all(*[r.urn for r in platform.ready]).apply(check)
