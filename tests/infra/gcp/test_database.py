"""Cloud SQL for MLflow, Private Service Access and metadata egress: `pytest tests/infra/gcp/test_database.py`.

Pure helpers without mocks; the gcp-* plans for what the stacks create; `build_platform` under mocks
for the contract values the Kubernetes layer reads.
"""

from __future__ import annotations

import asyncio
import ipaddress

import pulumi
import pytest

from gpu_train.spec import naming
from gpu_train.spec.settings import MlflowSettings
from infra.gcp import database, keys, network
from infra.mocks import MockContext, PlanMocks
from tests.conftest import resources_of
from tests.infra.gcp.conftest import stack_cfg

POOL = [{"name": "l4", "instanceType": "g2-standard-8", "capacity": "spot", "maxNodes": 2}]


def test_psa_range_avoids_every_stack_range():
    cfg = stack_cfg(POOL)
    cidr = ipaddress.ip_network(network.psa_range(cfg))
    assert cidr.prefixlen == network.PSA_PREFIX and cidr.subnet_of(ipaddress.ip_network(network.PSA_BLOCK))
    for taken in (cfg.network.vpc_cidr, cfg.network.pod_cidr, cfg.network.service_cidr, cfg.cluster.master_cidr):
        assert not cidr.overlaps(ipaddress.ip_network(taken))
    # A stack that uses the top of 10/8 pushes the range below it.
    high = cfg.model_copy(update={"network": cfg.network.model_copy(update={"vpc_cidr": "10.255.240.0/20"})})
    moved = ipaddress.ip_network(network.psa_range(high))
    assert not moved.overlaps(ipaddress.ip_network("10.255.240.0/20")) and moved != cidr
    full = cfg.model_copy(update={"network": cfg.network.model_copy(update={"pod_cidr": "10.0.0.0/8"})})
    with pytest.raises(ValueError, match="Private Service Access"):
        network.psa_range(full)
    assert database.psa_address("10.255.240.0/20") == ("10.255.240.0", 20)


def test_instance_settings_and_sql_agent():
    prod = database.instance_settings(is_prod=True, storage_gb=5)
    dev = database.instance_settings(is_prod=False, storage_gb=50)
    assert prod.availability_type == "REGIONAL" and prod.deletion_protection and prod.disk_gb == database.MIN_DISK_GB
    assert dev.availability_type == "ZONAL" and not dev.deletion_protection and dev.disk_gb == 50
    with pytest.raises(ValueError, match="mlflow.storageGb"):
        database.instance_settings(is_prod=True, storage_gb=0)
    assert keys.service_agents("42")["sql"] == "serviceAccount:service-42@gcp-sa-cloud-sql.iam.gserviceaccount.com"


def test_prod_plan_has_private_cmek_tls_only_cloud_sql(plans):
    plan = plans["gcp-prod"]
    (inst,) = [r["inputs"] for r in resources_of(plan, "gcp:sql/databaseInstance:DatabaseInstance")]
    s = inst["settings"]
    assert inst["databaseVersion"] == "POSTGRES_16" and inst["deletionProtection"] is True
    ip = s["ipConfiguration"]
    assert ip["ipv4Enabled"] is False and ip["sslMode"] == "ENCRYPTED_ONLY" and ip["privateNetwork"]
    assert s["availabilityType"] == "REGIONAL"
    assert s["backupConfiguration"]["enabled"] and s["backupConfiguration"]["pointInTimeRecoveryEnabled"]
    assert s["userLabels"]["cost-center"] == "ml-platform"  # the stack's tags reach the instance
    assert inst["encryptionKeyName"].endswith("/cryptoKeys/sql")
    sql_keys = [r["inputs"] for r in resources_of(plan, "gcp:kms/cryptoKey:CryptoKey") if r["inputs"]["name"] == "sql"]
    assert len(sql_keys) == 1 and sql_keys[0]["rotationPeriod"]
    grants = [r["inputs"] for r in resources_of(plan, "gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember")
              if r["inputs"]["cryptoKeyId"].endswith("/cryptoKeys/sql")]
    assert [g["member"] for g in grants] == [keys.service_agents("123456789012")["sql"]]
    (addr,) = [r["inputs"] for r in resources_of(plan, "gcp:compute/globalAddress:GlobalAddress")]
    assert addr["purpose"] == "VPC_PEERING" and addr["prefixLength"] == network.PSA_PREFIX
    (conn,) = [r["inputs"] for r in resources_of(plan, "gcp:servicenetworking/connection:Connection")]
    assert conn["reservedPeeringRanges"] == [addr["name"]]
    (user,) = [r["inputs"] for r in resources_of(plan, "gcp:sql/user:User")]
    assert user["name"] == "mlflow" and user["password"] == "[secret]"
    assert [r["inputs"]["name"] for r in resources_of(plan, "gcp:sql/database:Database")] == ["mlflow"]


def test_dev_plan_keeps_mlflow_in_cluster(plans):
    plan = plans["gcp-dev"]
    assert not resources_of(plan, "gcp:sql/databaseInstance:DatabaseInstance")
    assert not [r for r in resources_of(plan, "gcp:kms/cryptoKey:CryptoKey") if r["inputs"]["name"] == "sql"]


def _run(cfg):
    asyncio.set_event_loop(asyncio.new_event_loop())
    pulumi.runtime.set_mocks(PlanMocks(MockContext(region=cfg.region, project=cfg.project)), project="gpu-train",
                             stack=cfg.stack, preview=False)
    from infra.gcp import build_platform
    return build_platform(cfg, naming.common_tags(cfg.stack, cfg.environment, cfg.tags))


@pulumi.runtime.test
def test_build_platform_contract_with_managed_database():
    cfg = stack_cfg(POOL).model_copy(update={"mlflow": MlflowSettings(database="managed")})
    platform = _run(cfg)
    assert [(t.cidr, t.port) for t in platform.workload_identity_egress] == [
        ("169.254.169.254/32", 80), ("169.254.169.252/32", 988)]
    db = platform.mlflow_database
    assert db is not None and list(db.cidrs) == [network.psa_range(cfg)] and db.sslmode == "require"

    def check(values):
        host, password, user = values
        ipaddress.ip_address(host)
        assert len(password) == 48 and user == "mlflow"

    return pulumi.Output.all(db.host, db.password, db.username).apply(check)


# pulumi.runtime.test waits for the registrations the build started; without it they stay pending in
# Pulumi's global runtime state and the next program run under mocks (the Kubernetes layer's fixture)
# waits for them forever.
@pulumi.runtime.test
def test_build_platform_in_cluster_mlflow_has_no_database():
    platform = _run(stack_cfg(POOL))
    assert platform.mlflow_database is None
    assert len(platform.workload_identity_egress) == 2
