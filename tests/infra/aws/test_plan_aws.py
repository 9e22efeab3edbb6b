"""The whole program for the aws-* stacks through the plan tool: `pytest tests/infra/aws/test_plan_aws.py`.

Asserts the security-relevant values on the planned resources: no public IPs on nodes, every
bucket, volume, log group, queue, repository and secret encrypted with a customer-managed key,
IMDSv2, the EFA group's self rules, and the EFA interface count per instance type.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import resources_of

STACKS = ("aws-dev", "aws-prod")


def _by_type(plan: dict, typ: str) -> list[dict]:
    return [r["inputs"] for r in resources_of(plan, typ)]


def _key_arns(plan: dict) -> set[str]:
    # Mocked key ARNs are deterministic: arn:aws:kms:<region>:<account>:key/mrk-...
    return {a for a in _all_strings(plan) if a.startswith("arn:aws:kms:") and ":key/" in a}


def _all_strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _all_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _all_strings(v)


@pytest.mark.parametrize("stack", STACKS)
def test_keys_rotate_and_everything_is_encrypted_with_them(plans, stack):
    plan = plans[stack]
    keys = _by_type(plan, "aws:kms/key:Key")
    # The rds key exists only where the stack asks for a managed MLflow database (aws-prod).
    assert len(keys) == (7 if stack == "aws-prod" else 6)
    assert all(k["enableKeyRotation"] and 7 <= k["deletionWindowInDays"] <= 30 for k in keys)
    cmk = _key_arns(plan)
    assert cmk
    for sse in _by_type(plan, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"):
        rule = sse["rules"][0]
        assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"
        assert rule["applyServerSideEncryptionByDefault"]["kmsMasterKeyId"] in cmk
        assert rule["bucketKeyEnabled"] is True
    assert len(_by_type(plan, "aws:s3/bucket:Bucket")) == 3
    for group in _by_type(plan, "aws:cloudwatch/logGroup:LogGroup"):
        assert group["kmsKeyId"] in cmk
    for queue in _by_type(plan, "aws:sqs/queue:Queue"):
        assert queue["kmsMasterKeyId"] in cmk
    (repo,) = _by_type(plan, "aws:ecr/repository:Repository")
    assert repo["encryptionConfigurations"][0]["kmsKey"] in cmk
    assert repo["imageTagMutability"] == "IMMUTABLE" and repo["imageScanningConfiguration"]["scanOnPush"]
    (cluster,) = _by_type(plan, "aws:eks/cluster:Cluster")
    assert cluster["encryptionConfig"]["resources"] == ["secrets"]
    assert cluster["encryptionConfig"]["provider"]["keyArn"] in cmk
    for lt in _by_type(plan, "aws:ec2/launchTemplate:LaunchTemplate"):
        for bdm in lt["blockDeviceMappings"]:
            assert bdm["ebs"]["encrypted"] == "true" and bdm["ebs"]["kmsKeyId"] in cmk
            assert bdm["ebs"]["volumeType"] == "gp3"


@pytest.mark.parametrize("stack", STACKS)
def test_buckets_are_private_tls_only_and_versioned_checkpoints(plans, stack):
    plan = plans[stack]
    for pab in _by_type(plan, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"):
        assert all(pab[k] is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                            "restrictPublicBuckets"))
    owners = _by_type(plan, "aws:s3/bucketOwnershipControls:BucketOwnershipControls")
    assert [o["rule"]["objectOwnership"] for o in owners] == ["BucketOwnerEnforced"] * 3
    for pol in _by_type(plan, "aws:s3/bucketPolicy:BucketPolicy"):
        stmt = json.loads(pol["policy"])["Statement"][0]
        assert stmt["Effect"] == "Deny" and stmt["Condition"]["Bool"]["aws:SecureTransport"] == "false"
    versioned = [r["name"] for r in resources_of(plan, "aws:s3/bucketVersioning:BucketVersioning")]
    assert "storage-checkpoints" in versioned
    for lc in _by_type(plan, "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration"):
        assert any("abortIncompleteMultipartUpload" in r for r in lc["rules"])


@pytest.mark.parametrize("stack", STACKS)
def test_nodes_have_no_public_ip_and_require_imdsv2(plans, stack):
    plan = plans[stack]
    lts = _by_type(plan, "aws:ec2/launchTemplate:LaunchTemplate")
    assert lts
    for lt in lts:
        assert lt["networkInterfaces"]
        assert all(ni["associatePublicIpAddress"] == "false" for ni in lt["networkInterfaces"])
        assert lt["metadataOptions"]["httpTokens"] == "required"
        assert lt["metadataOptions"]["httpPutResponseHopLimit"] == 1
    for subnet in _by_type(plan, "aws:ec2/subnet:Subnet"):
        assert subnet["mapPublicIpOnLaunch"] is False
    for obj in _by_type(plan, "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"):
        spec = obj["spec"]
        assert spec["associatePublicIPAddress"] is False and spec["metadataOptions"]["httpTokens"] == "required"
        assert spec["blockDeviceMappings"][0]["ebs"]["encrypted"] is True
        assert spec["instanceStorePolicy"] == "RAID0"


def test_prod_p5_pools_have_32_efa_interfaces_and_efa_group(plans):
    plan = plans["aws-prod"]
    lts = {r["name"]: r["inputs"] for r in resources_of(plan, "aws:ec2/launchTemplate:LaunchTemplate")}
    (efa_sg,) = [r for r in resources_of(plan, "aws:ec2/securityGroup:SecurityGroup") if r["name"] == "gpu-efa"]
    for name in ("gpu-h100-reserved", "gpu-h100-spot"):
        nis = lts[name]["networkInterfaces"]
        assert len(nis) == 32
        assert (nis[0]["networkCardIndex"], nis[0]["deviceIndex"], nis[0]["interfaceType"]) == (0, 0, "efa")
        assert all(n["interfaceType"] == "efa-only" and n["deviceIndex"] == 1 for n in nis[1:])
        assert sorted(n["networkCardIndex"] for n in nis) == list(range(32))
        assert all(len(n["securityGroups"]) == 2 for n in nis)
        assert lts[name]["instanceType"] == "p5.48xlarge"
    reserved = lts["gpu-h100-reserved"]
    assert reserved["instanceMarketOptions"]["marketType"] == "capacity-block"
    assert reserved["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"] == \
        "cr-0a1b2c3d4e5f67890"
    assert lts["gpu-h100-spot"]["placement"]["availabilityZone"] == "us-east-1a"
    (pg,) = _by_type(plan, "aws:ec2/placementGroup:PlacementGroup")
    assert pg["strategy"] == "cluster"
    ingress = _by_type(plan, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
    egress = _by_type(plan, "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")
    for rules in (ingress, egress):
        (rule,) = rules
        assert rule["ipProtocol"] == "-1" and rule["referencedSecurityGroupId"] == rule["securityGroupId"]
    assert efa_sg["inputs"]["vpcId"]
    groups = {r["name"]: r["inputs"] for r in resources_of(plan, "aws:eks/nodeGroup:NodeGroup")}
    assert groups["gpu-h100-reserved"]["capacityType"] == "CAPACITY_BLOCK"
    assert groups["gpu-h100-spot"]["capacityType"] == "SPOT"
    assert groups["gpu-h100-spot"]["scalingConfig"]["minSize"] == 0


def test_dev_spot_pools_are_karpenter_node_pools(plans):
    plan = plans["aws-dev"]
    pools = {r["inputs"]["metadata"]["name"]: r["inputs"]["spec"]
             for r in resources_of(plan, "kubernetes:karpenter.sh/v1:NodePool")}
    assert set(pools) == {"l4-spot", "l40s-spot"}
    assert pools["l4-spot"]["limits"] == {"nvidia.com/gpu": "4"}
    assert pools["l40s-spot"]["disruption"]["consolidationPolicy"] == "WhenEmpty"
    (release,) = [r for r in _by_type(plan, "kubernetes:helm.sh/v3:Release") if r["name"] == "karpenter"]
    assert release["chart"] == "oci://public.ecr.aws/karpenter/karpenter" and release["version"]
    rules = [json.loads(r["eventPattern"]) for r in _by_type(plan, "aws:cloudwatch/eventRule:EventRule")]
    assert len(rules) == 5
    # Only the system node group is managed: GPUs appear only when Karpenter launches them.
    assert [r["name"] for r in resources_of(plan, "aws:eks/nodeGroup:NodeGroup")] == ["cluster-system"]
    assert len(_by_type(plan, "aws:ec2/natGateway:NatGateway")) == 1


def test_prod_network_endpoints_flow_logs_and_cluster(plans):
    plan = plans["aws-prod"]
    assert len(_by_type(plan, "aws:ec2/natGateway:NatGateway")) == 3
    endpoints = _by_type(plan, "aws:ec2/vpcEndpoint:VpcEndpoint")
    interfaces = [e for e in endpoints if e["vpcEndpointType"] == "Interface"]
    assert len(interfaces) == 14 and all(e["privateDnsEnabled"] for e in interfaces)
    assert [e["serviceName"] for e in endpoints if e["vpcEndpointType"] == "Gateway"] == ["com.amazonaws.us-east-1.s3"]
    (flow,) = _by_type(plan, "aws:ec2/flowLog:FlowLog")
    assert flow["trafficType"] == "ALL"
    (assoc,) = _by_type(plan, "aws:ec2/vpcIpv4CidrBlockAssociation:VpcIpv4CidrBlockAssociation")
    assert assoc["cidrBlock"] == "100.64.0.0/16"
    (cluster,) = _by_type(plan, "aws:eks/cluster:Cluster")
    vpc = cluster["vpcConfig"]
    assert vpc["endpointPrivateAccess"] is True and vpc["publicAccessCidrs"] == ["203.0.113.0/24"]
    assert cluster["accessConfig"]["authenticationMode"] == "API"
    assert set(cluster["enabledClusterLogTypes"]) == {"api", "audit", "authenticator", "controllerManager",
                                                      "scheduler"}
    addons = {a["addonName"]: a for a in _by_type(plan, "aws:eks/addon:Addon")}
    assert set(addons) == {"vpc-cni", "coredns", "kube-proxy", "aws-ebs-csi-driver", "eks-pod-identity-agent"}
    assert addons["vpc-cni"]["addonVersion"].startswith("v1.")
    assert addons["aws-ebs-csi-driver"]["podIdentityAssociations"][0]["serviceAccount"] == "ebs-csi-controller-sa"
    assocs = {(a["namespace"], a["serviceAccount"]) for a in _by_type(plan, "aws:eks/podIdentityAssociation:"
                                                                            "PodIdentityAssociation")}
    assert {("team-research", "trainer"), ("team-applied", "trainer"), ("alluxio", "alluxio"),
            ("mlflow", "mlflow")} <= assocs
    enis = _by_type(plan, "kubernetes:crd.k8s.amazonaws.com/v1alpha1:ENIConfig")
    assert sorted(e["metadata"]["name"] for e in enis) == ["us-east-1a", "us-east-1b", "us-east-1c"]


def test_dev_public_endpoint_off_and_outputs(plans):
    plan = plans["aws-dev"]
    (cluster,) = _by_type(plan, "aws:eks/cluster:Cluster")
    assert cluster["vpcConfig"]["endpointPublicAccess"] is False
    assert plan["outputs"]["kubeconfig"] == "[secret]"
    assert plan["outputs"]["checkpointsBucket"].startswith("s3://gpu-train-aws-dev-checkpoints-")


@pytest.mark.parametrize("stack", STACKS)
def test_every_taggable_aws_resource_has_common_tags(plans, stack):
    for res in plans[stack]["resources"]:
        if res["type"].startswith("aws:") and "tags" in res["inputs"]:
            tags = res["inputs"]["tags"]
            assert {"project", "stack", "environment", "managed-by"} <= set(tags), res["urn"]
