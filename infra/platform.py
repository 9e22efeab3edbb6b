"""The platform: what the cloud layer built, as the Kubernetes layer reads it (in memory, never published).

Usage: `platform = infra.aws.build_platform(cfg, tags)` (or `infra.gcp.build_platform`) returns a
`ClusterPlatform`; everything in `infra/k8s/` reads only this object. Both clouds fill every field,
so the Kubernetes layer never asks which cloud it is on except through these fields.

Fields hold plain values where they are known when the program starts, and `pulumi.Output`s where
they come from the cloud (bucket names, role ARNs, endpoints).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec.contract import Allocatable, GpuPool

# What every GPU node keeps for agents other than the trainer: the platform's DaemonSets (the Alluxio worker and
# its job worker, DCGM exporter, node exporter, device and fabric plugins, NVMe setup, fabric installers) and the
# cloud's own (CNI, kube-proxy, CSI node, identity and logging agents). Each cloud layer takes it off a node's
# allocatable when it tells the job what a node of a pool leaves to a training pod (GpuPool.allocatable);
# tests/infra/test_plan.py adds up the platform's agents from every planned stack and checks they fit with
# CLOUD_AGENTS to spare.
GPU_NODE_AGENTS_CPU = Fraction(4)
GPU_NODE_AGENTS_MEMORY = Fraction(12 * 2**30)
# The cloud-managed DaemonSets the plan does not show: EKS aws-node, kube-proxy, ebs-csi-node, the Pod Identity
# agent and the node monitoring agent; GKE kube-proxy, fluentbit, gke-metadata-server, pdcsi-node, netd, the GPU
# device plugin and metrics agent. Their published requests add up to well under this.
CLOUD_AGENTS_CPU = Fraction(1)
CLOUD_AGENTS_MEMORY = Fraction(3 * 2**30, 2)


def quantity(amount: Fraction) -> str:
    """An exact Kubernetes quantity for an amount (cores or bytes): whole, milli- or nano-units."""
    for suffix, scale in (("", 1), ("m", 1000), ("n", 10**9)):
        scaled = amount * scale
        if scaled.denominator == 1:
            return f"{scaled.numerator}{suffix}"
    return f"{int(amount * 10**9)}n"


def left_for_pods(cpu: Fraction, memory: Fraction) -> Allocatable:
    """What a GPU node whose kubelet offers `cpu` cores and `memory` bytes leaves to a training pod."""
    return Allocatable(cpu=quantity(cpu - GPU_NODE_AGENTS_CPU), memory=quantity(memory - GPU_NODE_AGENTS_MEMORY))


@dataclass(frozen=True, kw_only=True)
class DevicePlugin:
    """A fabric's Kubernetes device plugin, from a Helm chart, on the GPU nodes of that fabric."""

    fabric: str  # nodes labelled gpu-train.io/fabric=<fabric> (and the pools with that fabric)
    release: str  # Helm release name
    chart: str
    version: str
    repo: str


@dataclass(frozen=True, kw_only=True)
class HostInstaller:
    """A privileged installer on a fabric's GPU nodes: copies a plugin onto the host, then idles."""

    fabric: str  # nodes labelled gpu-train.io/fabric=<fabric>
    name: str  # DaemonSet name
    image: str
    script: str  # shell run in the installer's container
    host_dirs: Mapping[str, tuple[str, str]]  # volume name -> (directory on the host, where the installer sees it)
    host_script: str = ""  # run afterwards in the host's mount namespace (nsenter), "" = none


@dataclass(frozen=True, kw_only=True)
class FabricProbe:
    """What the pre-flight check counts on a new node of a pool: the fabric's devices."""

    probe: Literal["none", "efa", "gvnic", "mlx"]  # how to count them (infra/k8s/gpu-preflight.sh)
    devices: int  # how many a healthy node has


@dataclass(frozen=True, kw_only=True)
class NodeAddons:
    """What a cloud's GPU nodes need beyond the platform's own agents; the Kubernetes layer installs it as given."""

    # NVIDIA's device plugin and GPU feature discovery; False where the cloud runs its own (GKE node pools).
    device_plugin: bool
    device_plugins: Sequence[DevicePlugin] = ()  # fabric device plugins (AWS EFA)
    installers: Sequence[HostInstaller] = ()  # fabric plugin installers (GKE GPUDirect NCCL plugins)
    # Cluster-scoped objects the fabric needs (GKE's Network and GKENetworkParamSet per fabric network); values may
    # be Outputs of cloud resources.
    cluster_objects: Sequence[Mapping[str, Any]] = ()
    # Where the NVIDIA driver's libraries and tools are on the host, for agents that use the GPUs without holding
    # them through the device plugin (DCGM exporter, pre-flight); "" = the container runtime injects them (EKS).
    driver_host_path: str = ""
    # Raw local NVMe devices the Kubernetes layer assembles into a RAID0 at nvme_host_path ("" = the node's own
    # bootstrap has mounted them there).
    nvme_device_glob: str = ""
    fabric_probes: Mapping[str, FabricProbe] = field(default_factory=dict)  # pool name -> its pre-flight probe


@dataclass(frozen=True, kw_only=True)
class WorkloadIdentity:
    """A Kubernetes service account bound to a cloud identity (Pod Identity / IRSA / GKE WI)."""

    namespaces: Sequence[str]  # the service account exists in each of these namespaces
    name: str  # Kubernetes service account name
    annotations: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)  # e.g. iam.gke.io/gcp-service-account


@dataclass(frozen=True, kw_only=True)
class StorageClassSpec:
    """An encrypted (customer-managed key) block StorageClass the k8s layer creates and uses."""

    name: str
    provisioner: str  # ebs.csi.aws.com | pd.csi.storage.gke.io
    parameters: Mapping[str, pulumi.Input[str]]  # includes the KMS key
    volume_binding_mode: str = "WaitForFirstConsumer"


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """Object-store URIs (s3://name or gs://name), no trailing slash."""

    datasets: pulumi.Output[str]
    checkpoints: pulumi.Output[str]
    artifacts: pulumi.Output[str]


@dataclass(frozen=True, kw_only=True)
class Registry:
    """Where the trainer image is pushed, and how to authenticate the push."""

    repository: pulumi.Output[str]  # e.g. 123.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-dev-trainer
    server: pulumi.Output[str]  # registry host for docker login
    username: pulumi.Output[str]
    password: pulumi.Output[str]  # secret
    # Where BuildKit keeps its layer cache (a repository whose tags may be overwritten, on the same
    # server and credentials); None: no registry cache.
    cache_repository: pulumi.Input[str] | None = None


@dataclass(frozen=True, kw_only=True)
class ManagedDatabase:
    """A managed PostgreSQL (RDS / Cloud SQL), private and KMS-encrypted, created for MLflow."""

    host: pulumi.Input[str]  # private endpoint address
    port: int = 5432
    database: str = "mlflow"
    username: pulumi.Input[str]
    password: pulumi.Input[str]  # a secret Output
    cidrs: Sequence[str]  # where the endpoint lives, for NetworkPolicy egress (the database subnets)
    sslmode: str = "require"


def generate_password() -> str:
    """A database password: 48 URL-safe characters from the OS CSPRNG (~286 bits), none of the characters RDS
    forbids (/ @ " space), so no escaping is needed in a URL or a shell."""
    return secrets.token_urlsafe(36)


@dataclass(frozen=True)
class EgressTarget:
    """One extra egress destination pods need, e.g. the node-local workload identity agent."""

    cidr: str
    port: int
    protocol: str = "TCP"


@dataclass(frozen=True, kw_only=True)
class LogStore:
    """Where the team namespaces' container logs are kept after their pods and nodes are gone, when the
    cloud does not keep them itself: the Kubernetes layer installs a log shipper that writes there."""

    kind: Literal["cloudwatch"]  # CloudWatch Logs, written by Fluent Bit (aws-for-fluent-bit)
    region: str
    groups: Mapping[str, pulumi.Input[str]]  # team namespace -> its log group (KMS-encrypted, retention set)
    shipper: WorkloadIdentity  # the shipper's service account, bound to a role that may write only there
    # Where the shipper reaches the store on 443 (the VPC's CloudWatch Logs interface endpoint), for
    # NetworkPolicy egress.
    endpoint_cidrs: Sequence[str]


@dataclass(frozen=True, kw_only=True)
class ClusterPlatform:
    """Everything the Kubernetes layer needs from a cloud."""

    cloud: Literal["aws", "gcp"]  # for the stack outputs and the published contract only: no component asks it
    region: str
    cluster_name: pulumi.Output[str]
    kubernetes_version: str
    provider: k8s.Provider  # built from the cluster's endpoint and CA
    kubeconfig: pulumi.Output[str]  # secret
    gpu_pools: Sequence[GpuPool]
    system_node_selector: Mapping[str, str]  # where controllers (Prometheus, Kueue, cache masters) run
    # Local NVMe of GPU nodes, mounted as one filesystem at this host path: by the node's own bootstrap (AWS
    # nodeadm RAID0), or by the Kubernetes layer's DaemonSet when the cloud leaves raw devices
    # (node_addons.nvme_device_glob; GKE).
    nvme_host_path: str
    buckets: Buckets
    object_store_endpoint: str  # S3 API endpoint (AWS) or the GCS endpoint, for the trainer and cache
    # CIDRs NetworkPolicies must allow for egress to the object store and cloud APIs over 443.
    object_store_cidrs: Sequence[str]
    api_server_cidrs: Sequence[str]  # control-plane addresses, for NetworkPolicy egress
    vpc_cidr: str
    pod_cidr: str
    storage_class: StorageClassSpec
    # Keys: "cache", "mlflow", and "trainer/<team>" for each team (each team's trainer may read the
    # datasets bucket and read/write only <checkpoints bucket>/<team>/).
    identities: Mapping[str, WorkloadIdentity]
    registry: Registry
    internal_lb_annotations: Mapping[str, str]  # Service annotations for an internal load balancer
    # Resources that must exist before workloads are deployed (node groups, add-ons, access entries).
    ready: Sequence[pulumi.Resource] = ()
    # Where pods get workload-identity credentials (EKS Pod Identity agent, GKE metadata server):
    # NetworkPolicies must allow egress to these.
    workload_identity_egress: Sequence[EgressTarget] = ()
    # The managed PostgreSQL for MLflow, when the settings ask for one (mlflow.database: managed).
    mlflow_database: ManagedDatabase | None = None
    # Where container logs outlive their pods; None: the cloud ships them itself (GKE's Cloud Logging).
    log_store: LogStore | None = None
    # Where `gpu-train logs` reads a rank's log once its pod is gone (the published contract's `logs`): CloudWatch Logs groups
    # (the log store above) or the cloud's own logging.
    logs: Mapping[str, Any] = field(default_factory=dict)
    node_addons: NodeAddons = field(default_factory=lambda: NodeAddons(device_plugin=True))
    # Environment every training container gets from the cloud (e.g. AWS_REGION for the S3 and STS clients).
    pod_env: Mapping[str, str] = field(default_factory=dict)

    def pool(self, name: str) -> GpuPool:
        for pool in self.gpu_pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no GPU pool named {name!r} (pools: {[p.name for p in self.gpu_pools]})")
