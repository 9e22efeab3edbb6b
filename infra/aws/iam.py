"""IAM policy documents (pure dicts) for every role the AWS layer creates.

Usage: `json.dumps(trainer_policy("research", datasets_bucket="b1", checkpoints_bucket="b2", s3_key_arn=k))`.

Each document is scoped to exact buckets, prefixes, keys, queues and the cluster's tags. Tests read
them directly (tests/infra/aws/test_iam.py). Over 400 lines because the policy documents are data, each kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence

VERSION = "2012-10-17"


def _doc(*statements: dict) -> dict:
    return {"Version": VERSION, "Statement": list(statements)}


def pod_identity_trust(account_id: str) -> dict:
    """Trust policy for EKS Pod Identity: the pods.eks.amazonaws.com principal, this account only.

    https://docs.aws.amazon.com/eks/latest/userguide/pod-id-role.html
    """
    return _doc({
        "Effect": "Allow",
        "Principal": {"Service": "pods.eks.amazonaws.com"},
        "Action": ["sts:AssumeRole", "sts:TagSession"],
        "Condition": {"StringEquals": {"aws:SourceAccount": account_id}},
    })


def service_trust(service: str, account_id: str | None = None) -> dict:
    """Trust policy for an AWS service principal; with `account_id`, only on this account's behalf."""
    statement: dict = {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}
    if account_id:
        # Confused-deputy guard: https://docs.aws.amazon.com/IAM/latest/UserGuide/confused-deputy.html
        statement["Condition"] = {"StringEquals": {"aws:SourceAccount": account_id}}
    return _doc(statement)


def _s3_kms(s3_key_arn: str, actions: Sequence[str]) -> dict:
    return {"Sid": "BucketKey", "Effect": "Allow", "Action": list(actions), "Resource": s3_key_arn}


def _read_bucket(sid: str, bucket: str) -> list[dict]:
    return [
        {"Sid": f"{sid}List", "Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
         "Resource": f"arn:aws:s3:::{bucket}"},
        {"Sid": f"{sid}Read", "Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
         "Resource": f"arn:aws:s3:::{bucket}/*"},
    ]


def _team_checkpoints(team: str, checkpoints_bucket: str) -> list[dict]:
    """List, read and write <checkpoints>/<team>/ only."""
    if not team or "/" in team or "*" in team:
        raise ValueError(f"team name {team!r} cannot scope an S3 prefix")
    return [
        {"Sid": "CheckpointsListTeamPrefix", "Effect": "Allow", "Action": "s3:ListBucket",
         "Resource": f"arn:aws:s3:::{checkpoints_bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{team}/", f"{team}/*"]}}},
        {"Sid": "CheckpointsTeamObjects", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts"],
         "Resource": f"arn:aws:s3:::{checkpoints_bucket}/{team}/*"},
    ]


def trainer_policy(team: str, *, datasets_bucket: str, checkpoints_bucket: str, s3_key_arn: str) -> dict:
    """A team's trainer: read datasets; read/write only <checkpoints>/<team>/; the S3 key only."""
    return _doc(
        *_read_bucket("Datasets", datasets_bucket),
        *_team_checkpoints(team, checkpoints_bucket),
        # Decrypt to read, GenerateDataKey to write objects under SSE-KMS.
        _s3_kms(s3_key_arn, ["kms:Decrypt", "kms:GenerateDataKey"]),
    )


def sweep_controller_policy(team: str, *, checkpoints_bucket: str, s3_key_arn: str) -> dict:
    """A team's in-cluster sweep controllers: its trials' budget and status objects and the sweeps' journals, all
    under <checkpoints>/<team>/; no datasets."""
    return _doc(*_team_checkpoints(team, checkpoints_bucket),
                _s3_kms(s3_key_arn, ["kms:Decrypt", "kms:GenerateDataKey"]))


def data_prep_policy(team: str, *, datasets_bucket: str, s3_key_arn: str) -> dict:
    """A team's Ray pods preparing data (`gpu-train prepare --cluster`): read the datasets bucket (the inputs and
    the datasets already there); write and delete only under <datasets>/<team>/ (shards, commits, plan, manifest)."""
    if not team or "/" in team or "*" in team:
        raise ValueError(f"team name {team!r} cannot scope an S3 prefix")
    return _doc(
        *_read_bucket("Datasets", datasets_bucket),
        {"Sid": "DatasetsTeamWrite", "Effect": "Allow",
         "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
         "Resource": f"arn:aws:s3:::{datasets_bucket}/{team}/*"},
        _s3_kms(s3_key_arn, ["kms:Decrypt", "kms:GenerateDataKey"]),
    )


def cache_policy(*, datasets_bucket: str, s3_key_arn: str) -> dict:
    """The Alluxio cache: read-only on the datasets bucket."""
    return _doc(*_read_bucket("Datasets", datasets_bucket), _s3_kms(s3_key_arn, ["kms:Decrypt"]))


def mlflow_policy(*, artifacts_bucket: str, s3_key_arn: str) -> dict:
    """The MLflow server: read/write the artifacts bucket, nothing else."""
    return _doc(
        {"Sid": "ArtifactsList", "Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
         "Resource": f"arn:aws:s3:::{artifacts_bucket}"},
        {"Sid": "ArtifactsObjects", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
         "Resource": f"arn:aws:s3:::{artifacts_bucket}/*"},
        _s3_kms(s3_key_arn, ["kms:Decrypt", "kms:GenerateDataKey"]),
    )


def serving_policy(*, artifacts_bucket: str, prefix: str, s3_key_arn: str) -> dict:
    """A team's model servers (KServe's storage initializer): read the model versions MLflow keeps under
    <artifacts>/<prefix>/, nothing else; decrypt only."""
    if not prefix or "*" in prefix:
        raise ValueError(f"MLflow artifacts prefix {prefix!r} cannot scope an S3 prefix")
    return _doc(
        {"Sid": "ArtifactsListPrefix", "Effect": "Allow", "Action": "s3:ListBucket",
         "Resource": f"arn:aws:s3:::{artifacts_bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/", f"{prefix}/*"]}}},
        {"Sid": "ArtifactsRead", "Effect": "Allow", "Action": "s3:GetObject",
         "Resource": f"arn:aws:s3:::{artifacts_bucket}/{prefix}/*"},
        _s3_kms(s3_key_arn, ["kms:Decrypt"]),
    )


def ebs_kms_policy(ebs_key_arn: str) -> dict:
    """Extra permissions for the EBS CSI driver: create volumes encrypted with our key.

    The AWS-managed AmazonEBSCSIDriverPolicy covers EC2; KMS use of a customer key must be granted.
    https://docs.aws.amazon.com/eks/latest/userguide/ebs-csi.html
    """
    return _doc(
        {"Sid": "EbsKeyGrants", "Effect": "Allow",
         "Action": ["kms:CreateGrant", "kms:ListGrants", "kms:RevokeGrant"], "Resource": ebs_key_arn,
         "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}}},
        {"Sid": "EbsKeyUse", "Effect": "Allow",
         "Action": ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"],
         "Resource": ebs_key_arn},
    )


def karpenter_controller_policy(*, cluster_name: str, cluster_arn: str, region: str, account_id: str,
                                node_role_arn: str, queue_arn: str, ebs_key_arn: str, sqs_key_arn: str) -> dict:
    """Karpenter 1.14 controller permissions, narrowed to this cluster's tags, region, queue and node role.

    Statement for statement the reference policy of Karpenter v1.14.1 (the CloudFormation template in
    website/content/en/docs/getting-started/getting-started-with-karpenter/cloudformation.yaml,
    https://karpenter.sh/docs/reference/cloudformation/): node lifecycle (including launch-template
    use, capacity reservations and placement groups), instance profiles, EKS discovery, the
    interruption queue and resource discovery. Narrowings: one region, ec2.amazonaws.com only for
    PassRole, and no zonal-shift statement (settings.enableZonalShift stays off). Two statements the
    reference lacks because this platform uses customer-managed keys where it uses AWS-managed ones:
    EBS volumes encrypted with our key (EC2 calls KMS as the caller, via ec2) and the SSE-KMS
    interruption queue (ReceiveMessage needs kms:Decrypt, via sqs).
    """
    cluster_tag = f"kubernetes.io/cluster/{cluster_name}"
    owned_request = {f"aws:RequestTag/{cluster_tag}": "owned", "aws:RequestTag/eks:eks-cluster-name": cluster_name}
    owned_resource = {f"aws:ResourceTag/{cluster_tag}": "owned"}
    return _doc(
        *_karpenter_node_lifecycle(cluster_name, region, owned_request, owned_resource),
        {"Sid": "Describe", "Effect": "Allow",
         "Action": ["ec2:DescribeCapacityReservations", "ec2:DescribeImages", "ec2:DescribeInstances",
                    "ec2:DescribeInstanceStatus", "ec2:DescribeInstanceTypeOfferings", "ec2:DescribeInstanceTypes",
                    "ec2:DescribeLaunchTemplates", "ec2:DescribePlacementGroups", "ec2:DescribeSecurityGroups",
                    "ec2:DescribeSpotPriceHistory", "ec2:DescribeSubnets"],
         "Resource": "*", "Condition": {"StringEquals": {"aws:RequestedRegion": region}}},
        # Public SSM parameters have an empty account field: arn:aws:ssm:<region>::parameter/aws/service/...
        {"Sid": "AmiParameters", "Effect": "Allow", "Action": "ssm:GetParameter",
         "Resource": f"arn:aws:ssm:{region}::parameter/aws/service/*"},
        {"Sid": "Pricing", "Effect": "Allow", "Action": "pricing:GetProducts", "Resource": "*"},
        {"Sid": "InterruptionQueue", "Effect": "Allow",
         "Action": ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"], "Resource": queue_arn},
        {"Sid": "InterruptionQueueKey", "Effect": "Allow", "Action": "kms:Decrypt", "Resource": sqs_key_arn,
         "Condition": {"StringEquals": {"kms:ViaService": f"sqs.{region}.amazonaws.com"}}},
        *_karpenter_instance_profiles(region, account_id, node_role_arn, owned_request, owned_resource),
        {"Sid": "DescribeCluster", "Effect": "Allow", "Action": "eks:DescribeCluster", "Resource": cluster_arn},
        # RunInstances / CreateFleet with volumes encrypted by our key: EC2 calls KMS with the caller's
        # credentials (kms:ViaService ec2), and creates a grant for the volume (kms:GrantIsForAWSResource
        # applies to the grant operations only, so it sits on CreateGrant alone).
        # https://docs.aws.amazon.com/ebs/latest/userguide/ebs-encryption-requirements.html
        *ebs_key_use_statements("EbsKey", ebs_key_arn, region),
    )


def _karpenter_node_lifecycle(cluster_name: str, region: str, owned_request: dict, owned_resource: dict) -> list[dict]:
    """Launch, tag and terminate instances (and their launch templates) tagged for this cluster and a NodePool."""
    ec2 = f"arn:aws:ec2:{region}"
    nodepool_request = {"aws:RequestTag/karpenter.sh/nodepool": "*"}
    nodepool_resource = {"aws:ResourceTag/karpenter.sh/nodepool": "*"}
    launched = [f"{ec2}:*:fleet/*", f"{ec2}:*:instance/*", f"{ec2}:*:volume/*", f"{ec2}:*:network-interface/*",
                f"{ec2}:*:launch-template/*", f"{ec2}:*:spot-instances-request/*"]
    return [
        {"Sid": "LaunchFromSharedResources", "Effect": "Allow",
         "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
         "Resource": [f"{ec2}::image/*", f"{ec2}::snapshot/*", f"{ec2}:*:security-group/*", f"{ec2}:*:subnet/*",
                      f"{ec2}:*:capacity-reservation/*", f"{ec2}:*:placement-group/*"]},
        {"Sid": "LaunchFromOwnedLaunchTemplates", "Effect": "Allow",
         "Action": ["ec2:RunInstances", "ec2:CreateFleet"], "Resource": f"{ec2}:*:launch-template/*",
         "Condition": {"StringEquals": owned_resource, "StringLike": nodepool_resource}},
        {"Sid": "LaunchTaggedResources", "Effect": "Allow",
         "Action": ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"], "Resource": launched,
         "Condition": {"StringEquals": owned_request, "StringLike": nodepool_request}},
        {"Sid": "TagOnLaunch", "Effect": "Allow", "Action": "ec2:CreateTags", "Resource": launched,
         "Condition": {"StringEquals": {**owned_request,
                                        "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"]},
                       "StringLike": nodepool_request}},
        {"Sid": "TagOwnedInstances", "Effect": "Allow", "Action": "ec2:CreateTags",
         "Resource": f"{ec2}:*:instance/*",
         "Condition": {"StringEquals": owned_resource, "StringLike": nodepool_resource,
                       "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": cluster_name},
                       "ForAllValues:StringEquals": {"aws:TagKeys": ["eks:eks-cluster-name",
                                                                     "karpenter.sh/nodeclaim", "Name"]}}},
        {"Sid": "DeleteOwned", "Effect": "Allow", "Action": ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
         "Resource": [f"{ec2}:*:instance/*", f"{ec2}:*:launch-template/*"],
         "Condition": {"StringEquals": owned_resource, "StringLike": nodepool_resource}},
    ]


def _karpenter_instance_profiles(region: str, account_id: str, node_role_arn: str, owned_request: dict,
                                 owned_resource: dict) -> list[dict]:
    """Pass the node role to EC2, and manage the instance profiles Karpenter creates for its EC2NodeClasses."""
    profiles = f"arn:aws:iam::{account_id}:instance-profile/*"
    profile_resource = {**owned_resource, "aws:ResourceTag/topology.kubernetes.io/region": region}
    profile_request = {**owned_request, "aws:RequestTag/topology.kubernetes.io/region": region}
    return [
        {"Sid": "PassNodeRole", "Effect": "Allow", "Action": "iam:PassRole", "Resource": node_role_arn,
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
        {"Sid": "CreateInstanceProfiles", "Effect": "Allow", "Action": "iam:CreateInstanceProfile",
         "Resource": profiles,
         "Condition": {"StringEquals": profile_request,
                       "StringLike": {"aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
        {"Sid": "TagInstanceProfiles", "Effect": "Allow", "Action": "iam:TagInstanceProfile", "Resource": profiles,
         "Condition": {"StringEquals": {**profile_resource, **profile_request},
                       "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*",
                                      "aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
        {"Sid": "ManageOwnedInstanceProfiles", "Effect": "Allow",
         "Action": ["iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile",
                    "iam:DeleteInstanceProfile"],
         "Resource": profiles,
         "Condition": {"StringEquals": profile_resource,
                       "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
        {"Sid": "ListInstanceProfiles", "Effect": "Allow", "Action": "iam:ListInstanceProfiles", "Resource": "*"},
        {"Sid": "ReadInstanceProfiles", "Effect": "Allow", "Action": "iam:GetInstanceProfile",
         "Resource": profiles},
    ]


def ebs_key_use_statements(sid: str, ebs_key_arn: str, region: str) -> list[dict]:
    """What a principal that creates encrypted EBS volumes (RunInstances, CreateVolume) needs on the key."""
    via_ec2 = {"kms:ViaService": f"ec2.{region}.amazonaws.com"}
    return [
        {"Sid": f"{sid}Use", "Effect": "Allow",
         "Action": ["kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncrypt*"],
         "Resource": ebs_key_arn, "Condition": {"StringEquals": via_ec2}},
        {"Sid": f"{sid}Grants", "Effect": "Allow", "Action": "kms:CreateGrant", "Resource": ebs_key_arn,
         "Condition": {"StringEquals": via_ec2, "Bool": {"kms:GrantIsForAWSResource": "true"}}},
    ]


def cluster_encryption_policy(secrets_key_arn: str) -> dict:
    """The EKS cluster role's use of the Secrets key: AmazonEKSClusterPolicy grants no KMS on customer keys.

    The same four actions the terraform-aws-eks module attaches to its cluster role for secrets encryption
    (https://github.com/terraform-aws-modules/terraform-aws-eks/blob/master/main.tf, `cluster_encryption`).
    """
    return _doc({"Sid": "SecretsEncryption", "Effect": "Allow",
                 "Action": ["kms:Encrypt", "kms:Decrypt", "kms:ListGrants", "kms:DescribeKey"],
                 "Resource": secrets_key_arn})


LB_CONTROLLER_TAG = "elbv2.k8s.aws/cluster"  # the controller tags what it creates with this key


def load_balancer_controller_policy(*, region: str, account_id: str) -> dict:
    """AWS Load Balancer Controller permissions, following the project's published policy.

    Statement for statement the controller's own `docs/install/iam_policy.json` at the tag the
    pinned chart ships (v3.5.0; the file is unchanged since v2.13.0,
    https://github.com/kubernetes-sigs/aws-load-balancer-controller/blob/v3.5.0/docs/install/iam_policy.json),
    with these narrowings: ARNs are limited to this account and region; where the published policy
    says "*" for an action that supports resource-level permissions, the resource is the ARN type
    the Service Authorization Reference lists for it (the IAM lint checks each against its
    catalogue); and these actions are left out, because the Helm values turn their features off or
    this platform never asks for them (internal NLBs from Services, no ALB Ingress):
    `cognito-idp:DescribeUserPoolClient` (ALB OIDC/Cognito auth), the `waf-regional:*`, `wafv2:*`
    and `elasticloadbalancing:SetWebAcl` actions (enableWaf / enableWafv2 off), the `shield:*`
    actions (enableShield off), `ec2:DescribeCoipPools` and `ec2:GetCoipPoolUsage` (Outposts
    customer-owned IPs for ALBs) and `elasticloadbalancing:ModifyIpPools` (IPAM pools for ALBs).
    The read-only `ec2:DescribeIpamPools` stays, as published. Mutations stay keyed on the
    controller's ownership tag. The features the chart's controller adds beyond this file
    (certificate management, Global Accelerator) publish policies of their own and are off by default.
    """
    elb = f"arn:aws:elasticloadbalancing:{region}:{account_id}"
    sg = f"arn:aws:ec2:{region}:{account_id}:security-group/*"
    tagged_request = {f"aws:RequestTag/{LB_CONTROLLER_TAG}": "false"}
    owned_resource = {f"aws:ResourceTag/{LB_CONTROLLER_TAG}": "false"}
    balancers = [f"{elb}:targetgroup/*/*", f"{elb}:loadbalancer/net/*/*", f"{elb}:loadbalancer/app/*/*"]
    listeners = [f"{elb}:listener/net/*/*/*", f"{elb}:listener/app/*/*/*"]
    rules = [f"{elb}:listener-rule/net/*/*/*", f"{elb}:listener-rule/app/*/*/*"]
    return _doc(
        {"Sid": "ElbServiceLinkedRole", "Effect": "Allow", "Action": "iam:CreateServiceLinkedRole",
         "Resource": f"arn:aws:iam::{account_id}:role/aws-service-role/elasticloadbalancing.amazonaws.com/"
                     "AWSServiceRoleForElasticLoadBalancing",
         "Condition": {"StringEquals": {"iam:AWSServiceName": "elasticloadbalancing.amazonaws.com"}}},
        {"Sid": "Describe", "Effect": "Allow",
         "Action": ["ec2:DescribeAccountAttributes", "ec2:DescribeAddresses", "ec2:DescribeAvailabilityZones",
                    "ec2:DescribeInternetGateways", "ec2:DescribeVpcs", "ec2:DescribeVpcPeeringConnections",
                    "ec2:DescribeSubnets", "ec2:DescribeSecurityGroups", "ec2:DescribeInstances",
                    "ec2:DescribeNetworkInterfaces", "ec2:DescribeTags", "ec2:DescribeIpamPools",
                    "ec2:DescribeRouteTables",
                    "elasticloadbalancing:DescribeLoadBalancers", "elasticloadbalancing:DescribeLoadBalancerAttributes",
                    "elasticloadbalancing:DescribeListeners", "elasticloadbalancing:DescribeListenerCertificates",
                    "elasticloadbalancing:DescribeSSLPolicies", "elasticloadbalancing:DescribeRules",
                    "elasticloadbalancing:DescribeTargetGroups",
                    "elasticloadbalancing:DescribeTargetGroupAttributes",
                    "elasticloadbalancing:DescribeTargetHealth", "elasticloadbalancing:DescribeTags",
                    "elasticloadbalancing:DescribeTrustStores", "elasticloadbalancing:DescribeListenerAttributes",
                    "elasticloadbalancing:DescribeCapacityReservation"],
         "Resource": "*"},
        {"Sid": "SecurityGroupsForVpc", "Effect": "Allow", "Action": "ec2:GetSecurityGroupsForVpc",
         "Resource": f"arn:aws:ec2:{region}:{account_id}:vpc/*"},
        # TLS listeners look certificates up in ACM / IAM (read only).
        {"Sid": "ListCertificates", "Effect": "Allow", "Action": ["acm:ListCertificates", "iam:ListServerCertificates"],
         "Resource": "*"},
        {"Sid": "ReadCertificates", "Effect": "Allow", "Action": ["acm:DescribeCertificate", "iam:GetServerCertificate"],
         "Resource": [f"arn:aws:acm:{region}:{account_id}:certificate/*",
                      f"arn:aws:iam::{account_id}:server-certificate/*"]},
        {"Sid": "SecurityGroupIngress", "Effect": "Allow",
         "Action": ["ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress"], "Resource": sg},
        {"Sid": "CreateSecurityGroup", "Effect": "Allow", "Action": "ec2:CreateSecurityGroup",
         "Resource": [sg, f"arn:aws:ec2:{region}:{account_id}:vpc/*"]},
        {"Sid": "TagNewSecurityGroups", "Effect": "Allow", "Action": "ec2:CreateTags", "Resource": sg,
         "Condition": {"StringEquals": {"ec2:CreateAction": "CreateSecurityGroup"}, "Null": tagged_request}},
        {"Sid": "RetagOwnedSecurityGroups", "Effect": "Allow", "Action": ["ec2:CreateTags", "ec2:DeleteTags"],
         "Resource": sg,
         "Condition": {"Null": {f"aws:RequestTag/{LB_CONTROLLER_TAG}": "true", **owned_resource}}},
        {"Sid": "ManageOwnedSecurityGroups", "Effect": "Allow",
         "Action": ["ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress",
                    "ec2:DeleteSecurityGroup"],
         "Resource": sg, "Condition": {"Null": owned_resource}},
        {"Sid": "CreateTaggedBalancers", "Effect": "Allow",
         "Action": ["elasticloadbalancing:CreateLoadBalancer", "elasticloadbalancing:CreateTargetGroup"],
         "Resource": balancers, "Condition": {"Null": tagged_request}},
        {"Sid": "Listeners", "Effect": "Allow",
         "Action": ["elasticloadbalancing:CreateListener", "elasticloadbalancing:DeleteListener",
                    "elasticloadbalancing:CreateRule", "elasticloadbalancing:DeleteRule"],
         "Resource": [f"{elb}:loadbalancer/net/*/*", f"{elb}:loadbalancer/app/*/*", *listeners, *rules]},
        {"Sid": "RetagOwnedBalancers", "Effect": "Allow",
         "Action": ["elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"], "Resource": balancers,
         "Condition": {"Null": {f"aws:RequestTag/{LB_CONTROLLER_TAG}": "true", **owned_resource}}},
        {"Sid": "TagListeners", "Effect": "Allow",
         "Action": ["elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"],
         "Resource": [*listeners, *rules]},
        {"Sid": "ModifyOwnedBalancers", "Effect": "Allow",
         "Action": ["elasticloadbalancing:ModifyLoadBalancerAttributes", "elasticloadbalancing:SetIpAddressType",
                    "elasticloadbalancing:SetSecurityGroups", "elasticloadbalancing:SetSubnets",
                    "elasticloadbalancing:DeleteLoadBalancer", "elasticloadbalancing:ModifyTargetGroup",
                    "elasticloadbalancing:ModifyTargetGroupAttributes", "elasticloadbalancing:DeleteTargetGroup",
                    "elasticloadbalancing:ModifyListenerAttributes",
                    "elasticloadbalancing:ModifyCapacityReservation"],
         "Resource": [*balancers, *listeners], "Condition": {"Null": owned_resource}},
        {"Sid": "TagOnCreate", "Effect": "Allow", "Action": "elasticloadbalancing:AddTags", "Resource": balancers,
         "Condition": {"StringEquals": {"elasticloadbalancing:CreateAction": ["CreateTargetGroup",
                                                                               "CreateLoadBalancer"]},
                       "Null": tagged_request}},
        {"Sid": "Targets", "Effect": "Allow",
         "Action": ["elasticloadbalancing:RegisterTargets", "elasticloadbalancing:DeregisterTargets"],
         "Resource": f"{elb}:targetgroup/*/*"},
        {"Sid": "ListenerRules", "Effect": "Allow",
         "Action": ["elasticloadbalancing:ModifyListener", "elasticloadbalancing:AddListenerCertificates",
                    "elasticloadbalancing:RemoveListenerCertificates", "elasticloadbalancing:ModifyRule",
                    "elasticloadbalancing:SetRulePriorities"],
         "Resource": [*listeners, *rules]},
    )


def codebuild_runner_policy(*, region: str, account_id: str, log_group_arn: str, subnet_ids: Sequence[str],
                            connection_arn: str) -> dict:
    """The CodeBuild deploy runner's own role: network interfaces in its subnets, its log group, and the
    GitHub connection. Nothing else: deploy jobs assume the deploy role through GitHub's OIDC token.

    https://docs.aws.amazon.com/codebuild/latest/userguide/auth-and-access-control-iam-identity-based-access-control.html#customer-managed-policies-example-create-vpc-network-interface
    https://docs.aws.amazon.com/codebuild/latest/userguide/connections-github-app.html
    """
    service = connection_arn.split(":")[2] if connection_arn.count(":") >= 5 else ""
    if service not in ("codeconnections", "codestar-connections"):
        raise ValueError(f"gpu-train:deployRunner.connectionArn must be a CodeConnections connection ARN "
                         f"(got {connection_arn!r})")
    ec2 = f"arn:aws:ec2:{region}:{account_id}"
    return _doc(
        {"Sid": "DescribeNetwork", "Effect": "Allow",
         "Action": ["ec2:DescribeDhcpOptions", "ec2:DescribeNetworkInterfaces", "ec2:DescribeSubnets",
                    "ec2:DescribeSecurityGroups", "ec2:DescribeVpcs"],
         "Resource": "*"},
        {"Sid": "NetworkInterfaces", "Effect": "Allow",
         "Action": ["ec2:CreateNetworkInterface", "ec2:DeleteNetworkInterface"],
         "Resource": [f"{ec2}:network-interface/*", f"{ec2}:subnet/*", f"{ec2}:security-group/*"]},
        {"Sid": "AttachInOwnSubnets", "Effect": "Allow", "Action": "ec2:CreateNetworkInterfacePermission",
         "Resource": f"{ec2}:network-interface/*",
         "Condition": {"ArnEquals": {"ec2:Subnet": [f"{ec2}:subnet/{s}" for s in subnet_ids]},
                       "StringEquals": {"ec2:AuthorizedService": "codebuild.amazonaws.com"}}},
        {"Sid": "BuildLogs", "Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": [log_group_arn, f"{log_group_arn}:*"]},
        {"Sid": "GitHubConnection", "Effect": "Allow",
         "Action": [f"{service}:GetConnection", f"{service}:GetConnectionToken", f"{service}:UseConnection"],
         "Resource": connection_arn},
    )


def flow_logs_policy(log_group_arn: str) -> dict:
    """VPC Flow Logs: write to one log group."""
    return _doc({"Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents",
                                               "logs:DescribeLogStreams"],
                 "Resource": [log_group_arn, f"{log_group_arn}:*"]})


# AWS-managed policies attached by ARN (they track AWS API changes; scoping is by role trust).
NODE_MANAGED_POLICIES = (
    "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy",
    "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryPullOnly",
    "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore",
)
CLUSTER_MANAGED_POLICIES = ("arn:aws:iam::aws:policy/AmazonEKSClusterPolicy",)
CNI_MANAGED_POLICY = "arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy"
EBS_CSI_MANAGED_POLICY = "arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"
