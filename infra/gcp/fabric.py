"""How pods use the GPU fabric on GKE: the `Fabric` part of the platform contract.

Usage: `fabric_contract(fset, machine_type)` -> the platform's Fabric for one pool; pure and tested without mocks.

The node pools attach the fabric NICs; pods reach them through GKE multi-networking (Network and
GKENetworkParamSet objects, which infra/gcp/node_addons.py hands the Kubernetes layer to create). The NCCL
network plugins are installed on the nodes by Google's installer DaemonSets (nccl-tcpx-installer,
nccl-tcpxo-installer, nccl-rdma-installer, also deployed by the Kubernetes layer) into
/home/kubernetes/bin/nvidia/lib64 (TCPX, TCPXO) and /home/kubernetes/bin/gib (RDMA).
Sources: https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx,
https://github.com/GoogleCloudPlatform/container-engine-accelerators/blob/master/gpudirect-tcpxo/README.md,
https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from gpu_train.spec.contract import Fabric
from infra.gcp.network import FabricSetPlan

NVIDIA_HOST_LIB = "/home/kubernetes/bin/nvidia/lib64"  # GKE's driver install (and TCPX/TCPXO plugins)
NVIDIA_LIB = "/usr/local/nvidia/lib64"
GIB_HOST_DIR = "/home/kubernetes/bin/gib"  # the RDMA installer's NCCL gIB plugin
GIB_DIR = "/usr/local/gib"
# Receive-datapath managers, pinned; each must match the plugin installer version it was
# released with (container-engine-accelerators gpudirect-tcpx / gpudirect-tcpxo release notes).
TCPX_RXDM_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
TCPXO_RXDM_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.18"
TCPX_SOCKET_DIR = "/run/tcpx"
# Requests of a receive-datapath manager: it pins a few polling threads and its buffers live in GPU
# memory, so one CPU and a small heap; the memory limit stops a leak from taking the trainer's node.
# Native sidecars count toward the pod's requests, and the trainer's requests leave this headroom
# (infra/k8s/training.py NODE_FRACTION).
RXDM_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
# Google's manifests run both managers privileged: they program flow steering on the GPU NICs and
# tune the host's network sysctls through the mounted /sys and /proc/sys
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx,
# https://github.com/GoogleCloudPlatform/container-engine-accelerators/tree/master/gpudirect-tcpxo).
# A capability-only variant exists but needs NRI device injection on the nodes, which this platform
# does not deploy. They run as root: the training pod's own securityContext makes every container
# non-root (the trainer's UID), and a non-root process gets no capabilities even in a privileged
# container. The policy pack exempts exactly these two containers (RXDM_SIDECARS in policies/pods.py).
RXDM_SECURITY = {"privileged": True, "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False}


def nic_names(fset: FabricSetPlan) -> list[str]:
    """Pod interface names of the fabric NICs: eth1.. (eth0 is the cluster network)."""
    return [f"eth{i + 1}" for i in range(len(fset.nics()))]


def interfaces_annotation(fset: FabricSetPlan) -> str:
    """networking.gke.io/interfaces: eth0 on the default network, then one per fabric NIC."""
    items = [{"interfaceName": "eth0", "network": "default"}]
    items += [{"interfaceName": eth, "network": sub.k8s_network}
              for eth, (_, sub) in zip(nic_names(fset), fset.nics(), strict=True)]
    return json.dumps(items)


def nccl_env(fset: FabricSetPlan, machine_type: str) -> dict[str, str]:
    """NCCL settings Google publishes for each GPUDirect flavour."""
    nics = nic_names(fset)
    if fset.kind == "tcpx":
        return {
            "LD_LIBRARY_PATH": NVIDIA_LIB,
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_CROSS_NIC": "0",
            "NCCL_ALGO": "Ring",
            "NCCL_PROTO": "Simple",
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_P2P_PXN_LEVEL": "0",
            "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": ",".join(nics),
            "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
            "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": TCPX_SOCKET_DIR,
            "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "NCCL_BUFFSIZE": "4194304",
            "NCCL_NSOCKS_PERTHREAD": "4",
            "NCCL_SOCKET_NTHREADS": "1",
        }
    if fset.kind == "tcpxo":
        return {
            "LD_LIBRARY_PATH": NVIDIA_LIB,
            "NCCL_LIB_DIR": NVIDIA_LIB,
            "NCCL_FASTRAK_CTRL_DEV": "eth0",
            "NCCL_FASTRAK_IFNAME": ",".join(nics),
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_CROSS_NIC": "0",
            "NCCL_PROTO": "Simple,LL128",
            "NCCL_MIN_NCHANNELS": "4",
            "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
            "NCCL_TUNER_CONFIG_PATH": f"{NVIDIA_LIB}/a3plus_tuner_config.textproto",
            "NCCL_SHIMNET_GUEST_CONFIG_CHECKER_CONFIG_FILE": f"{NVIDIA_LIB}/a3plus_guest_config.textproto",
            "NCCL_NVLSTREE_MAX_CHUNKSIZE": "131072",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "NCCL_FASTRAK_NUM_FLOWS": "2",
            "NCCL_FASTRAK_USE_SNAP": "1",
            "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
            "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
            "NCCL_BUFFSIZE": "8388608",
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_FASTRAK_ENABLE_HOTPATH_LOGGING": "0",
            "NCCL_FASTRAK_USE_LLCM": "1",
            "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices",
        }
    if fset.kind == "rdma":
        tuner = "tuner_config_a4.txtpb" if machine_type.startswith("a4") else "tuner_config_a3u.txtpb"
        return {
            "LD_LIBRARY_PATH": f"{NVIDIA_LIB}:{GIB_DIR}/lib64",
            "NCCL_NET": "gIB",
            "NCCL_SOCKET_IFNAME": "eth0,eth1",
            "NCCL_CROSS_NIC": "0",
            "NCCL_NET_GDR_LEVEL": "PIX",
            "NCCL_P2P_NET_CHUNKSIZE": "131072",
            "NCCL_NVLS_CHUNKSIZE": "524288",
            "NCCL_IB_ADAPTIVE_ROUTING": "1",
            "NCCL_IB_QPS_PER_CONNECTION": "4",
            "NCCL_IB_TC": "52",
            "NCCL_IB_FIFO_TC": "84",
            "NCCL_TUNER_CONFIG_PATH": f"{GIB_DIR}/configs/{tuner}",
        }
    raise ValueError(f"unknown GPU fabric kind {fset.kind!r} for {machine_type}")


def _host_volume(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path}}


def volumes(kind: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, trainer container mounts) for the host plugin directories."""
    vols = [_host_volume("nvidia-lib", NVIDIA_HOST_LIB)]
    mounts = [{"name": "nvidia-lib", "mountPath": NVIDIA_LIB, "readOnly": True}]
    if kind == "tcpx":
        vols += [{"name": "tcpx-socket", "emptyDir": {}}, _host_volume("sys", "/sys"),
                 _host_volume("proc-sys", "/proc/sys")]
        mounts += [{"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR}]
    elif kind == "tcpxo":
        vols += [_host_volume("aperture-devices", "/dev/aperture_devices"), _host_volume("sys", "/sys"),
                 _host_volume("proc-sys", "/proc/sys")]
        mounts += [{"name": "aperture-devices", "mountPath": "/dev/aperture_devices"}]
    elif kind == "rdma":
        vols += [_host_volume("gib", GIB_HOST_DIR)]
        mounts += [{"name": "gib", "mountPath": GIB_DIR, "readOnly": True}]
    return vols, mounts


def sidecars(kind: str, nic_count: int) -> list[dict[str, Any]]:
    """The receive-datapath manager as a native sidecar (init container, restartPolicy Always),
    so it starts before and stops after the trainer with no termination handshake."""
    common_mounts = [{"name": "nvidia-lib", "mountPath": NVIDIA_LIB},
                     {"name": "sys", "mountPath": "/hostsysfs"},
                     {"name": "proc-sys", "mountPath": "/hostprocsysfs"}]
    env = [{"name": "LD_LIBRARY_PATH", "value": NVIDIA_LIB}]
    if kind == "tcpx":
        return [{
            "name": "tcpx-daemon", "image": TCPX_RXDM_IMAGE, "imagePullPolicy": "IfNotPresent",
            "restartPolicy": "Always",
            "command": ["/tcpgpudmarxd/build/app/tcpgpudmarxd", "--gpu_nic_preset", "a3vm",
                        "--gpu_shmem_type", "fd", "--uds_path", TCPX_SOCKET_DIR,
                        "--setup_param", "--verbose 128 2 0"],
            "securityContext": dict(RXDM_SECURITY),
            "resources": copy.deepcopy(RXDM_RESOURCES),
            "env": env,
            "volumeMounts": [*common_mounts, {"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR}],
        }]
    if kind == "tcpxo":
        return [{
            "name": "tcpxo-daemon", "image": TCPXO_RXDM_IMAGE, "imagePullPolicy": "IfNotPresent",
            "restartPolicy": "Always",
            "command": ["/bin/sh", "-c", "chmod 755 /fts/entrypoint_rxdm_container.sh && "
                        f"exec /fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics={nic_count}"],
            "securityContext": dict(RXDM_SECURITY),
            "resources": copy.deepcopy(RXDM_RESOURCES),
            "env": env,
            "volumeMounts": common_mounts,
        }]
    return []


def fabric_contract(fset: FabricSetPlan | None, machine_type: str) -> Fabric:
    """The platform's Fabric for a pool: how its pods reach the fabric NICs and the NCCL plugin."""
    if fset is None:
        return Fabric(kind="none")
    vols, mounts = volumes(fset.kind)
    return Fabric(
        kind=fset.kind,  # type: ignore[arg-type]
        resources={},
        annotations={"networking.gke.io/default-interface": "eth0",
                     "networking.gke.io/interfaces": interfaces_annotation(fset)},
        nccl_env=nccl_env(fset, machine_type),
        volumes=vols, volume_mounts=mounts,
        sidecars=sidecars(fset.kind, len(fset.nics())),
    )
