"""Pure helpers of the AWS layer, no mocks: `pytest tests/infra/aws/test_pure.py`."""

from __future__ import annotations

import email
import ipaddress

import pytest
import yaml

from infra import naming
from infra.aws import catalog, cluster, gpu_nodes, karpenter, network, registry, storage
from infra.config import GpuPoolConfig

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
def test_catalog_network_cards(itype, cards):
    assert catalog.instance_spec(itype).network_cards == cards
    layout = gpu_nodes.efa_interfaces(cards)
    assert len(layout) == cards
    assert {i.network_card_index for i in layout} == set(range(cards))


def test_p5_layout_is_one_efa_primary_and_31_efa_only():
    layout = gpu_nodes.efa_interfaces(catalog.instance_spec("p5.48xlarge").network_cards)
    assert layout[0] == gpu_nodes.Interface(network_card_index=0, device_index=0, interface_type="efa")
    rest = layout[1:]
    assert len(rest) == 31
    assert all(i.interface_type == "efa-only" and i.device_index == 1 for i in rest)


def test_efa_layout_rejects_zero_cards():
    with pytest.raises(ValueError, match="network card"):
        gpu_nodes.efa_interfaces(0)


def test_unknown_instance_type_names_it():
    with pytest.raises(KeyError, match="p9.huge"):
        catalog.instance_spec("p9.huge")


def _pool(**kw) -> GpuPoolConfig:
    base = {"name": "p", "instance_type": "p5.48xlarge", "capacity": "spot", "max_nodes": 2}
    return GpuPoolConfig(**{**base, **kw})


def test_provisioner_per_pool_type():
    assert gpu_nodes.provisioner_for(_pool(instance_type="g6.xlarge")) == "karpenter"
    assert gpu_nodes.provisioner_for(_pool(instance_type="g6.xlarge", capacity="on-demand")) == "karpenter"
    assert gpu_nodes.provisioner_for(_pool(capacity="reservation", reservation_id="cr-1")) == "node-group"
    assert gpu_nodes.provisioner_for(_pool(capacity="capacity-block", reservation_id="cr-1")) == "node-group"
    # EC2NodeClass cannot attach N EFA interfaces, so fabric spot pools are node groups too.
    assert gpu_nodes.provisioner_for(_pool(fabric=True, zone="us-east-1a")) == "node-group"


def test_nccl_env_and_fabric():
    assert gpu_nodes.nccl_env("p5.48xlarge")["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert gpu_nodes.nccl_env("p4d.24xlarge")["FI_PROVIDER"] == "efa"
    assert "FI_EFA_USE_DEVICE_RDMA" not in gpu_nodes.nccl_env("g6e.48xlarge")
    fab = gpu_nodes.fabric_for(_pool(fabric=True, zone="us-east-1a"), 32)
    assert fab.kind == "efa" and fab.resources == {"vpc.amazonaws.com/efa": 32}
    assert gpu_nodes.fabric_for(_pool(instance_type="g6.xlarge"), 1).kind == "none"


def test_nodeadm_user_data_is_mime_with_raid0_labels_and_taints():
    labels = naming.pool_node_labels("h100", "spot", "efa", "H100")
    text = gpu_nodes.nodeadm_user_data(cluster_name="c1", endpoint="https://x", ca_data="Q0E=",
                                       service_cidr="172.20.0.0/16", labels=labels, taints=[naming.GPU_TAINT])
    msg = email.message_from_string(text)
    assert msg.is_multipart()
    (part,) = msg.get_payload()
    assert part.get_content_type() == "application/node.eks.aws"
    cfg = yaml.safe_load(part.get_payload())
    assert cfg["kind"] == "NodeConfig"
    assert cfg["spec"]["cluster"] == {"name": "c1", "apiServerEndpoint": "https://x", "certificateAuthority": "Q0E=",
                                      "cidr": "172.20.0.0/16"}
    assert cfg["spec"]["instance"]["localStorage"]["strategy"] == "RAID0"
    flags = cfg["spec"]["kubelet"]["flags"]
    assert "--register-with-taints=nvidia.com/gpu=present:NoSchedule" in flags
    label_flag = next(f for f in flags if f.startswith("--node-labels="))
    assert f"{naming.POOL_LABEL}=h100" in label_flag.split("=", 1)[1].split(",")
    assert gpu_nodes.NVME_HOST_PATH == "/mnt/k8s-disks/0"


def test_efa_group_rules_are_self_referencing_both_ways():
    rules = gpu_nodes.efa_security_group_rules()
    assert {r["direction"] for r in rules} == {"ingress", "egress"}
    assert all(r["self"] and r["ip_protocol"] == "-1" for r in rules)


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


def test_node_pool_spec_limits_scale_to_zero_and_taints():
    pool = _pool(name="l4", instance_type="g6.xlarge", max_nodes=4)
    spec = karpenter.node_pool_spec(pool, catalog.instance_spec("g6.xlarge"), node_class="gpu-l4", zones=ZONES)
    assert spec["limits"] == {"nvidia.com/gpu": "4"}
    assert spec["disruption"]["consolidationPolicy"] == "WhenEmpty"
    tmpl = spec["template"]
    assert tmpl["metadata"]["labels"][naming.POOL_LABEL] == "l4"
    assert tmpl["spec"]["taints"] == [naming.GPU_TAINT]
    reqs = {r["key"]: r["values"] for r in tmpl["spec"]["requirements"]}
    assert reqs["karpenter.sh/capacity-type"] == ["spot"] and reqs["node.kubernetes.io/instance-type"] == ["g6.xlarge"]
    with pytest.raises(ValueError, match="managed node group"):
        karpenter.node_pool_spec(_pool(capacity="reservation", reservation_id="cr-1"),
                                 catalog.instance_spec("p5.48xlarge"), node_class="x", zones=ZONES)


def test_node_class_spec_is_encrypted_imdsv2_raid0_private():
    spec = karpenter.node_class_spec(cluster_name="c1", node_role_name="r", ami_id="ami-1",
                                     ebs_key_arn="arn:aws:kms:k", tags={"project": "gpu-train"})
    ebs = spec["blockDeviceMappings"][0]["ebs"]
    assert ebs["encrypted"] is True and ebs["kmsKeyID"] == "arn:aws:kms:k"
    assert spec["metadataOptions"]["httpTokens"] == "required"
    assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1
    assert spec["instanceStorePolicy"] == "RAID0" and spec["associatePublicIPAddress"] is False
    assert spec["subnetSelectorTerms"] == [{"tags": {"karpenter.sh/discovery": "c1"}}]


def test_interruption_events_and_queue_policy():
    kinds = {p["detail-type"][0] for p in karpenter.EVENT_PATTERNS.values()}
    assert {"EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation",
            "EC2 Instance State-change Notification", "AWS Health Event"} <= kinds
    assert any("Capacity Reservation" in k for k in kinds)
    stmts = karpenter.queue_policy("arn:q")["Statement"]
    assert stmts[0]["Principal"]["Service"][0] == "events.amazonaws.com"
    assert stmts[1]["Effect"] == "Deny"
