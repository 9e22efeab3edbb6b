"""GPU machine and fabric network rules from Google's docs: `pytest tests/policies/plan/test_gcp_gpu.py`.

Hand-built records exercise each rule of policies/plan/gcp_gpu.py; every GCP plan of the session
must pass them all, and broken copies (a firewall rule on the RoCE VPC, a wrong MTU, a missing
NIC, a pool outside the profile's zone, a Persistent Disk boot disk on A3 Ultra, a wrong
deviceMode) must fail.
"""

from __future__ import annotations

import copy
import json

import pytest

from policies.plan import gcp_gpu
from policies.plan.graph import plan_records

ZONE = "us-central1-a"


def rec(typ, name, inputs):
    return {"urn": f"urn:{typ}::{name}", "type": typ, "name": name, "parent": None, "inputs": inputs}


def net(name, mtu, roce=False):
    inputs = {"name": name, "project": "p", "mtu": mtu}
    if roce:
        inputs["networkProfile"] = f"projects/p/global/networkProfiles/{ZONE}-vpc-roce"
    return rec(gcp_gpu.NETWORK, name, inputs)


def sub(name, network, region="us-central1"):
    return rec(gcp_gpu.SUBNETWORK, name, {"name": name, "project": "p", "region": region,
                                           "network": f"{network}-id"})


def pool(machine, nics, zones=(ZONE,), disk=None):
    disk = disk or ("hyperdisk-balanced" if machine in gcp_gpu.HYPERDISK_ONLY else "pd-ssd")
    return rec(gcp_gpu.NODE_POOL, "pool", {
        "nodeLocations": list(zones), "nodeConfig": {"machineType": machine, "diskType": disk},
        "networkConfig": {"additionalNodeNetworkConfigs": [{"network": n, "subnetwork": s} for n, s in nics]}})


def ultra_layout(mtu=8896):
    """A3 Ultra as the AI Hypercomputer guide builds it: one gVNIC VPC, one RoCE VPC with 8 subnets."""
    records = [net("gv", mtu), sub("gv-sub", "gv"), net("rdma", mtu, roce=True)]
    records += [sub(f"rdma-sub-{i}", "rdma") for i in range(8)]
    nics = [("gv", "gv-sub")] + [("rdma", f"rdma-sub-{i}") for i in range(8)]
    return records, nics


def high_layout(count=4, mtu=8244):
    records, nics = [], []
    for i in range(count):
        records += [net(f"gv{i}", mtu), sub(f"gv{i}-sub", f"gv{i}")]
        nics.append((f"gv{i}", f"gv{i}-sub"))
    return records, nics


def test_documented_layouts():
    assert gcp_gpu.LAYOUTS["a3-highgpu-8g"] == gcp_gpu.FabricLayout(gvnic_vpcs=4, rdma_nics=0, mtu=8244)
    assert gcp_gpu.LAYOUTS["a3-megagpu-8g"] == gcp_gpu.FabricLayout(gvnic_vpcs=8, rdma_nics=0, mtu=8244)
    for machine in ("a3-ultragpu-8g", "a4-highgpu-8g"):
        assert gcp_gpu.LAYOUTS[machine] == gcp_gpu.FabricLayout(gvnic_vpcs=1, rdma_nics=8, mtu=8896)


def test_a3_ultra_layout_passes_and_each_deviation_fails():
    records, nics = ultra_layout()
    assert gcp_gpu.gpu_problems([*records, pool("a3-ultragpu-8g", nics)]) == []
    # MTU 8244 (the TCPX guide's) on the RDMA machine's VPCs.
    bad, _ = ultra_layout(mtu=8244)
    problems = gcp_gpu.gpu_problems([*bad, pool("a3-ultragpu-8g", nics)])
    assert "pool: network gv has MTU 8244, a3-ultragpu-8g needs 8896" in problems
    assert "rdma: a RoCE VPC runs with MTU 8896, got 8244" in problems
    # A missing RDMA NIC; the gVNIC NIC dropped; nodes in another zone; a Persistent Disk boot disk.
    assert any("needs 8 RDMA NICs on a RoCE VPC, got 7" in p
               for p in gcp_gpu.gpu_problems([*records, pool("a3-ultragpu-8g", nics[:-1])]))
    assert any("needs 1 gVNIC NICs" in p for p in gcp_gpu.gpu_problems([*records, pool("a3-ultragpu-8g", nics[1:])]))
    assert any("cannot attach to RoCE VPC rdma of zone us-central1-a" in p
               for p in gcp_gpu.gpu_problems([*records, pool("a3-ultragpu-8g", nics, zones=("us-central1-b",))]))
    assert gcp_gpu.gpu_problems([*records, pool("a3-ultragpu-8g", nics, disk="pd-ssd")]) == [
        "pool: a3-ultragpu-8g boots only from hyperdisk-balanced (no Persistent Disk), got diskType 'pd-ssd'"]


def test_roce_vpc_rejects_firewall_rules_and_foreign_regions():
    records, nics = ultra_layout()
    fw = rec(gcp_gpu.FIREWALL, "fw", {"network": "rdma-id", "sourceRanges": ["192.168.0.0/16"]})
    ok_fw = rec(gcp_gpu.FIREWALL, "ok", {"network": "gv-id", "sourceRanges": ["192.168.0.0/16"]})
    problems = gcp_gpu.gpu_problems([*records, ok_fw, fw, pool("a3-ultragpu-8g", nics)])
    assert problems == ["fw: a RoCE VPC (rdma) rejects VPC firewall rules; use a regional network firewall "
                        "policy of type RDMA_ROCE_POLICY"]
    assoc = rec(gcp_gpu.GLOBAL_POLICY_ASSOCIATION, "assoc", {"attachmentTarget": "projects/p/global/networks/rdma"})
    assert "rejects global network firewall policies" in gcp_gpu.gpu_problems([*records, assoc])[0]
    far = [*records, sub("far", "rdma", region="europe-west4")]
    assert any(p.startswith("far: subnet of RoCE VPC rdma must be in us-central1") for p in gcp_gpu.gpu_problems(far))


def test_a3_high_needs_four_separate_vpcs():
    records, nics = high_layout()
    assert gcp_gpu.gpu_problems([*records, pool("a3-highgpu-8g", nics)]) == []
    shared = [nics[0], ("gv0", "gv1-sub"), *nics[2:]]
    problems = gcp_gpu.gpu_problems([*records, pool("a3-highgpu-8g", shared)])
    assert any("on 3 VPCs" in p for p in problems) and any("is not in network gv0" in p for p in problems)
    assert any("a3-megagpu-8g needs 8 gVNIC NICs" in p for p in gcp_gpu.gpu_problems([*records, pool("a3-megagpu-8g", nics)]))
    assert "no documented GPU fabric layout" in gcp_gpu.gpu_problems([*records, pool("g2-standard-8", nics)])[0]
    missing = [*nics[:3], ("nope", "nope-sub")]
    assert any("which the plan does not create" in p for p in gcp_gpu.gpu_problems([*records, pool("a3-highgpu-8g", missing)]))


@pytest.mark.parametrize(("vpc", "mode", "ok"), [("rdma", "RDMA", True), ("gv", "NetDevice", True),
                                                 ("rdma", "NetDevice", False), ("gv", "RDMA", False)])
def test_param_set_device_mode_follows_the_vpc(vpc, mode, ok):
    records, _ = ultra_layout()
    subnet = "rdma-sub-0" if vpc == "rdma" else "gv-sub"
    obj = rec(gcp_gpu.PARAM_SET, "ps", {"metadata": {"name": "n"}, "spec": {"vpc": vpc, "vpcSubnet": subnet,
                                                                              "deviceMode": mode}})
    assert (gcp_gpu.gpu_problems([*records, obj]) == []) is ok


def _pod(networks, pool_name="ultra"):
    interfaces = [{"interfaceName": "eth0", "network": "default"}]
    interfaces += [{"interfaceName": f"eth{i + 1}", "network": n} for i, n in enumerate(networks)]
    template = {"metadata": {"annotations": {gcp_gpu.INTERFACES: json.dumps(interfaces)}},
                "spec": {"nodeSelector": {gcp_gpu.POOL_LABEL: pool_name}}}
    return rec("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet", "job",
               {"spec": {"replicatedJobs": [{"template": {"spec": {"template": template}}}]}})


def test_network_objects_and_pod_interfaces_match_the_node_pool():
    records, nics = ultra_layout()
    gpu_pool = pool("a3-ultragpu-8g", nics)
    gpu_pool["inputs"]["nodeConfig"]["labels"] = {gcp_gpu.POOL_LABEL: "ultra"}
    names = ["gv"] + [f"rdma-{i}" for i in range(8)]
    objects = []
    for n in names:
        objects.append(rec(gcp_gpu.PARAM_SET, f"ps-{n}", {"metadata": {"name": n}, "spec": {}}))
        objects.append(rec(gcp_gpu.GKE_NETWORK, f"net-{n}", {"metadata": {"name": n}, "spec": {
            "type": "Device", "parametersRef": {"group": "networking.gke.io", "kind": "GKENetworkParamSet", "name": n}}}))
    base = [*records, gpu_pool, *objects]
    ok = [p for p in gcp_gpu.gpu_problems([*base, _pod(names)]) if not p.startswith("GKENetworkParamSet")]
    assert ok == []
    assert any("9 additional NICs" in p for p in gcp_gpu.gpu_problems([*base, _pod(names[:-1])]))
    assert any("'nope' is no Network object" in p for p in gcp_gpu.gpu_problems([*base, _pod([*names[:-1], "nope"])]))
    dangling = rec(gcp_gpu.GKE_NETWORK, "net-x", {"metadata": {"name": "x"}, "spec": {
        "type": "Device", "parametersRef": {"group": "networking.gke.io", "kind": "GKENetworkParamSet", "name": "x"}}})
    assert any(p.startswith("Network x: a Device network needs parametersRef") for p in gcp_gpu.gpu_problems([*base, dangling]))


# ---------------------------------------------------------------------------------------------
# The session's GCP plans
# ---------------------------------------------------------------------------------------------


def gcp_plans(all_plans):
    found = {s: p for s, p in all_plans.items() if p["outputs"].get("cloud") == "gcp"}
    assert len(found) >= 4, sorted(found)
    return found


def _roce(records):
    return [r for r in records if r["type"] == gcp_gpu.NETWORK and gcp_gpu.roce_zone(r)]


def test_gcp_plans_follow_the_documented_gpu_rules(all_plans):
    machines = set()
    for stack, plan in gcp_plans(all_plans).items():
        records = plan_records(plan)
        assert gcp_gpu.gpu_problems(records) == [], stack
        machines |= {r["inputs"]["nodeConfig"]["machineType"] for r in records if r["type"] == gcp_gpu.NODE_POOL}
    # The session covers every fabric flavour it should: TCPX, TCPXO and RDMA.
    assert {"a3-highgpu-8g", "a3-megagpu-8g", "a3-ultragpu-8g"} <= machines


def test_broken_copies_of_the_gcp_plans_fail(all_plans):
    rdma_plans = {s: plan_records(p) for s, p in gcp_plans(all_plans).items() if _roce(plan_records(p))}
    assert rdma_plans, "no GCP plan of the session has a RoCE VPC"
    for stack, records in rdma_plans.items():
        roce = _roce(records)[0]
        fw = rec(gcp_gpu.FIREWALL, "fabric-rdma-internal", {"network": f"{roce['name']}-id"})
        assert any(p.startswith("fabric-rdma-internal: a RoCE VPC") for p in gcp_gpu.gpu_problems([*records, fw]))
        broken = copy.deepcopy(records)
        next(r for r in broken if r["urn"] == roce["urn"])["inputs"]["mtu"] = 8244
        assert any("MTU 8244" in p for p in gcp_gpu.gpu_problems(broken)), stack
        broken = copy.deepcopy(records)
        gpu_pool = next(r for r in broken if r["type"] == gcp_gpu.NODE_POOL
                        and r["inputs"].get("networkConfig", {}).get("additionalNodeNetworkConfigs"))
        gpu_pool["inputs"]["networkConfig"]["additionalNodeNetworkConfigs"].pop()
        gpu_pool["inputs"]["nodeConfig"]["diskType"] = "pd-ssd"
        problems = gcp_gpu.gpu_problems(broken)
        assert any("RDMA NICs on a RoCE VPC, got 7" in p for p in problems), problems
        assert any("boots only from hyperdisk-balanced" in p for p in problems), problems
        broken = copy.deepcopy(records)
        ps = next(r for r in broken if r["type"] == gcp_gpu.PARAM_SET and r["inputs"]["spec"]["deviceMode"] == "RDMA")
        ps["inputs"]["spec"]["deviceMode"] = "NetDevice"
        assert any("deviceMode 'NetDevice'" in p for p in gcp_gpu.gpu_problems(broken)), stack
    # A training pod that asks for one interface fewer than its pool's nodes have.
    fabric_jobs = 0
    for stack, plan in gcp_plans(all_plans).items():
        broken = copy.deepcopy(plan_records(plan))
        templates = [t for r in broken for t in gcp_gpu.pod_templates(r["inputs"])]
        if not templates:
            continue  # a stack whose job runs on a pool without fabric
        fabric_jobs += 1
        annotations = templates[0]["metadata"]["annotations"]
        annotations[gcp_gpu.INTERFACES] = json.dumps(json.loads(annotations[gcp_gpu.INTERFACES])[:-1])
        assert any("additional interfaces, but node pool" in p for p in gcp_gpu.gpu_problems(broken)), stack
    assert fabric_jobs >= 3  # the prod stack and its A3 High and A3 Ultra variants
