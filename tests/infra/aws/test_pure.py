"""Pure helpers of the AWS layer, no mocks: `pytest tests/infra/aws/test_pure.py`."""

from __future__ import annotations

import ipaddress

import pytest
import yaml

from gpu_train.spec import naming
from gpu_train.spec.catalog import aws as catalog
from gpu_train.spec.settings import GpuPoolSettings
from infra.aws import (
    cluster,
    deploy_runner,
    gpu_nodes,
    karpenter,
    network,
    registry,
    service_roles,
    storage,
)

ZONES = ["us-east-1a", "us-east-1b", "us-east-1c"]


# ---- network ---------------------------------------------------------------------------------

def test_subnet_plan_is_disjoint_and_inside_the_ranges():
    plan = network.plan_subnets("10.10.0.0/16", "100.64.0.0/16", ZONES)
    assert [z.zone for z in plan] == ZONES
    vpc, pods = ipaddress.ip_network("10.10.0.0/16"), ipaddress.ip_network("100.64.0.0/16")
    nets = []
    for z in plan:
        private, public, pod = (ipaddress.ip_network(c) for c in (z.private, z.public, z.pods))
        assert private.subnet_of(vpc) and public.subnet_of(vpc) and pod.subnet_of(pods)
        # Nodes get large subnets; NAT subnets stay small.
        assert private.num_addresses >= 8192 and public.num_addresses <= 1024
        nets += [private, public, pod]
    for i, a in enumerate(nets):
        for b in nets[i + 1:]:
            assert not a.overlaps(b), (a, b)


def test_subnet_plan_single_zone_and_errors():
    (only,) = network.plan_subnets("10.0.0.0/20", "100.64.0.0/16", ["us-east-1a"])
    assert ipaddress.ip_network(only.private).prefixlen == 21
    with pytest.raises(ValueError, match="overlaps"):
        network.plan_subnets("10.0.0.0/16", "10.0.128.0/17", ZONES)
    with pytest.raises(ValueError, match="distinct"):
        network.plan_subnets("10.0.0.0/16", "100.64.0.0/16", ["a", "a"])
    with pytest.raises(ValueError, match="at least one zone"):
        network.plan_subnets("10.0.0.0/16", "100.64.0.0/16", [])


def test_nat_zones():
    assert network.nat_zones(ZONES, "per-zone") == ZONES
    assert network.nat_zones(ZONES, "single") == ["us-east-1a"]
    with pytest.raises(ValueError, match="network.nat"):
        network.nat_zones(ZONES, "none")


def test_interface_endpoints_cover_a_private_cluster():
    needed = {"ecr.api", "ecr.dkr", "sts", "ec2", "logs", "sqs", "eks", "eks-auth", "ssm", "ssmmessages",
              "ec2messages", "elasticloadbalancing", "autoscaling", "kms"}
    assert set(network.INTERFACE_ENDPOINTS) == needed


# ---- catalog and EFA layout ------------------------------------------------------------------

@pytest.mark.parametrize("itype,cards", [("p4d.24xlarge", 4), ("p4de.24xlarge", 4), ("p5.48xlarge", 32),
                                         ("p5e.48xlarge", 32), ("p5en.48xlarge", 16), ("trn1.32xlarge", 8),
                                         ("g6e.48xlarge", 4), ("g5.xlarge", 1), ("g6.xlarge", 1)])
def test_catalog_network_cards_and_one_efa_device_per_card(itype, cards):
    assert catalog.instance_spec(itype).network_cards == cards
    layout = gpu_nodes.efa_interfaces(cards)
    # ENA primary + one efa-only per card: cards + 1 interfaces, one EFA device on every card.
    assert len(layout) == cards + 1
    efa_cards = [i.network_card_index for i in layout if i.interface_type == "efa-only"]
    assert sorted(efa_cards) == list(range(cards))
    assert gpu_nodes.efa_devices(layout) == cards


def test_p5_layout_is_ena_primary_and_32_efa_only():
    layout = gpu_nodes.efa_interfaces(catalog.instance_spec("p5.48xlarge").network_cards)
    # EC2's recommended layout (efa-acc-inst-types): ENA at card 0 / device 0, efa-only at card 0 /
    # device 1, efa-only at device 0 of every other card.
    assert layout[0] == gpu_nodes.Interface(network_card_index=0, device_index=0, interface_type="interface")
    assert layout[1] == gpu_nodes.Interface(network_card_index=0, device_index=1, interface_type="efa-only")
    rest = layout[2:]
    assert len(rest) == 31
    assert [(i.network_card_index, i.device_index, i.interface_type) for i in rest] == \
        [(card, 0, "efa-only") for card in range(1, 32)]
    # Only the primary interface takes an address from the subnet.
    assert sum(i.interface_type == "interface" for i in layout) == 1


def test_efa_layout_rejects_zero_cards():
    with pytest.raises(ValueError, match="network card"):
        gpu_nodes.efa_interfaces(0)


def _pool(**kw) -> GpuPoolSettings:
    base = {"name": "p", "instance_type": "p5.48xlarge", "capacity": "spot", "max_nodes": 2}
    return GpuPoolSettings(**{**base, **kw})


def test_nccl_env_and_fabric():
    assert gpu_nodes.nccl_env("p5.48xlarge")["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert gpu_nodes.nccl_env("p4d.24xlarge")["FI_PROVIDER"] == "efa"
    assert "FI_EFA_USE_DEVICE_RDMA" not in gpu_nodes.nccl_env("g6e.48xlarge")
    fab = gpu_nodes.fabric_for(_pool(fabric=True, zone="us-east-1a"), 32)
    assert fab.kind == "efa" and fab.resources == {"vpc.amazonaws.com/efa": 32}
    assert gpu_nodes.fabric_for(_pool(instance_type="g6.xlarge"), 1).kind == "none"


def test_efa_group_rules_are_self_referencing_both_ways():
    rules = gpu_nodes.efa_security_group_rules()
    assert {r["direction"] for r in rules} == {"ingress", "egress"}
    assert all(r["self"] and r["ip_protocol"] == "-1" for r in rules)


def test_nvidia_ami_parameter_is_the_al2023_nvidia_one():
    assert gpu_nodes.nvidia_ami_parameter("1.33") == \
        "/aws/service/eks/optimized-ami/1.33/amazon-linux-2023/x86_64/nvidia/recommended/image_id"


# ---- cluster helpers -------------------------------------------------------------------------

def test_vpc_cni_pin_supports_efa_only():
    assert cluster.addon_version_ok(cluster.VPC_CNI_VERSION)
    assert not cluster.addon_version_ok("v1.18.3-eksbuild.1")
    assert cluster.addon_version_ok("v1.18.4-eksbuild.1")
    with pytest.raises(ValueError, match="not like"):
        cluster.addon_version_ok("latest")


def test_kubeconfig_uses_get_token_and_no_static_secret():
    kc = yaml.safe_load(cluster.kubeconfig("c1", "https://api", "Q0E=", "us-east-1"))
    exec_ = kc["users"][0]["user"]["exec"]
    assert exec_["command"] == "aws" and exec_["args"][:2] == ["eks", "get-token"]
    assert "--cluster-name" in exec_["args"] and "c1" in exec_["args"]
    assert "token" not in kc["users"][0]["user"]


def test_metadata_options_imdsv2_and_hop_limit():
    opts = cluster.metadata_options(1)
    assert opts.http_tokens == "required" and opts.http_put_response_hop_limit == 1
    with pytest.raises(ValueError, match="hop limit"):
        cluster.metadata_options(3)


def test_eni_config_per_zone():
    obj = cluster.eni_config("us-east-1a", "subnet-1", ["sg-1"])
    assert obj["metadata"]["name"] == "us-east-1a" and obj["spec"] == {"subnet": "subnet-1", "securityGroups": ["sg-1"]}
    assert cluster.vpc_cni_configuration()["env"]["AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG"] == "true"


# ---- storage, registry, karpenter ------------------------------------------------------------

def test_bucket_names_are_unique_and_valid():
    name = storage.bucket_name("gpu-train-aws-dev", "checkpoints", "123456789012", "us-east-1")
    assert "123456789012" in name and len(name) <= 63
    long = storage.bucket_name("x" * 80, "datasets", "123456789012", "ap-southeast-2")
    assert len(long) <= 63 and long.endswith("-datasets-123456789012-ap-southeast-2")


def test_tls_only_policy_and_lifecycle():
    stmt = storage.tls_only_policy("b")["Statement"][0]
    assert stmt["Effect"] == "Deny" and stmt["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert set(stmt["Resource"]) == {"arn:aws:s3:::b", "arn:aws:s3:::b/*"}
    ids = {r["id"] for r in storage.lifecycle_rules(True)}
    assert ids == {"abort-incomplete-multipart", "expire-noncurrent-versions"}
    assert {r["id"] for r in storage.lifecycle_rules(False)} == {"abort-incomplete-multipart"}


def test_ecr_lifecycle_expires_untagged():
    rules = registry.lifecycle_policy()["rules"]
    assert rules[0]["selection"]["tagStatus"] == "untagged"
    assert [r["rulePriority"] for r in rules] == sorted({r["rulePriority"] for r in rules})
    (cache_rule,) = registry.cache_lifecycle_policy()["rules"]
    # Only replaced (untagged) cache manifests expire; the live cache tag is kept.
    assert cache_rule["selection"]["tagStatus"] == "untagged" and cache_rule["action"] == {"type": "expire"}


def test_elastic_pool_is_one_dynamic_node_pool_scaling_from_zero():
    pool = _pool(name="l4", instance_type="g6.xlarge", max_nodes=4)
    pools = karpenter.node_pools(pool, catalog.instance_spec("g6.xlarge"), node_class="gpu-l4", zones=ZONES)
    assert list(pools) == ["l4"]
    spec = pools["l4"]
    assert "replicas" not in spec
    assert spec["limits"] == {"nvidia.com/gpu": "4"}
    assert spec["disruption"] == {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "5m"}
    tmpl = spec["template"]
    assert tmpl["metadata"]["labels"][naming.POOL_LABEL] == "l4"
    assert tmpl["spec"]["taints"] == [naming.GPU_TAINT]
    reqs = {r["key"]: r["values"] for r in tmpl["spec"]["requirements"]}
    assert reqs["karpenter.sh/capacity-type"] == ["spot"] and reqs["node.kubernetes.io/instance-type"] == ["g6.xlarge"]
    assert reqs["topology.kubernetes.io/zone"] == ZONES


def test_min_nodes_become_a_static_node_pool_next_to_a_dynamic_one():
    # A capacity block of 4 p5 with minNodes 2: 2 kept up (static), 2 more on demand (dynamic).
    pool = _pool(name="h100", capacity="capacity-block", reservation_id="cr-0123456789abcdef0", min_nodes=2,
                 max_nodes=4, fabric=True, zone="us-east-1a")
    pools = karpenter.node_pools(pool, catalog.instance_spec("p5.48xlarge"), node_class="gpu-h100", zones=ZONES)
    assert set(pools) == {"h100-static", "h100"}
    static, dynamic = pools["h100-static"], pools["h100"]
    assert static["replicas"] == 2 and static["limits"] == {"nodes": "2"}
    # 2 more nodes of 8 GPUs each; the two pools together never exceed maxNodes.
    assert dynamic["limits"] == {"nvidia.com/gpu": "16"}
    for spec in (static, dynamic):
        reqs = {r["key"]: r["values"] for r in spec["template"]["spec"]["requirements"]}
        assert reqs["karpenter.sh/capacity-type"] == ["reserved"]
        assert reqs["topology.kubernetes.io/zone"] == ["us-east-1a"]
        assert spec["template"]["metadata"]["labels"][naming.POOL_LABEL] == "h100"
    # minNodes == maxNodes: static only.
    only = karpenter.node_pools(_pool(name="x", capacity="reservation", reservation_id="cr-1", min_nodes=3, max_nodes=3),
                                catalog.instance_spec("p5.48xlarge"), node_class="gpu-x", zones=ZONES)
    assert list(only) == ["x-static"]


def test_capacity_types_map_to_karpenter_values():
    assert karpenter.CAPACITY_TYPES == {"spot": "spot", "on-demand": "on-demand", "reservation": "reserved",
                                        "capacity-block": "reserved"}
    with pytest.raises(ValueError, match="maxNodes"):
        karpenter.node_pools(_pool(min_nodes=3, max_nodes=2), catalog.instance_spec("p5.48xlarge"), node_class="c",
                             zones=ZONES)


def test_node_class_spec_is_encrypted_imdsv2_raid0_private():
    spec = karpenter.node_class_spec(cluster_name="c1", node_role_name="r", ami_id="ami-1",
                                     ebs_key_arn="arn:aws:kms:k", tags={"project": "gpu-train"})
    ebs = spec["blockDeviceMappings"][0]["ebs"]
    assert ebs["encrypted"] is True and ebs["kmsKeyID"] == "arn:aws:kms:k"
    assert spec["metadataOptions"]["httpTokens"] == "required"
    assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1
    assert spec["instanceStorePolicy"] == "RAID0" and spec["associatePublicIPAddress"] is False
    assert spec["subnetSelectorTerms"] == [{"tags": {"karpenter.sh/discovery": "c1"}}]
    assert spec["securityGroupSelectorTerms"] == [{"tags": {"karpenter.sh/discovery": "c1"}}]
    for absent in ("networkInterfaces", "placementGroupSelector", "capacityReservationSelectorTerms"):
        assert absent not in spec


def test_fabric_node_class_has_interfaces_efa_group_placement_and_reservation():
    layout = gpu_nodes.efa_interfaces(4)
    spec = karpenter.node_class_spec(cluster_name="c1", node_role_name="r", ami_id="ami-1", ebs_key_arn="k", tags={},
                                     interfaces=layout, efa_group=True, placement_group="c1-a100",
                                     reservation_id="cr-0abc")
    assert spec["networkInterfaces"][0] == {"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"}
    assert len(spec["networkInterfaces"]) == 5
    assert spec["securityGroupSelectorTerms"] == [{"tags": {"karpenter.sh/discovery": "c1"}},
                                                  {"tags": {"gpu-train.io/efa": "c1"}}]
    assert spec["placementGroupSelector"] == {"name": "c1-a100"}
    assert spec["capacityReservationSelectorTerms"] == [{"id": "cr-0abc"}]


def test_placement_groups_only_for_unreserved_fabric_pools():
    assert karpenter.wants_placement_group(_pool(fabric=True, zone="a"))
    assert karpenter.wants_placement_group(_pool(fabric=True, zone="a", capacity="on-demand"))
    assert not karpenter.wants_placement_group(_pool(fabric=True, zone="a", placement_group=False))
    assert not karpenter.wants_placement_group(_pool(fabric=True, zone="a", capacity="reservation",
                                                     reservation_id="cr-1"))
    assert not karpenter.wants_placement_group(_pool(instance_type="g6.xlarge"))


def test_helm_values_turn_static_capacity_on_only_when_asked():
    base = dict(cluster_name="c", endpoint="https://e", queue_name="q", system_selector={"s": "t"})
    on = karpenter.helm_values(**base, static_capacity=True)["settings"]
    off = karpenter.helm_values(**base, static_capacity=False)["settings"]
    assert on["featureGates"] == {"reservedCapacity": True, "staticCapacity": True}
    assert off["featureGates"]["staticCapacity"] is False
    assert on["interruptionQueue"] == "q" and on["reservedENIs"] == "1"


def test_interruption_events_and_queue_policy():
    kinds = {p["detail-type"][0] for p in karpenter.EVENT_PATTERNS.values()}
    assert kinds == {"EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation",
                     "EC2 Instance State-change Notification", "AWS Health Event",
                     "EC2 Capacity Reservation Instance Interruption Warning"}
    stmts = karpenter.queue_policy("arn:q")["Statement"]
    assert stmts[0]["Principal"]["Service"][0] == "events.amazonaws.com"
    assert stmts[1]["Effect"] == "Deny"


# ---- service-linked roles and the deploy runner -----------------------------------------------

def test_service_linked_role_arns():
    assert service_roles.role_arn("111122223333", service_roles.AUTOSCALING) == \
        "arn:aws:iam::111122223333:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"
    assert service_roles.role_arn("111122223333", service_roles.SPOT).endswith(
        "/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot")
    with pytest.raises(ValueError, match="ecs.amazonaws.com"):
        service_roles.role_arn("1", "ecs.amazonaws.com")


def test_runner_label_and_repository():
    assert deploy_runner.runner_label("gpu-train-aws-prod-deploy") == \
        "codebuild-gpu-train-aws-prod-deploy-${{ github.run_id }}-${{ github.run_attempt }}"
    assert deploy_runner.repository_url("acme/gpu-train") == "https://github.com/acme/gpu-train"
    for bad in ("acme", "https://github.com/acme/x", "a/b/c", "/x"):
        with pytest.raises(ValueError, match="deployRunner.repository"):
            deploy_runner.repository_url(bad)
