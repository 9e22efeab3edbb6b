"""What Google documents for GPU machine types and their fabric networks, checked against a plan.

Usage:
    problems = gpu_problems(plan["resources"])   # [] when every GPU pool and fabric VPC fits the docs

The rules, per machine type, and where they come from:
- Boot disks: A3 Ultra and A4 support Hyperdisk only, no Persistent Disk, and Hyperdisk Balanced
  is the Hyperdisk type a boot disk can be
  (https://cloud.google.com/compute/docs/accelerator-optimized-machines,
  https://cloud.google.com/compute/docs/disks/hyperdisks).
- A3 High (a3-highgpu-8g, GPUDirect-TCPX): 4 GPU NICs, each on its own gVNIC VPC with one subnet,
  MTU 8244 (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx).
- A3 Mega (a3-megagpu-8g, GPUDirect-TCPXO): 8 such NICs and VPCs, MTU 8244 (same guide).
- A3 Ultra (a3-ultragpu-8g) and A4 (a4-highgpu-8g), RDMA over RoCE: one more gVNIC NIC on its
  own VPC plus 8 MRDMA NICs on one VPC created with the zone's `<zone>-vpc-roce` network
  profile, one subnet per NIC; MTU 8896 on both
  (https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom,
  https://cloud.google.com/vertex-ai/docs/training/managed-training/networking).
- A RoCE VPC (https://cloud.google.com/vpc/docs/rdma-network-profiles): only instances in the
  profile's zone attach to it, its subnets lie in that zone's region, only RDMA NICs attach
  (every other NIC of the node is on a regular VPC), MTU 8896. It supports firewall rules only in
  regional network firewall policies of type RDMA_ROCE_POLICY: VPC firewall rules and global
  network firewall policies are rejected (https://cloud.google.com/firewall/docs/firewall-for-roce).
- Pods reach the NICs through GKE multi-networking: a GKENetworkParamSet names the VPC and subnet
  with `deviceMode` RDMA for the RoCE VPC and NetDevice for gVNIC VPCs; a Network of type `Device`
  refers to its GKENetworkParamSet; a pod's `networking.gke.io/interfaces` annotation names
  Networks, one per additional NIC of the node pool it is scheduled to
  (https://cloud.google.com/kubernetes-engine/docs/how-to/setup-multinetwork-support-for-pods).

The table is written from those pages, independently of gpu_train/spec/catalog/gcp.py, so a plan built
from a wrong catalog entry fails here. Pure; tested without mocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gpu_train.spec.naming import POOL_LABEL  # selects one node pool's nodes
from policies.plan.graph import PlanGraph, Record, identifiers

NETWORK = "gcp:compute/network:Network"
SUBNETWORK = "gcp:compute/subnetwork:Subnetwork"
NODE_POOL = "gcp:container/nodePool:NodePool"
FIREWALL = "gcp:compute/firewall:Firewall"
GLOBAL_POLICY_ASSOCIATION = "gcp:compute/networkFirewallPolicyAssociation:NetworkFirewallPolicyAssociation"
PARAM_SET = "kubernetes:networking.gke.io/v1:GKENetworkParamSet"
GKE_NETWORK = "kubernetes:networking.gke.io/v1:Network"
INTERFACES = "networking.gke.io/interfaces"
ROCE_PROFILE = re.compile(r"(?:^|/)networkProfiles/([a-z]+-[a-z]+[0-9]+-[a-z])-vpc-roce$")
ROCE_MTU = 8896


@dataclass(frozen=True, kw_only=True)
class FabricLayout:
    gvnic_vpcs: int  # additional gVNIC NICs, one VPC (with one subnet) each
    rdma_nics: int  # MRDMA NICs, one subnet each, all in one RoCE VPC (0: none)
    mtu: int  # of every fabric VPC of the machine


HYPERDISK_ONLY = ("a3-ultragpu-8g", "a4-highgpu-8g")
HYPERDISK_BOOT = "hyperdisk-balanced"
LAYOUTS = {
    "a3-highgpu-8g": FabricLayout(gvnic_vpcs=4, rdma_nics=0, mtu=8244),
    "a3-megagpu-8g": FabricLayout(gvnic_vpcs=8, rdma_nics=0, mtu=8244),
    "a3-ultragpu-8g": FabricLayout(gvnic_vpcs=1, rdma_nics=8, mtu=8896),
    "a4-highgpu-8g": FabricLayout(gvnic_vpcs=1, rdma_nics=8, mtu=8896),
}


def roce_zone(network: Record) -> str | None:
    """The zone of a network's RoCE profile, None for a regular VPC."""
    profile = (network.get("inputs") or {}).get("networkProfile") or ""
    match = ROCE_PROFILE.search(profile)
    return match.group(1) if match else None


def _one(graph: PlanGraph, typ: str, ref: str) -> Record | None:
    found = graph.find(typ, ref) if isinstance(ref, str) else []
    return found[0] if len(found) == 1 else None


def _boot_disk_problems(pool: Record) -> list[str]:
    node = (pool.get("inputs") or {}).get("nodeConfig") or {}
    machine, disk = node.get("machineType"), node.get("diskType")
    if machine in HYPERDISK_ONLY and disk != HYPERDISK_BOOT:
        return [f"{pool['name']}: {machine} boots only from {HYPERDISK_BOOT} (no Persistent Disk), got diskType {disk!r}"]
    return []


def _pool_problems(graph: PlanGraph, pool: Record) -> list[str]:
    inputs = pool.get("inputs") or {}
    extra = ((inputs.get("networkConfig") or {}).get("additionalNodeNetworkConfigs")) or []
    if not extra:
        return []
    name = pool["name"]
    machine = (inputs.get("nodeConfig") or {}).get("machineType")
    layout = LAYOUTS.get(machine)
    if layout is None:
        return [f"{name}: machine type {machine!r} has additional node networks but no documented GPU fabric layout"]
    problems = []
    zones = inputs.get("nodeLocations") or []
    gvnic_nets: list[str] = []
    rdma: list[tuple[Record, Record]] = []
    wrong_mtu: dict[str, object] = {}
    for n, cfg in enumerate(extra):
        net = _one(graph, NETWORK, cfg.get("network"))
        sub = _one(graph, SUBNETWORK, cfg.get("subnetwork"))
        where = f"{name}: additional node network {n}"
        if net is None or sub is None:
            problems.append(f"{where} names network {cfg.get('network')!r} / subnet {cfg.get('subnetwork')!r}, "
                            "which the plan does not create exactly once")
            continue
        if (sub.get("inputs") or {}).get("network") not in identifiers(net):
            problems.append(f"{where}: subnet {sub['name']} is not in network {net['name']}")
        mtu = (net.get("inputs") or {}).get("mtu")
        if mtu != layout.mtu:
            wrong_mtu[net["name"]] = mtu
        if roce_zone(net):
            rdma.append((net, sub))
        else:
            gvnic_nets.append(net["urn"])
    for net_name, mtu in sorted(wrong_mtu.items()):
        problems.append(f"{name}: network {net_name} has MTU {mtu}, {machine} needs {layout.mtu}")
    if len(gvnic_nets) != layout.gvnic_vpcs or len(set(gvnic_nets)) != len(gvnic_nets):
        problems.append(f"{name}: {machine} needs {layout.gvnic_vpcs} gVNIC NICs on as many separate VPCs, "
                        f"got {len(gvnic_nets)} NICs on {len(set(gvnic_nets))} VPCs")
    if len(rdma) != layout.rdma_nics:
        problems.append(f"{name}: {machine} needs {layout.rdma_nics} RDMA NICs on a RoCE VPC, got {len(rdma)}")
    if rdma:
        nets = {net["urn"] for net, _ in rdma}
        subs = {sub["urn"] for _, sub in rdma}
        if len(nets) != 1 or len(subs) != len(rdma):
            problems.append(f"{name}: the RDMA NICs need one subnet each in a single RoCE VPC "
                            f"(got {len(subs)} subnets in {len(nets)} VPCs)")
        zone = roce_zone(rdma[0][0])
        if zones != [zone]:
            problems.append(f"{name}: nodes in {zones} cannot attach to RoCE VPC {rdma[0][0]['name']} "
                            f"of zone {zone}")
    return problems


def _network_problems(graph: PlanGraph, net: Record) -> list[str]:
    zone = roce_zone(net)
    if zone is None:
        return []
    problems = []
    name, refs = net["name"], identifiers(net)
    mtu = (net.get("inputs") or {}).get("mtu")
    if mtu != ROCE_MTU:
        problems.append(f"{name}: a RoCE VPC runs with MTU {ROCE_MTU}, got {mtu}")
    region = zone.rsplit("-", 1)[0]
    for sub in graph.of_type(SUBNETWORK):
        i = sub.get("inputs") or {}
        if i.get("network") in refs and i.get("region") != region:
            problems.append(f"{sub['name']}: subnet of RoCE VPC {name} must be in {region} (its profile's "
                            f"zone is {zone}), got {i.get('region')!r}")
    problems += [f"{fw['name']}: a RoCE VPC ({name}) rejects VPC firewall rules; use a regional "
                 "network firewall policy of type RDMA_ROCE_POLICY"
                 for fw in graph.of_type(FIREWALL) if (fw.get("inputs") or {}).get("network") in refs]
    problems += [f"{assoc['name']}: a RoCE VPC ({name}) rejects global network firewall policies"
                 for assoc in graph.of_type(GLOBAL_POLICY_ASSOCIATION)
                 if (assoc.get("inputs") or {}).get("attachmentTarget") in refs]
    return problems


def _param_set_problems(graph: PlanGraph, obj: Record) -> list[str]:
    spec = (obj.get("inputs") or {}).get("spec") or {}
    name = ((obj.get("inputs") or {}).get("metadata") or {}).get("name") or obj["name"]
    net = _one(graph, NETWORK, spec.get("vpc"))
    sub = _one(graph, SUBNETWORK, spec.get("vpcSubnet"))
    if net is None or sub is None:
        return [f"GKENetworkParamSet {name}: vpc {spec.get('vpc')!r} / vpcSubnet {spec.get('vpcSubnet')!r} "
                "is not a network / subnet the plan creates"]
    want = "RDMA" if roce_zone(net) else "NetDevice"
    if spec.get("deviceMode") != want:
        return [f"GKENetworkParamSet {name}: deviceMode {spec.get('deviceMode')!r} on {net['name']}, needs {want!r}"]
    return []


def _object_name(obj: Record) -> str:
    return ((obj.get("inputs") or {}).get("metadata") or {}).get("name") or obj["name"]


def _network_object_problems(graph: PlanGraph, obj: Record) -> list[str]:
    spec = (obj.get("inputs") or {}).get("spec") or {}
    if spec.get("type") != "Device":
        return []
    ref = spec.get("parametersRef") or {}
    names = {_object_name(p) for p in graph.of_type(PARAM_SET)}
    if ref.get("kind") != "GKENetworkParamSet" or ref.get("group") != "networking.gke.io" or ref.get("name") not in names:
        return [f"Network {_object_name(obj)}: a Device network needs parametersRef to a GKENetworkParamSet of "
                f"this plan, got {ref!r}"]
    return []


def pod_templates(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every {metadata, spec} mapping whose metadata carries the multi-network annotation."""
    if isinstance(value, Mapping):
        annotations = (value.get("metadata") or {}).get("annotations") if isinstance(value.get("metadata"), Mapping) else None
        if isinstance(annotations, Mapping) and INTERFACES in annotations:
            yield value
        for v in value.values():
            yield from pod_templates(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from pod_templates(v)


def _pod_problems(graph: PlanGraph, obj: Record) -> list[str]:
    problems = []
    networks = {_object_name(n) for n in graph.of_type(GKE_NETWORK)}
    for template in pod_templates(obj.get("inputs") or {}):
        where = f"{obj['name']} pod template"
        try:
            interfaces = json.loads(template["metadata"]["annotations"][INTERFACES])
        except (TypeError, ValueError):
            problems.append(f"{where}: {INTERFACES} is not a JSON list")
            continue
        extra = [i.get("network") for i in interfaces if i.get("network") != "default"]
        problems += [f"{where}: interface network {n!r} is no Network object of this plan"
                     for n in extra if n not in networks]
        pool_name = ((template.get("spec") or {}).get("nodeSelector") or {}).get(POOL_LABEL)
        pools = [p for p in graph.of_type(NODE_POOL)
                 if ((p.get("inputs") or {}).get("nodeConfig") or {}).get("labels", {}).get(POOL_LABEL) == pool_name]
        if pool_name and len(pools) == 1:
            nics = ((pools[0]["inputs"].get("networkConfig") or {}).get("additionalNodeNetworkConfigs")) or []
            if len(nics) != len(extra):
                problems.append(f"{where}: {len(extra)} additional interfaces, but node pool {pools[0]['name']} "
                                f"gives its nodes {len(nics)} additional NICs")
    return problems


def gpu_problems(records: Iterable[Record]) -> list[str]:
    """One line per node pool, RoCE VPC, firewall or multi-network object that breaks the rules."""
    graph = PlanGraph(records)
    problems: list[str] = []
    for pool in graph.of_type(NODE_POOL):
        problems += _boot_disk_problems(pool) + _pool_problems(graph, pool)
    for net in graph.of_type(NETWORK):
        problems += _network_problems(graph, net)
    for obj in graph.of_type(PARAM_SET):
        problems += _param_set_problems(graph, obj)
    for obj in graph.of_type(GKE_NETWORK):
        problems += _network_object_problems(graph, obj)
    for obj in graph.records:
        if obj["type"].startswith("kubernetes:") and obj["type"] not in (PARAM_SET, GKE_NETWORK):
            problems += _pod_problems(graph, obj)
    return problems
