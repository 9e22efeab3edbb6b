"""The platform contract: what a stack offers its jobs, as one typed document.

Usage:
    contract = PlatformContract.from_json(text, source="platform.json")   # ContractError names the key
    pool, team = contract.pool("h100-spot"), contract.team("research")
    doc = contract.document()                                              # the JSON-able dict, camelCase keys

The Pulumi program writes it (the stack output `platform`, and the ConfigMap `gpu-train-platform` in every team
namespace); `gpu-train` reads it to render and check a team's job exactly as the stack renders and checks its
own: the cloud and region, each GPU pool with its node selector, tolerations, fabric (extended resources, pod
annotations, NCCL environment, host volumes, sidecars) and what one of its nodes leaves to a training pod; the
image and the registries the admission policies accept; the NVMe root; buckets and endpoints; each team's
namespace, queues, quota and service account; Kueue's queues and flavors; the environment every training pod
gets from the cloud; where container logs are kept; and, where the stack serves models, what serving needs. It
holds no credential: the kubeconfig it carries authenticates through the cloud CLI's exec plugin.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_serializer,
    field_validator,
)
from pydantic.alias_generators import to_camel

from gpu_train.spec.errors import validation_problems

API_VERSION = "gpu-train.io/v1"
KIND = "PlatformContract"
FabricKind = Literal["none", "efa", "tcpx", "tcpxo", "rdma"]


class ContractError(ValueError):
    """A platform contract the command cannot use; the message names where."""


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


class Fabric(Model):
    """How a pod on a pool's nodes uses the high-bandwidth GPU network."""

    kind: FabricKind
    # Extended resources a one-pod-per-node worker requests, e.g. {"vpc.amazonaws.com/efa": 32}.
    resources: dict[str, int] = Field(default_factory=dict)
    # Pod annotations, e.g. GKE's networking.gke.io/interfaces for multi-network pods.
    annotations: dict[str, str] = Field(default_factory=dict)
    # NCCL / libfabric environment for the training container, in the container's order (a list in the
    # document: a JSON object's key order is not kept everywhere).
    nccl_env: dict[str, str] = Field(default_factory=dict)
    # Extra pod volumes (Kubernetes Volume dicts) and the training container's mounts of them.
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    # Containers run as native sidecars (init containers with restartPolicy Always), e.g. GPUDirect's RxDM.
    sidecars: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("nccl_env", mode="before")
    @classmethod
    def _env_from_list(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {e["name"]: e["value"] for e in value}
        return value

    @field_serializer("nccl_env")
    def _env_as_list(self, value: dict[str, str]) -> list[dict[str, str]]:
        return [{"name": k, "value": v} for k, v in value.items()]


class Allocatable(Model):
    """What one node of a pool leaves to a training pod: the kubelet's allocatable less the node agents' share."""

    cpu: str  # a Kubernetes quantity, e.g. "186.51"
    memory: str  # e.g. "1879048192Ki"


class GpuPool(Model):
    """One GPU node pool as a job sees it."""

    name: str
    instance_type: str
    capacity: str  # spot | on-demand | reservation | capacity-block
    gpu_type: str  # e.g. "H100"
    gpus_per_node: int
    min_nodes: int
    max_nodes: int
    zone: str = ""  # "" when the pool spans the region's zones
    node_selector: dict[str, str]  # selects exactly this pool's nodes
    tolerations: list[dict[str, str]]  # tolerate the GPU taint (and any pool taints)
    # How nodes appear: "karpenter" (AWS NodePool, created on demand) or "node-pool" (GKE node pool with the
    # cluster autoscaler).
    provisioner: str
    fabric: Fabric
    allocatable: Allocatable | None = None


class Team(Model):
    name: str
    namespace: str
    namespace_labels: dict[str, str]
    local_queue: str
    cluster_queue: str
    gpu_quota: dict[str, int]  # nominal GPUs per pool
    service_account: str
    nvme_workdir: str
    submitters: list[str] = Field(default_factory=list)
    viewers: list[str] = Field(default_factory=list)


class Kueue(Model):
    """Kueue's objects as the cluster has them, for the admission check of a submitted job."""

    cluster_queues: list[dict[str, Any]]
    resource_flavors: list[dict[str, Any]]
    limit_range: dict[str, Any]
    excluded_resource_prefixes: list[str]


class Cluster(Model):
    name: str = ""
    kubeconfig: dict[str, Any]


class Endpoints(Model):
    object_store: str = ""
    cache: str = ""  # the Alluxio S3 proxy ("" without the cache)
    tracking: str = ""  # MLflow ("" without it)


class Identity(Model):
    namespaces: list[str]
    service_account: str


class CloudWatchLogs(Model):
    """Container logs kept in CloudWatch Logs, one group per team namespace (written by the platform's shipper)."""

    kind: Literal["cloudwatch"]
    region: str
    groups: dict[str, str] = Field(default_factory=dict)  # team namespace -> log group


class CloudLoggingLogs(Model):
    """Container logs kept by Cloud Logging, which GKE ships every container's log to."""

    kind: Literal["cloud-logging"]
    project: str
    cluster: str


# Where container logs outlive their pods, for `gpu-train logs`.
Logs = Annotated[CloudWatchLogs | CloudLoggingLogs, Field(discriminator="kind")]


class Serving(Model):
    """What a team's `gpu-train serve` needs to render its services as the stack renders its own (present only
    when the stack enables serving)."""

    kserve_version: str
    # Backend (vllm | huggingface) -> KServe's Hugging Face server image for it (pinned by the platform).
    runtime_images: dict[str, str]
    # Where MLflow keeps artifacts (its --artifacts-destination, s3://<bucket>/<prefix> or gs://...): a model
    # version's files, which the predictor's storage initializer reads with the team's model-server identity.
    artifacts_root: str
    cpu_node_selector: dict[str, str]  # where CPU runtimes, routes and promotion loops run
    gpu_pools: list[str] = Field(default_factory=list)  # GPU pools services may run on (no team quota there)
    prometheus: str  # the in-cluster Prometheus the promotion loop reads
    scrape_interval_seconds: int  # how often Prometheus scrapes the routes (part of the reaction bound)


class PlatformContract(Model):
    api_version: Literal["gpu-train.io/v1"] = API_VERSION
    kind: Literal["PlatformContract"] = KIND
    stack: str = ""
    cloud: Literal["aws", "gcp"]
    region: str
    project: str = ""
    kubernetes_version: str = ""
    cluster: Cluster
    image: str
    registries: list[str]
    repositories: list[str] = Field(default_factory=list)
    nvme_host_path: str
    pools: list[GpuPool]
    teams: list[Team]
    kueue: Kueue
    buckets: dict[str, str]
    endpoints: Endpoints
    identities: dict[str, Identity] = Field(default_factory=dict)
    logs: Logs
    # Environment every training container gets from the cloud (e.g. AWS_REGION for the S3 and STS clients).
    pod_env: dict[str, str] = Field(default_factory=dict)
    # Model serving (KServe); left out of the document when the stack does not enable it.
    serving: Serving | None = Field(None, exclude_if=lambda v: v is None)
    _source: str = PrivateAttr("")

    @property
    def source(self) -> str:
        """Where this contract was read from (a file, or configmap <namespace>/gpu-train-platform)."""
        return self._source

    @classmethod
    def from_document(cls, doc: Any, source: str) -> PlatformContract:
        if not isinstance(doc, dict):
            raise ContractError(f"{source}: not a platform contract (a JSON object)")
        if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
            raise ContractError(f"{source}: apiVersion/kind are {doc.get('apiVersion')!r}/{doc.get('kind')!r}, this "
                                f"gpu-train reads {API_VERSION}/{KIND}")
        try:
            contract = cls.model_validate(doc)
        except ValidationError as exc:
            problems = validation_problems(exc, prefix="", root=cls, raw=doc)
            raise ContractError("\n".join(f"{source}: {p}" for p in problems)) from None
        contract._source = source
        return contract

    @classmethod
    def from_json(cls, text: str, source: str) -> PlatformContract:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ContractError(f"{source}: not JSON ({exc})") from None
        return cls.from_document(doc, source)

    def pool(self, name: str) -> GpuPool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ContractError(f"pool {name!r} is not on this platform (pools: {', '.join(p.name for p in self.pools)})")

    def team(self, name: str) -> Team:
        for team in self.teams:
            if team.name == name:
                return team
        raise ContractError(f"team {name!r} is not on this platform (teams: {', '.join(t.name for t in self.teams)})")

    def bucket(self, name: str) -> str:
        return self.buckets.get(name, "")
