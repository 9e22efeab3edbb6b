"""The whole program for gcp-dev and gcp-prod through the plan tool: `pytest tests/infra/gcp/test_plan_gcp.py`."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, resources_of

STACKS = ["gcp-dev", "gcp-prod"]


def one(plan, typ, name_part=""):
    (res,) = [r for r in resources_of(plan, typ) if name_part in r["name"]]
    return res["inputs"]


@pytest.mark.parametrize("stack", STACKS)
def test_network_is_private_and_closed(plans, stack):
    plan = plans[stack]
    subnet = one(plan, "gcp:compute/subnetwork:Subnetwork", "network-nodes")
    assert subnet["privateIpGoogleAccess"] is True
    assert {r["rangeName"] for r in subnet["secondaryIpRanges"]} == {"pods", "services"}
    nat = one(plan, "gcp:compute/routerNat:RouterNat")
    assert nat["logConfig"]["enable"] is True
    for fw in resources_of(plan, "gcp:compute/firewall:Firewall"):
        ranges = fw["inputs"].get("sourceRanges") or []
        assert fw["inputs"]["direction"] == "INGRESS"
        assert ranges and all(ipaddress.ip_network(c).prefixlen > 0 for c in ranges), fw["name"]
    hc = one(plan, "gcp:compute/firewall:Firewall", "health-checks")
    assert set(hc["sourceRanges"]) == {"35.191.0.0/16", "130.211.0.0/22"}


@pytest.mark.parametrize("stack", STACKS)
def test_everything_is_encrypted_with_our_keys(plans, stack):
    plan = plans[stack]
    keys = resources_of(plan, "gcp:kms/cryptoKey:CryptoKey")
    # The sql key exists only where the stack asks for a managed MLflow database (gcp-prod).
    managed_db = stack == "gcp-prod"
    assert len(keys) == (5 if managed_db else 4) and all(k["inputs"]["rotationPeriod"] == "7776000s" for k in keys)
    members = {g["inputs"]["member"] for g in resources_of(plan, "gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember")}
    assert {m.split("@")[1] for m in members} == {
        "container-engine-robot.iam.gserviceaccount.com", "gs-project-accounts.iam.gserviceaccount.com",
        "gcp-sa-artifactregistry.iam.gserviceaccount.com", "compute-system.iam.gserviceaccount.com",
        *(["gcp-sa-cloud-sql.iam.gserviceaccount.com"] if managed_db else [])}
    buckets = resources_of(plan, "gcp:storage/bucket:Bucket")
    assert len(buckets) == 3
    for b in buckets:
        i = b["inputs"]
        assert i["encryption"]["defaultKmsKeyName"].endswith("/cryptoKeys/storage")
        assert i["uniformBucketLevelAccess"] is True and i["publicAccessPrevention"] == "enforced"
        assert i["softDeletePolicy"]["retentionDurationSeconds"] > 0
        assert i["labels"]["stack"] == stack
    ckpt = next(b["inputs"] for b in buckets if "checkpoints" in b["name"])
    assert ckpt["versioning"]["enabled"] is True
    assert {r["action"]["type"] for r in ckpt["lifecycleRules"]} == {"Delete", "AbortIncompleteMultipartUpload"}
    repo = one(plan, "gcp:artifactregistry/repository:Repository", "registry-docker")
    assert repo["kmsKeyName"].endswith("/cryptoKeys/registry") and repo["dockerConfig"]["immutableTags"] is True
    assert {p["action"] for p in repo["cleanupPolicies"]} == {"KEEP", "DELETE"}
    # The build cache's tag is overwritten by every build: its own mutable repository, same key.
    cache = one(plan, "gcp:artifactregistry/repository:Repository", "registry-cache")
    assert cache["dockerConfig"]["immutableTags"] is False and cache["kmsKeyName"] == repo["kmsKeyName"]
    assert {p["action"] for p in cache["cleanupPolicies"]} == {"KEEP", "DELETE"}
    gke = one(plan, "gcp:container/cluster:Cluster")
    assert gke["databaseEncryption"] == {"state": "ENCRYPTED", "keyName": gke["databaseEncryption"]["keyName"]}
    assert gke["databaseEncryption"]["keyName"].endswith("/cryptoKeys/gke")
    for pool in resources_of(plan, "gcp:container/nodePool:NodePool"):
        assert pool["inputs"]["nodeConfig"]["bootDiskKmsKey"].endswith("/cryptoKeys/disks")
        assert pool["inputs"]["nodeConfig"]["shieldedInstanceConfig"] == {
            "enableSecureBoot": True, "enableIntegrityMonitoring": True}
        assert pool["inputs"]["nodeConfig"]["workloadMetadataConfig"]["mode"] == "GKE_METADATA"


@pytest.mark.parametrize("stack", STACKS)
def test_cluster_is_private_with_workload_identity(plans, stack):
    gke = one(plans[stack], "gcp:container/cluster:Cluster")
    assert gke["privateClusterConfig"]["enablePrivateNodes"] is True
    settings = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]["gpu-train:cluster"]
    public = settings.get("endpointPublicAccess", False)
    assert gke["privateClusterConfig"]["enablePrivateEndpoint"] is (not public)
    cidrs = {c["cidrBlock"] for c in gke["masterAuthorizedNetworksConfig"]["cidrBlocks"]}
    assert "0.0.0.0/0" not in cidrs
    assert set(settings.get("publicAccessCidrs", [])) <= cidrs
    assert gke["workloadIdentityConfig"]["workloadPool"].endswith(".svc.id.goog")
    assert gke["datapathProvider"] == "ADVANCED_DATAPATH" and gke["enableShieldedNodes"] is True
    assert gke["removeDefaultNodePool"] is True and gke["initialNodeCount"] == 1
    (exclusion,) = gke["maintenancePolicy"]["maintenanceExclusions"]
    assert exclusion["exclusionOptions"]["scope"] == "NO_MINOR_OR_NODE_UPGRADES"
    assert gke.get("enableMultiNetworking") is (True if stack == "gcp-prod" else None)  # fabric pools
    # CI and operators reach the API through the IAM-authorized DNS endpoint, not an IP.
    assert gke["controlPlaneEndpointsConfig"] == {"dnsEndpointConfig": {"allowExternalTraffic": True}}
    # Team groups in RBAC need Google Groups for RBAC (the stacks' groups share one domain).
    groups = {g.split("@")[1] for r in resources_of(plans[stack], "kubernetes:rbac.authorization.k8s.io/v1:RoleBinding")
              for g in (sub["name"] for sub in r["inputs"].get("subjects", []) if sub["kind"] == "Group")}
    assert gke.get("authenticatorGroupsConfig") == (
        {"securityGroup": f"gke-security-groups@{groups.pop()}"} if groups else None)
    system = one(plans[stack], "gcp:container/nodePool:NodePool", "cluster-system")
    assert system["nodeConfig"]["labels"] == {"gpu-train.io/system": "true"}
    roles = {r["inputs"]["role"] for r in resources_of(plans[stack], "gcp:projects/iAMMember:IAMMember")}
    assert roles == {"roles/logging.logWriter", "roles/monitoring.metricWriter", "roles/monitoring.viewer",
                     "roles/stackdriver.resourceMetadata.writer"}


def test_prod_a3_mega_pools_get_tcpxo_fabric(plans):
    plan = plans["gcp-prod"]
    vpcs = [r["inputs"] for r in resources_of(plan, "gcp:compute/network:Network") if "tcpxo" in r["name"]]
    assert len(vpcs) == 8 and all(v["mtu"] == 8244 for v in vpcs)
    for name, capacity in (("h100-reserved", "reservation"), ("h100-spot", "spot")):
        pool = one(plan, "gcp:container/nodePool:NodePool", f"gpu-{name}-pool")
        node = pool["nodeConfig"]
        assert len(pool["networkConfig"]["additionalNodeNetworkConfigs"]) == 8
        assert node["localNvmeSsdBlockConfig"]["localSsdCount"] == 16
        assert pool["placementPolicy"]["type"] == "COMPACT" and pool["nodeLocations"] == ["us-central1-a"]
        assert node["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}]
        assert node["guestAccelerators"][0]["gpuDriverInstallationConfig"]["gpuDriverVersion"] == "LATEST"
        assert node["gvnic"]["enabled"] is True
        assert pool["autoscaling"]["locationPolicy"] == ("ANY" if capacity == "spot" else "BALANCED")
        if capacity == "spot":
            assert node["spot"] is True
        else:
            assert node["reservationAffinity"]["consumeReservationType"] == "SPECIFIC_RESERVATION"


def test_dev_l4_pool_scales_from_zero_without_fabric(plans):
    pool = one(plans["gcp-dev"], "gcp:container/nodePool:NodePool", "gpu-l4-spot")
    assert pool["autoscaling"]["totalMinNodeCount"] == 0 and "networkConfig" not in pool
    assert pool["nodeConfig"]["localNvmeSsdBlockConfig"]["localSsdCount"] == 1


@pytest.mark.parametrize("stack", STACKS)
def test_workload_identity_and_checkpoint_prefix(plans, stack):
    plan = plans[stack]
    wi = {r["inputs"]["member"] for r in resources_of(plan, "gcp:serviceaccount/iAMMember:IAMMember")
          if r["inputs"]["role"] == "roles/iam.workloadIdentityUser"}
    project = "acme-ml-dev" if stack == "gcp-dev" else "acme-ml-prod"
    teams = ["research"] if stack == "gcp-dev" else ["research", "applied"]
    expected = {f"serviceAccount:{project}.svc.id.goog[{ns}]" for ns in
                ["alluxio/alluxio", "mlflow/mlflow", *[f"team-{t}/trainer" for t in teams],
                 *[f"team-{t}/sweep-controller" for t in teams], *[f"team-{t}/data-prep" for t in teams]]}
    assert wi == expected
    grants = resources_of(plan, "gcp:storage/bucketIAMMember:BucketIAMMember")
    writers = [g["inputs"] for g in grants if g["inputs"]["role"] in ("roles/storage.objectUser",
                                                                     "roles/storage.objectAdmin")]
    ckpt_writers = [g for g in writers if "checkpoints" in g["bucket"]]
    assert len(ckpt_writers) == 2 * len(teams)  # each team's trainer and its sweep controllers
    for g in ckpt_writers:
        expr = g["condition"]["expression"]
        assert expr.startswith(f'resource.name.startsWith("projects/_/buckets/{g["bucket"]}/objects/')
        assert any(expr.endswith(f'/objects/{t}/")') for t in teams)
    # Only each team's data preparation writes the datasets bucket, under its own prefix; only mlflow writes artifacts.
    ds_writers = [g for g in writers if "datasets" in g["bucket"]]
    from infra.gcp.identity import account_id

    assert {g["member"] for g in ds_writers} == {
        f"serviceAccount:{account_id(stack, f'data-prep/{t}')}@{project}.iam.gserviceaccount.com" for t in teams}
    assert {g["condition"]["expression"].rsplit("/objects/", 1)[1] for g in ds_writers} == {f'{t}/")' for t in teams}
    assert all("mlflow" in g["member"] for g in writers if "artifacts" in g["bucket"])


def test_team_groups_of_two_domains_fail_the_plan_naming_the_setting(tmp_path):
    """Google Groups for RBAC takes one gke-security-groups@<domain>: the plan refuses a second domain."""
    source = sorted(ROOT.glob("stacks/**/Pulumi.gcp-dev.yaml"))[0]
    doc = yaml.safe_load(source.read_text())
    doc["config"]["gpu-train:teams"][0]["viewers"] = ["ops@ml-platform-team.dev"]
    path = tmp_path / "Pulumi.gcp-two-domains.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack-file", str(path), "--out", str(tmp_path),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu-train:teams[0].viewers[0]" in proc.stderr and "several domains" in proc.stderr
    assert "Traceback" not in proc.stderr
