"""RDS for MLflow, the Load Balancer Controller and identity egress: `pytest tests/infra/aws/test_database.py`.

Pure helpers without mocks; the aws-* plans (shared `plans` fixture) for what the stacks create;
`build_platform` under mocks for the contract values the Kubernetes layer reads.
"""

from __future__ import annotations

import ipaddress
import json

import pulumi
import pytest

from gpu_train.spec.settings import MlflowSettings
from infra.aws import database, iam, keys, load_balancer, network
from tests.conftest import resources_of
from tests.infra.aws.conftest import stack_cfg
from tests.infra.aws.test_components import _run

ZONES = ["us-east-1a", "us-east-1b", "us-east-1c"]


def test_database_subnets_are_small_disjoint_and_inside_the_vpc():
    for vpc_cidr in ("10.10.0.0/16", "10.0.0.0/20"):
        plan = network.plan_subnets(vpc_cidr, "100.64.0.0/16", ZONES)
        vpc = ipaddress.ip_network(vpc_cidr)
        nets = []
        for z in plan:
            db = ipaddress.ip_network(z.database)
            assert db.subnet_of(vpc) and 24 <= db.prefixlen <= 28
            nets += [ipaddress.ip_network(c) for c in (z.private, z.public, z.pods, z.database)]
        for i, a in enumerate(nets):
            for b in nets[i + 1:]:
                assert not a.overlaps(b), (a, b)


def test_rds_key_is_usable_only_through_rds():
    policy = keys.key_policy("rds", account_id="111122223333", region="eu-west-1")
    (via,) = [s for s in policy["Statement"] if s["Sid"] != "AccountAdministration"]
    assert via["Condition"]["StringEquals"]["kms:ViaService"] == "rds.eu-west-1.amazonaws.com"
    assert via["Condition"]["StringEquals"]["kms:CallerAccount"] == "111122223333"
    assert "kms:*" not in json.dumps(via)


def test_instance_settings_by_environment():
    prod = database.instance_settings(is_prod=True, storage_gb=5)
    dev = database.instance_settings(is_prod=False, storage_gb=100)
    assert prod.multi_az and prod.deletion_protection and prod.backup_retention_days >= 14
    assert prod.allocated_storage == database.MIN_STORAGE_GB  # raised to the gp3 minimum
    assert not dev.multi_az and not dev.deletion_protection and dev.allocated_storage == 100
    assert dev.max_allocated_storage > dev.allocated_storage
    with pytest.raises(ValueError, match="mlflow.storageGb"):
        database.instance_settings(is_prod=True, storage_gb=0)
    assert database.parameters()["rds.force_ssl"] == "1"
    a, b = database.generate_password(), database.generate_password()
    assert a != b and len(a) == 48 and not set(a) & set('/@" ')


def test_lb_controller_policy_is_scoped_and_keyed_on_its_tag():
    policy = iam.load_balancer_controller_policy(region="us-east-1", account_id="111122223333")
    text = json.dumps(policy)
    assert "waf" not in text and "shield" not in text and "cognito" not in text
    # Outposts customer-owned IPs and IPAM pools are off too.
    assert "Coip" not in text and "ModifyIpPools" not in text
    for s in policy["Statement"]:
        resources = s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]
        for r in resources:
            # IAM is global: its ARNs carry the account but no region.
            assert r == "*" or ":us-east-1:111122223333:" in r or r.startswith("arn:aws:iam::111122223333:"), \
                (s["Sid"], r)
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        destructive = {"ec2:DeleteSecurityGroup", "elasticloadbalancing:DeleteLoadBalancer",
                       "elasticloadbalancing:DeleteTargetGroup", "elasticloadbalancing:CreateLoadBalancer"}
        if destructive & set(actions):
            assert iam.LB_CONTROLLER_TAG in json.dumps(s["Condition"]), s["Sid"]
    slr = next(s for s in policy["Statement"] if s["Action"] == "iam:CreateServiceLinkedRole")
    assert slr["Condition"]["StringEquals"]["iam:AWSServiceName"] == "elasticloadbalancing.amazonaws.com"


def test_lb_controller_values_pin_vpc_region_and_system_nodes():
    values = load_balancer.helm_values(cluster_name="c", region="us-east-1", vpc_id="vpc-1",
                                       system_selector={"gpu-train.io/system": "true"})
    assert (values["clusterName"], values["region"], values["vpcId"]) == ("c", "us-east-1", "vpc-1")
    assert values["nodeSelector"] == {"gpu-train.io/system": "true"}
    assert values["serviceAccount"]["name"] == load_balancer.SERVICE_ACCOUNT
    assert not (values["enableShield"] or values["enableWaf"] or values["enableWafv2"])


def test_prod_plan_has_private_encrypted_rds_with_its_own_key(plans):
    plan = plans["aws-prod"]
    (inst,) = [r["inputs"] for r in resources_of(plan, "aws:rds/instance:Instance")]
    assert inst["storageEncrypted"] is True and inst["publiclyAccessible"] is False
    assert inst["multiAz"] is True and inst["deletionProtection"] is True and inst["backupRetentionPeriod"] >= 7
    assert inst["engine"] == "postgres" and inst["engineVersion"].startswith("16.")
    assert inst["password"] == "[secret]"
    assert inst["kmsKeyId"] == inst["performanceInsightsKmsKeyId"]
    rds_keys = [r for r in resources_of(plan, "aws:kms/key:Key") if r["inputs"]["tags"].get("purpose") == "rds"]
    assert len(rds_keys) == 1 and rds_keys[0]["inputs"]["enableKeyRotation"] is True
    aliases = [r["inputs"]["name"] for r in resources_of(plan, "aws:kms/alias:Alias")]
    assert "alias/gpu-train-aws-prod-rds" in aliases
    (sg,) = [r["inputs"] for r in resources_of(plan, "aws:ec2/securityGroup:SecurityGroup")
             if "PostgreSQL" in r["inputs"]["description"]]
    assert sg["egress"] == []
    for rule in sg["ingress"]:
        assert (rule["fromPort"], rule["toPort"]) == (5432, 5432)
        assert "0.0.0.0/0" not in rule["cidrBlocks"]
    (group,) = [r["inputs"] for r in resources_of(plan, "aws:rds/subnetGroup:SubnetGroup")]
    assert len(group["subnetIds"]) == 3
    # Database subnets route only inside the VPC.
    db_rt = [r for r in resources_of(plan, "aws:ec2/routeTable:RouteTable") if r["name"] == "network-database"]
    assert db_rt and not [r for r in resources_of(plan, "aws:ec2/route:Route") if "database" in r["name"]]


def test_dev_plan_keeps_mlflow_in_cluster(plans):
    plan = plans["aws-dev"]
    assert not resources_of(plan, "aws:rds/instance:Instance")
    assert not [r for r in resources_of(plan, "aws:kms/key:Key") if r["inputs"]["tags"].get("purpose") == "rds"]


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod"])
def test_plans_install_the_lb_controller(plans, stack):
    (release,) = [r["inputs"] for r in resources_of(plans[stack], "kubernetes:helm.sh/v3:Release")
                  if r["inputs"]["chart"] == load_balancer.CHART]
    assert release["version"] == load_balancer.CHART_VERSION and release["namespace"] == "kube-system"
    assert release["repositoryOpts"]["repo"] == load_balancer.CHART_REPO
    assert release["values"]["vpcId"] and release["values"]["clusterName"] == f"gpu-train-{stack}"
    (assoc,) = [r["inputs"] for r in resources_of(plans[stack], "aws:eks/podIdentityAssociation:PodIdentityAssociation")
                if r["inputs"]["serviceAccount"] == load_balancer.SERVICE_ACCOUNT]
    assert assoc["namespace"] == "kube-system"


POOL = [{"name": "l4", "instanceType": "g6.2xlarge", "capacity": "spot", "maxNodes": 8}]


@pulumi.runtime.test
def test_build_platform_contract_with_managed_database():
    base = stack_cfg(POOL)
    platform, monitor = _run(base.model_copy(update={"mlflow": MlflowSettings(database="managed")}))
    assert [(t.cidr, t.port) for t in platform.workload_identity_egress] == [("169.254.170.23/32", 80)]
    assert platform.internal_lb_annotations["service.beta.kubernetes.io/aws-load-balancer-type"] == "external"
    assert "lb-controller" in [r._name for r in platform.ready]
    db = platform.mlflow_database
    assert db is not None and db.port == 5432 and db.sslmode == "require"
    plan = network.plan_subnets(base.network.vpc_cidr, base.network.pod_cidr, base.zones)
    assert list(db.cidrs) == [z.database for z in plan]

    def check(values):
        host, password, user = values[-3:]
        assert host.endswith(".us-west-2.rds.amazonaws.com")
        assert len(password) == 48 and user == "mlflow"
        (inst,) = [i for _, i in monitor.of("aws:rds/instance:Instance")]
        assert inst["dbSubnetGroupName"] and inst["kmsKeyId"].startswith("arn:aws:kms:us-west-2:")
        # Two zones in this stack: the subnet group spans both database subnets.
        (group,) = [i for _, i in monitor.of("aws:rds/subnetGroup:SubnetGroup")]
        assert len(group["subnetIds"]) == 2

    return pulumi.Output.all(*[r.urn for r in platform.ready], db.host, db.password, db.username).apply(check)


@pulumi.runtime.test
def test_build_platform_in_cluster_mlflow_has_no_database():
    platform, monitor = _run(stack_cfg(POOL))
    assert platform.mlflow_database is None

    def check(_):
        assert not monitor.of("aws:rds/instance:Instance")
        assert not monitor.of("aws:rds/subnetGroup:SubnetGroup")

    return pulumi.Output.all(*[r.urn for r in platform.ready]).apply(check)
