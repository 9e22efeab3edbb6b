"""Pure planners of the GCP layer, no mocks: `pytest tests/infra/gcp/test_pure.py`."""

from __future__ import annotations

import ipaddress
import json

import pytest

from gpu_train.spec import naming
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.settings import ClusterSettings, NetworkSettings, TeamSettings
from infra.gcp import (
    cluster,
    fabric,
    gpu_pools,
    identity,
    keys,
    network,
    node_addons,
    registry,
    services,
    settings_checks,
    storage,
)
from tests.infra.gcp.conftest import fabric_pool, stack_cfg

L4 = {"name": "l4", "instanceType": "g2-standard-8", "capacity": "spot", "maxNodes": 2}


def test_fabric_sets_share_by_kind_and_split_rdma_by_zone():
    cfg = stack_cfg([fabric_pool("hi", "a3-highgpu-8g"), fabric_pool("mega-a", "a3-megagpu-8g"),
                     fabric_pool("mega-b", "a3-megagpu-8g", capacity="reservation"),
                     fabric_pool("ultra", "a3-ultragpu-8g"), fabric_pool("b200", "a4-highgpu-8g", zone="us-central1-b")])
    sets = network.fabric_sets(cfg)
    assert sorted(sets) == ["rdma-us-central1-a", "rdma-us-central1-b", "tcpx", "tcpxo"]
    assert len(sets["tcpx"].nics()) == 4 and len(sets["tcpxo"].nics()) == 8
    ultra = sets["rdma-us-central1-a"]
    assert [v.rdma for v in ultra.vpcs] == [False, True]
    assert ultra.vpcs[1].zone == "us-central1-a" and len(ultra.vpcs[1].subnets) == 8
    cidrs = [ipaddress.IPv4Network(s.cidr) for fs in sets.values() for _, s in fs.nics()]
    assert len(cidrs) == 4 + 8 + 9 + 9
    for i, a in enumerate(cidrs):
        assert a.prefixlen == 24
        assert not any(a.overlaps(b) for b in cidrs[i + 1:])
    names = [s.k8s_network for fs in sets.values() for _, s in fs.nics()]
    assert len(set(names)) == len(names)


def test_fabric_subnets_skip_configured_ranges():
    cfg = stack_cfg([fabric_pool("mega", "a3-megagpu-8g")])
    cfg = cfg.model_copy(update={"network": NetworkSettings(
        vpc_cidr="192.168.0.0/22", pod_cidr="10.12.0.0/14", service_cidr="10.16.0.0/20")})
    subnets = [ipaddress.IPv4Network(s.cidr) for _, s in network.fabric_sets(cfg)["tcpxo"].nics()]
    assert not any(s.overlaps(ipaddress.IPv4Network("192.168.0.0/22")) for s in subnets)


def test_pools_without_fabric_have_no_set():
    cfg = stack_cfg([L4])
    assert network.fabric_sets(cfg) == {}
    assert network.pool_fabric_key(cfg.gpu_pools[0]) is None
    assert fabric.fabric_contract(None, "g2-standard-8").kind == "none"


def test_roce_profile_and_nat_logging():
    assert network.roce_network_profile("p", "us-central1-b") == \
        "projects/p/global/networkProfiles/us-central1-b-vpc-roce"
    assert network.nat_log_filter(True) == "ALL"
    assert network.nat_log_filter(False) == "ERRORS_ONLY"


@pytest.mark.parametrize(("machine", "kind", "nics"), [
    ("a3-highgpu-8g", "tcpx", 4), ("a3-megagpu-8g", "tcpxo", 8), ("a3-ultragpu-8g", "rdma", 9)])
def test_fabric_contract_per_machine(machine, kind, nics):
    cfg = stack_cfg([fabric_pool("p", machine)])
    sets = network.fabric_sets(cfg)
    fset = sets[network.pool_fabric_key(cfg.gpu_pools[0])]
    fab = fabric.fabric_contract(fset, machine)
    assert fab.kind == kind and fab.resources == {}
    assert fab.annotations["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(fab.annotations["networking.gke.io/interfaces"])
    assert interfaces[0] == {"interfaceName": "eth0", "network": "default"}
    # The pod's fabric interfaces name exactly the Network objects the layer hands the Kubernetes layer, one per
    # fabric NIC, in NIC order.
    objects = node_addons.network_objects(sets, {})
    params = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "GKENetworkParamSet"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Network"] == list(params)
    assert [i["network"] for i in interfaces[1:]] == list(params)
    assert [i["interfaceName"] for i in interfaces[1:]] == [f"eth{i}" for i in range(1, nics + 1)]
    modes = [spec["deviceMode"] for spec in params.values()]
    if kind == "rdma":
        assert modes == ["NetDevice"] + ["RDMA"] * 8
        assert fab.nccl_env["NCCL_NET"] == "gIB" and fab.sidecars == []
        assert "/usr/local/gib/lib64" in fab.nccl_env["LD_LIBRARY_PATH"]
    else:
        assert set(modes) == {"NetDevice"}
        (sidecar,) = fab.sidecars
        assert sidecar["restartPolicy"] == "Always"
        assert sidecar["image"].rsplit(":", 1)[1].startswith("v")
        assert sidecar["name"] == f"{kind}-daemon"
        # Requests count toward the pod (native sidecar); a memory limit bounds a leak.
        req, lim = sidecar["resources"]["requests"], sidecar["resources"]["limits"]
        assert req["cpu"] and req["memory"] and lim["memory"]
        assert sidecar["image"].startswith(f"us-docker.pkg.dev/gce-ai-infra/gpudirect-{kind}/")
        ifname_key = "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME" if kind == "tcpx" else "NCCL_FASTRAK_IFNAME"
        assert fab.nccl_env[ifname_key] == ",".join(f"eth{i}" for i in range(1, nics + 1))
    assert fab.nccl_env["NCCL_CROSS_NIC"] == "0"
    mounted = {m["name"] for m in fab.volume_mounts} | {m["name"] for s in fab.sidecars for m in s["volumeMounts"]}
    assert mounted <= {v["name"] for v in fab.volumes}
    assert {"name": "nvidia-lib", "hostPath": {"path": "/home/kubernetes/bin/nvidia/lib64"}} in fab.volumes


def test_capacity_and_autoscaling():
    spot, res, od = (stack_cfg([fabric_pool("s", "a3-megagpu-8g"),
                                fabric_pool("r", "a3-megagpu-8g", capacity="reservation"),
                                fabric_pool("o", "a3-megagpu-8g", capacity="on-demand")]).gpu_pools)
    assert gpu_pools.capacity_settings(spot) == {"spot": True}
    assert gpu_pools.capacity_settings(res)["reservation_affinity"] == {
        "consume_reservation_type": "SPECIFIC_RESERVATION",
        "key": "compute.googleapis.com/reservation-name", "values": ["r-res"]}
    assert "spot" not in gpu_pools.capacity_settings(od)
    assert gpu_pools.autoscaling_settings(spot)["location_policy"] == "ANY"
    assert gpu_pools.autoscaling_settings(res) == {"total_min_node_count": 0, "total_max_node_count": 2,
                                                   "location_policy": "BALANCED"}
    assert gpu_pools.node_labels(spot, "tcpxo")[naming.POOL_LABEL] == "s"


def test_trainer_grants_are_prefix_scoped():
    grants = identity.bucket_grants("trainer/research")
    writes = [g for g in grants if g.role == identity.OBJECT_USER]
    assert [(g.bucket, g.prefix) for g in writes] == [("checkpoints", "research")]
    assert all(g.bucket != "artifacts" for g in grants)
    assert identity.prefix_condition("b", "research")["expression"] == \
        'resource.name.startsWith("projects/_/buckets/b/objects/research/")'
    # A team's sweep controllers write its checkpoints prefix only, and read no dataset.
    sweeps = identity.bucket_grants("sweeps/research")
    assert [(g.bucket, g.role, g.prefix) for g in sweeps if g.role == identity.OBJECT_USER] == [
        ("checkpoints", identity.OBJECT_USER, "research")]
    assert {g.bucket for g in sweeps} == {"checkpoints"}
    # A team's Ray pods preparing data: read datasets, write only the team's prefix of it; no checkpoints.
    prep = identity.bucket_grants("data-prep/research")
    assert [(g.bucket, g.prefix) for g in prep if g.role == identity.OBJECT_USER] == [("datasets", "research")]
    assert {g.bucket for g in prep} == {"datasets"}
    assert [g.bucket for g in identity.bucket_grants("cache")] == ["datasets"]
    assert identity.bucket_grants("cache")[0].role == identity.OBJECT_VIEWER
    assert [g.bucket for g in identity.bucket_grants("mlflow")] == ["artifacts"]
    with pytest.raises(KeyError, match="nobody"):
        identity.bucket_grants("nobody")
    assert identity.wi_member("p", "team-x", "trainer") == "serviceAccount:p.svc.id.goog[team-x/trainer]"


def test_keys_storage_registry_cluster_helpers():
    agents = keys.service_agents("42")
    assert agents["gke"] == "serviceAccount:service-42@container-engine-robot.iam.gserviceaccount.com"
    assert agents["disks"] == "serviceAccount:service-42@compute-system.iam.gserviceaccount.com"
    assert set(agents) == set(keys.KEY_USES)
    ckpt = storage.lifecycle_rules("checkpoints", "prod")
    assert {r["action"]["type"] for r in ckpt} == {"Delete", "AbortIncompleteMultipartUpload"}
    # Old checkpoint versions: two weeks in prod, three days in dev.
    assert [r["condition"]["days_since_noncurrent_time"] for r in ckpt if r["action"]["type"] == "Delete"] == [14]
    assert [r["condition"]["days_since_noncurrent_time"] for r in storage.lifecycle_rules("checkpoints", "dev")
            if r["action"]["type"] == "Delete"] == [3]
    assert [r["action"]["type"] for r in storage.lifecycle_rules("datasets", "prod")] == \
        ["AbortIncompleteMultipartUpload"]
    assert storage.bucket_name("gcp-dev", "checkpoints", "acme-ml-dev") == "gpu-train-gcp-dev-checkpoints-acme-ml-dev"
    assert len(storage.bucket_name("gcp-" + "x" * 80, "checkpoints", "acme-ml-test")) <= 63
    ex = cluster.maintenance_exclusion()
    assert ex["exclusion_options"]["scope"] == "NO_MINOR_OR_NODE_UPGRADES"
    kc = json.loads(cluster.kubeconfig("c", "gke-0123abcd-42.us-central1.gke.goog"))
    assert kc["users"][0]["user"]["exec"]["command"] == "gke-gcloud-auth-plugin"
    # The DNS endpoint serves a publicly trusted certificate: no CA bundle, no IP address.
    assert kc["clusters"][0]["cluster"] == {"server": "https://gke-0123abcd-42.us-central1.gke.goog"}
    with pytest.raises(ValueError, match="no DNS-based control-plane endpoint"):
        cluster.kubeconfig("c", "")
    zones = ("us-central1-a", "us-central1-b")
    assert cluster.location("us-central1", zones, regional=False) == "us-central1-a"
    assert cluster.location("us-central1", zones, regional=True) == "us-central1"
    private = ClusterSettings(public_access_cidrs=("203.0.113.0/24",))
    assert cluster.authorized_networks("10.10.0.0/20", private) == [{"cidr_block": "10.10.0.0/20",
                                                                      "display_name": "nodes"}]
    public = private.model_copy(update={"endpoint_public_access": True})
    assert [n["cidr_block"] for n in cluster.authorized_networks("10.10.0.0/20", public)] == \
        ["10.10.0.0/20", "203.0.113.0/24"]


def test_gke_security_group_comes_from_the_team_groups_domain():
    cfg = stack_cfg([L4])
    assert settings_checks.gke_security_group(cfg.teams) is None  # the test stack's team names no group
    team = TeamSettings(name="research", gpu_quota=1, submitters=("ml-research@corp.example.org",),
                             viewers=("ML-Platform@Corp.Example.Org",))
    # https://cloud.google.com/kubernetes-engine/docs/how-to/google-groups-rbac: one
    # gke-security-groups@<domain> group per cluster.
    assert settings_checks.gke_security_group([team]) == "gke-security-groups@corp.example.org"
    other = TeamSettings(name="applied", gpu_quota=1, viewers=("ml@other.example.net",))
    with pytest.raises(SettingsError, match=r"several domains.*teams\[1\]\.viewers\[0\]"):
        settings_checks.gke_security_group([team, other])
    bare = TeamSettings(name="x", gpu_quota=1, submitters=("ml-research",))
    with pytest.raises(SettingsError, match=r"gpu-train:teams\[0\]\.submitters\[0\] must be a Google group"):
        settings_checks.gke_security_group([bare])


def test_build_cache_repository_cleanup_keeps_the_newest_and_expires_the_rest():
    policies = {p["id"]: p for p in registry.cache_cleanup_policies()}
    assert policies["keep-newest"]["action"] == "KEEP"
    assert policies["keep-newest"]["most_recent_versions"]["keep_count"] >= 1
    deletes = [p["condition"] for p in policies.values() if p["action"] == "DELETE"]
    # Durations in the API's seconds form; superseded (untagged) caches go first, stale ones later.
    ages = {c["tag_state"]: int(c["older_than"].removesuffix("s")) for c in deletes}
    assert ages == {"UNTAGGED": 86400, "ANY": 30 * 86400}


def test_required_apis_follow_the_features():
    apis = services.required_apis(managed_database=False)
    for api in ("compute.googleapis.com", "container.googleapis.com", "cloudkms.googleapis.com",
                "artifactregistry.googleapis.com", "storage.googleapis.com", "iam.googleapis.com",
                "iamcredentials.googleapis.com", "cloudresourcemanager.googleapis.com", "dns.googleapis.com"):
        assert api in apis
    assert "sqladmin.googleapis.com" not in apis
    managed = services.required_apis(managed_database=True)
    assert set(managed) - set(apis) == {"sqladmin.googleapis.com", "servicenetworking.googleapis.com"}
    assert list(apis) == sorted(set(apis))


def test_every_key_agent_belongs_to_an_enabled_api():
    assert set(keys.AGENT_APIS) == set(keys.KEY_USES)
    assert set(keys.AGENT_APIS.values()) - {"sqladmin.googleapis.com"} <= set(services.required_apis(False))
    assert set(keys.AGENT_APIS.values()) <= set(services.required_apis(True))
