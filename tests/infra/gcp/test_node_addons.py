"""What the GCP layer tells the platform about its GPU nodes (infra/gcp/node_addons.py): what a node leaves to a
training pod, the pools as jobs see them, and the add-ons the Kubernetes layer installs (NCCL plugin installers,
the fabric networks' GKE objects, the driver's host directory, the raw local SSDs). Every expected number is worked
out beside it from the published rules the module cites, not read back from the code.

Usage: .venv/bin/pytest tests/infra/gcp/test_node_addons.py -q
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from gpu_train.jobs.fit import quantity
from gpu_train.spec import naming
from infra.gcp import fabric, network, node_addons
from tests.infra.gcp.conftest import fabric_pool, stack_cfg

GIB = 2**30
MIB = 2**20
# What the platform keeps on every GPU node for its own agents (infra/platform.py): 4 cores and 12 GiB.
AGENTS_CPU, AGENTS_MEMORY = Fraction(4), 12 * GIB
L4 = {"name": "l4", "instanceType": "g2-standard-8", "capacity": "spot", "maxNodes": 2}


@pytest.mark.parametrize(("machine", "cpu", "memory"), [
    # g2-standard-8: 8 vCPUs, 32 GiB. cpu reserved 0.06 + 0.01 + 0.005 x 2 + 0.0025 x 4 = 0.09 -> 7.91.
    # memory seen: 32 x 0.925 = 29.6 GiB; reserved 25% of 4 + 20% of 4 + 10% of 8 + 6% of the 13.6 above 16
    # = 1 + 0.8 + 0.8 + 0.816 = 3.416 GiB; less 100 MiB eviction.
    ("g2-standard-8", Fraction(791, 100), Fraction(296, 10) * GIB - Fraction(3416, 1000) * GIB - 100 * MIB),
    # a3-megagpu-8g: 208 vCPUs, 1872 GiB. cpu 0.08 + 204 x 0.0025 = 0.59 -> 207.41.
    # memory seen: 1872 x 0.925 = 1731.6 GiB; reserved 1 + 0.8 + 0.8 + 6% of 112 (6.72) + 2% of the 1603.6
    # above 128 (32.072) = 41.392 GiB; less 100 MiB.
    ("a3-megagpu-8g", Fraction(20741, 100), Fraction(17316, 10) * GIB - Fraction(41392, 1000) * GIB - 100 * MIB),
])
def test_gke_allocatable_follows_the_published_tiers(machine, cpu, memory):
    assert node_addons.kubelet_allocatable(machine) == (cpu, memory)
    left = node_addons.allocatable(machine)
    assert (quantity(left.cpu), quantity(left.memory)) == (cpu - AGENTS_CPU, memory - AGENTS_MEMORY)


def test_pools_as_jobs_see_them():
    cfg = stack_cfg([fabric_pool("mega", "a3-megagpu-8g"), L4])
    mega, l4 = node_addons.gpu_pools(cfg)
    assert (mega.name, mega.gpu_type, mega.gpus_per_node, mega.zone, mega.provisioner) == (
        "mega", "H100", 8, "us-central1-a", "node-pool")
    assert mega.node_selector == {naming.POOL_LABEL: "mega"}
    assert mega.tolerations == [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present",
                                 "effect": "NoSchedule"}]
    sets = network.fabric_sets(cfg)
    assert mega.fabric == fabric.fabric_contract(sets["tcpxo"], "a3-megagpu-8g")
    assert mega.allocatable == node_addons.allocatable("a3-megagpu-8g")
    assert l4.fabric.kind == "none" and l4.allocatable == node_addons.allocatable("g2-standard-8")


def test_gke_runs_its_own_device_plugin_and_leaves_raw_local_ssds():
    addons = node_addons.node_addons(stack_cfg([L4]), {})
    # GKE node pools run Google's device plugin and driver installer (the driver under
    # /home/kubernetes/bin/nvidia on the host); localNvmeSsdBlockConfig leaves the SSDs as
    # /dev/disk/by-id/google-local-nvme-ssd-N.
    assert addons.device_plugin is False and addons.device_plugins == ()
    assert addons.driver_host_path == "/home/kubernetes/bin/nvidia"
    assert addons.nvme_device_glob == "/dev/disk/by-id/google-local-nvme-ssd-*"
    assert (addons.installers, addons.cluster_objects) == ([], [])
    assert {name: (p.probe, p.devices) for name, p in addons.fabric_probes.items()} == {"l4": ("none", 0)}


@pytest.mark.parametrize(("machine", "kind", "modes", "probe"), [
    # A3 High: 4 gVNIC fabric networks; A3 Mega: 8 (GPUDirect-TCPX/TCPXO guides); the pre-flight counts them
    # plus the node's primary gVNIC.
    ("a3-highgpu-8g", "tcpx", ["NetDevice"] * 4, ("gvnic", 5)),
    ("a3-megagpu-8g", "tcpxo", ["NetDevice"] * 8, ("gvnic", 9)),
    # A3 Ultra: one extra gVNIC network and 8 RDMA networks on the RoCE VPC; the pre-flight counts the ConnectX
    # NICs only.
    ("a3-ultragpu-8g", "rdma", ["NetDevice"] + ["RDMA"] * 8, ("mlx", 8)),
])
def test_fabric_pools_get_their_installer_networks_and_probe(machine, kind, modes, probe):
    cfg = stack_cfg([fabric_pool("p", machine), L4])
    sets = network.fabric_sets(cfg)
    (fset,) = sets.values()
    # The networks' GCE names resolve to the created resources' names (Outputs in the program).
    names = {n: f"created-{n}" for vpc, sub in fset.nics() for n in (vpc.name, sub.name)}
    addons = node_addons.node_addons(cfg, names)
    assert [i.fabric for i in addons.installers] == [kind]
    assert addons.installers[0] == node_addons.NCCL_INSTALLERS[kind]
    # Each network's GKENetworkParamSet, then the Network that refers to it.
    assert [o["kind"] for o in addons.cluster_objects] == ["GKENetworkParamSet", "Network"] * len(modes)
    params = [o for o in addons.cluster_objects if o["kind"] == "GKENetworkParamSet"]
    nets = [o for o in addons.cluster_objects if o["kind"] == "Network"]
    assert [o["apiVersion"] for o in addons.cluster_objects] == ["networking.gke.io/v1"] * (2 * len(modes))
    assert [p["spec"]["deviceMode"] for p in params] == modes
    for (vpc, sub), param, net in zip(fset.nics(), params, nets, strict=True):
        assert param["metadata"]["name"] == net["metadata"]["name"] == sub.k8s_network
        assert param["spec"]["vpc"] == f"created-{vpc.name}" and param["spec"]["vpcSubnet"] == f"created-{sub.name}"
        assert net["spec"] == {"type": "Device", "parametersRef": {"group": "networking.gke.io",
                                                                   "kind": "GKENetworkParamSet",
                                                                   "name": sub.k8s_network}}
    # The pool's pods attach to exactly these Network objects.
    (pool, _) = node_addons.gpu_pools(cfg)
    interfaces = json.loads(pool.fabric.annotations["networking.gke.io/interfaces"])
    assert [i["network"] for i in interfaces[1:]] == [n["metadata"]["name"] for n in nets]
    assert {name: (p.probe, p.devices) for name, p in addons.fabric_probes.items()} == {"p": probe, "l4": ("none", 0)}


def test_pools_of_one_fabric_share_its_networks_and_installer():
    cfg = stack_cfg([fabric_pool("a", "a3-megagpu-8g"), fabric_pool("b", "a3-megagpu-8g", capacity="reservation")])
    addons = node_addons.node_addons(cfg, {})
    assert [i.name for i in addons.installers] == ["nccl-tcpxo-installer"]
    names = [o["metadata"]["name"] for o in addons.cluster_objects]
    assert len(names) == 2 * 8 and len(set(names)) == 8  # one GKENetworkParamSet and one Network per network
    a, b = node_addons.gpu_pools(cfg)
    assert a.fabric.annotations == b.fabric.annotations
