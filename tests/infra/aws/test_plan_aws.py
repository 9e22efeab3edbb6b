"""The whole program for the aws-* stacks through the plan tool: `pytest tests/infra/aws/test_plan_aws.py`.

Asserts the security-relevant values on the planned resources: one explicit AWS provider in the
stack's region behind every resource and data source, no public IPs on nodes, every bucket, volume,
log group, queue, repository and secret encrypted with a customer-managed key, IMDSv2, every GPU pool
a Karpenter NodePool (EFA interfaces, placement and reservations on aws-prod), the EFA group's self
rules, and the interruption queue.
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
    repos = {r["name"]: r for r in _by_type(plan, "aws:ecr/repository:Repository")}
    assert set(repos) == {f"gpu-train-{stack}-trainer", f"gpu-train-{stack}-trainer-buildcache"}
    assert all(r["encryptionConfigurations"][0]["kmsKey"] in cmk for r in repos.values())
    image_repo = repos[f"gpu-train-{stack}-trainer"]
    assert image_repo["imageTagMutability"] == "IMMUTABLE" and image_repo["imageScanningConfiguration"]["scanOnPush"]
    # The build cache rewrites one tag on every build: only its own repository is mutable.
    assert repos[f"gpu-train-{stack}-trainer-buildcache"]["imageTagMutability"] == "MUTABLE"
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


def _node_classes(plan: dict) -> dict[str, dict]:
    return {r["inputs"]["metadata"]["name"]: r["inputs"]["spec"]
            for r in resources_of(plan, "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")}


def _node_pools(plan: dict) -> dict[str, dict]:
    return {r["inputs"]["metadata"]["name"]: r["inputs"]["spec"]
            for r in resources_of(plan, "kubernetes:karpenter.sh/v1:NodePool")}


def _capacity(spec: dict) -> list[str]:
    return next(r["values"] for r in spec["template"]["spec"]["requirements"]
                if r["key"] == "karpenter.sh/capacity-type")


def test_prod_gpu_pools_are_karpenter_node_pools_with_efa_placement_and_reservation(plans):
    plan = plans["aws-prod"]
    # No GPU managed node group remains: the system group is the only one.
    assert [r["name"] for r in resources_of(plan, "aws:eks/nodeGroup:NodeGroup")] == ["cluster-system"]
    classes, pools = _node_classes(plan), _node_pools(plan)
    assert set(classes) == {"gpu-h100-reserved", "gpu-h100-spot"}
    # h100-reserved: minNodes 2 of maxNodes 4 -> a static pool of 2 and a dynamic pool of up to 2 more.
    assert set(pools) == {"h100-reserved-static", "h100-reserved", "h100-spot"}
    assert pools["h100-reserved-static"]["replicas"] == 2
    assert pools["h100-reserved"]["limits"] == {"nvidia.com/gpu": "16"}
    assert pools["h100-spot"]["limits"] == {"nvidia.com/gpu": "32"}
    assert _capacity(pools["h100-reserved"]) == _capacity(pools["h100-reserved-static"]) == ["reserved"]
    assert _capacity(pools["h100-spot"]) == ["spot"]
    (efa_sg,) = [r for r in resources_of(plan, "aws:ec2/securityGroup:SecurityGroup") if r["name"] == "karpenter-efa"]
    assert efa_sg["inputs"]["vpcId"] and efa_sg["inputs"]["tags"]["gpu-train.io/efa"] == "gpu-train-aws-prod"
    for name in ("gpu-h100-reserved", "gpu-h100-spot"):
        nis = classes[name]["networkInterfaces"]
        # p5.48xlarge has 32 network cards: the ENA primary plus an efa-only interface on each card.
        assert len(nis) == 33
        assert nis[0] == {"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"}
        efa = [n for n in nis if n["interfaceType"] == "efa-only"]
        assert sorted(n["networkCardIndex"] for n in efa) == list(range(32))
        assert {"tags": {"gpu-train.io/efa": "gpu-train-aws-prod"}} in classes[name]["securityGroupSelectorTerms"]
    reserved, spot = classes["gpu-h100-reserved"], classes["gpu-h100-spot"]
    assert reserved["capacityReservationSelectorTerms"] == [{"id": "cr-0a1b2c3d4e5f67890"}]
    assert "placementGroupSelector" not in reserved
    (pg,) = _by_type(plan, "aws:ec2/placementGroup:PlacementGroup")
    assert pg["strategy"] == "cluster" and spot["placementGroupSelector"] == {"name": pg["name"]}
    ingress = _by_type(plan, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
    egress = _by_type(plan, "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")
    for rules in (ingress, egress):
        (rule,) = [r for r in rules if r.get("description") == "EFA peers"]
        assert rule["ipProtocol"] == "-1" and rule["referencedSecurityGroupId"] == rule["securityGroupId"]


def test_every_pool_nodes_offer_what_the_job_requests(plans):
    # The JobSet asks for vpc.amazonaws.com/efa = EFA devices per node; Karpenter advertises one per
    # efa-only interface of the pool's EC2NodeClass.
    for stack, plan in plans.items():
        classes = _node_classes(plan)
        for js in _by_type(plan, "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"):
            pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            pool = pod["nodeSelector"]["gpu-train.io/pool"]
            efa = sum(n["interfaceType"] == "efa-only" for n in classes[f"gpu-{pool}"].get("networkInterfaces", []))
            requested = int(pod["containers"][0]["resources"]["requests"].get("vpc.amazonaws.com/efa", 0))
            assert requested == efa, (stack, pool)


@pytest.mark.parametrize("stack", STACKS)
def test_interruption_queue_and_rules_feed_karpenter(plans, stack):
    plan = plans[stack]
    (queue,) = resources_of(plan, "aws:sqs/queue:Queue")
    queue_arn = plan["registrations"][queue["urn"]]["outputs"]["arn"]
    rules = [json.loads(r["eventPattern"]) for r in _by_type(plan, "aws:cloudwatch/eventRule:EventRule")]
    assert {p["detail-type"][0] for p in rules} >= {"EC2 Spot Instance Interruption Warning",
                                                    "EC2 Capacity Reservation Instance Interruption Warning"}
    targets = _by_type(plan, "aws:cloudwatch/eventTarget:EventTarget")
    assert len(targets) == len(rules) and all(t["arn"] == queue_arn for t in targets)
    (release,) = [r for r in _by_type(plan, "kubernetes:helm.sh/v3:Release") if r["name"] == "karpenter"]
    assert release["values"]["settings"]["interruptionQueue"] == queue["inputs"]["name"]
    assert release["version"] == "1.14.1" and release["skipCrds"] is True
    (crds,) = [r for r in _by_type(plan, "kubernetes:helm.sh/v3:Release") if r["name"] == "karpenter-crd"]
    assert crds["chart"] == "oci://public.ecr.aws/karpenter/karpenter-crd" and crds["version"] == "1.14.1"
    gates = release["values"]["settings"]["featureGates"]
    assert gates["staticCapacity"] is (stack == "aws-prod")


@pytest.mark.parametrize("stack", STACKS)
def test_one_explicit_provider_in_the_stack_region_serves_everything(plans, stack):
    plan = plans[stack]
    (provider,) = resources_of(plan, "pulumi:providers:aws")
    assert provider["inputs"]["region"] == "us-east-1"
    prefix = provider["urn"] + "::"
    on_default = [r["urn"] for r in plan["resources"] if r["type"].startswith("aws:")
                  and not (plan["registrations"][r["urn"]]["provider"] or "").startswith(prefix)]
    assert on_default == []
    aws_invokes = [i for i in plan["invokes"] if i["token"].startswith("aws:")]
    assert {i["token"] for i in aws_invokes} >= {"aws:index/getCallerIdentity:getCallerIdentity",
                                                 "aws:ssm/getParameter:getParameter",
                                                 "aws:eks/getAddonVersion:getAddonVersion"}
    assert all((i["provider"] or "").startswith(prefix) for i in aws_invokes)


def test_service_linked_roles_exist_before_the_ebs_key_names_them(plans):
    plan = plans["aws-prod"]
    roles = {r["inputs"]["awsServiceName"]: r
             for r in resources_of(plan, "aws:iam/serviceLinkedRole:ServiceLinkedRole")}
    # Offline plans model a fresh account: both roles are created (aws-prod has a spot pool).
    assert set(roles) == {"autoscaling.amazonaws.com", "spot.amazonaws.com"}
    (ebs,) = [r for r in resources_of(plan, "aws:kms/key:Key") if r["name"] == "keys-ebs"]
    asg = roles["autoscaling.amazonaws.com"]
    assert asg["urn"] in plan["registrations"][ebs["urn"]]["dependencies"]
    assert plan["registrations"][asg["urn"]]["outputs"]["arn"] in ebs["inputs"]["policy"]


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
    # No fabric pool in dev: no EFA interfaces, no placement group.
    assert not any("networkInterfaces" in c for c in _node_classes(plan).values())
    assert not _by_type(plan, "aws:ec2/placementGroup:PlacementGroup")
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
    assert set(addons) == {"vpc-cni", "coredns", "kube-proxy", "aws-ebs-csi-driver", "eks-pod-identity-agent",
                           "eks-node-monitoring-agent"}
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
