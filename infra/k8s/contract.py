"""The platform contract a team member's `gpu-train` command works from: the stack's `platform` output,
also published in every team namespace (ConfigMap gpu-train-platform, key platform.json).

Usage:
    PlatformContract("platform-contract", PlatformContractArgs(platform=..., cfg=cfg, image=image.ref, ...))
    pulumi.export("platform", contract.document)        # infra/__main__.py
    doc = contract_document(...)                         # pure: plain values in, a JSON-able dict out
    contract = Contract.from_document(doc, source="platform.json")   # gpu_train_cli reads it back

What `gpu-train submit` needs to render a job exactly as the stack renders its own
(infra.k8s.training.jobset_manifest) and to check it exactly as the plan does (infra.config.read_job and
training.kueue_problems): the cloud and region, each GPU pool with its instance type, node selector,
tolerations and fabric (extended resources, pod annotations, NCCL environment, host volumes, sidecars),
the trainer image and the registries the admission policies accept, the NVMe root, the buckets and
endpoints (object store, Alluxio proxy, MLflow), each team's namespace, queue, quota and workload
identity (the trainer service account the cloud binds), Kueue's queues and flavors as the cluster has
them, and where container logs are kept. It
holds no credential: the kubeconfig it carries authenticates with the cloud CLI's exec plugin.

`Contract` is the reading side: one error line naming the file and the key for a document the command
cannot use (another format version, a missing field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import config as stack_config
from infra import naming
from infra.k8s import nvme, tenancy
from infra.platform import ClusterPlatform, Fabric, GpuPool, WorkloadIdentity

API_VERSION = "gpu-train.io/v1"
KIND = "PlatformContract"


class ContractError(ValueError):
    """A platform contract the command cannot use; the message names where."""


# ------------------------------------------------------------------------------------------ writing


def pool_document(pool: GpuPool) -> dict[str, Any]:
    f = pool.fabric
    return {
        "name": pool.name, "instanceType": pool.instance_type, "capacity": pool.capacity, "gpuType": pool.gpu_type,
        "gpusPerNode": pool.gpus_per_node, "minNodes": pool.min_nodes, "maxNodes": pool.max_nodes, "zone": pool.zone,
        "nodeSelector": dict(pool.node_selector), "tolerations": [dict(t) for t in pool.tolerations],
        "provisioner": pool.provisioner,
        # Fabric networks are cloud-side objects the Kubernetes layer creates; a job refers to them only
        # through the annotations.
        # The environment is a list: its order is the container's, and a JSON object's key order is not kept.
        "fabric": {"kind": f.kind, "resources": dict(f.resources), "annotations": dict(f.annotations),
                   "ncclEnv": [{"name": k, "value": v} for k, v in f.nccl_env.items()],
                   "volumes": [dict(v) for v in f.volumes],
                   "volumeMounts": [dict(m) for m in f.volume_mounts], "sidecars": [dict(s) for s in f.sidecars]},
    }


def contract_document(*, stack: str, cloud: str, region: str, project: str, kubernetes_version: str,
                      cluster_name: str, kubeconfig: Mapping[str, Any], image: str, registries: Sequence[str],
                      repositories: Sequence[str], pools: Sequence[GpuPool], teams: Sequence[stack_config.TeamConfig],
                      nvme_host_path: str, buckets: Mapping[str, str], object_store_endpoint: str,
                      cache_endpoint: str, tracking_uri: str, log_groups: Mapping[str, str],
                      identities: Mapping[str, WorkloadIdentity] | None = None) -> dict[str, Any]:
    """The contract document from resolved values (log_groups: team namespace -> CloudWatch group; empty
    on GCP, where Cloud Logging keeps container logs; identities: platform.identities, of which the teams'
    trainer identities are published: the service account a job's pods run as, in which namespace)."""
    pool_list = list(pools)
    team_docs = []
    for team in teams:
        ns = naming.team_namespace(team.name)
        team_docs.append({
            "name": team.name, "namespace": ns, "namespaceLabels": tenancy.namespace_labels(team.name),
            "localQueue": tenancy.local_queue_name(team.name), "clusterQueue": tenancy.cluster_queue_name(team.name),
            "gpuQuota": tenancy.team_pool_quotas(team, pool_list), "serviceAccount": naming.TRAINER_SERVICE_ACCOUNT,
            "nvmeWorkdir": nvme.workdir_path(nvme_host_path, ns), "submitters": list(team.submitters),
            "viewers": list(team.viewers),
        })
    if cloud == "aws":
        logs: dict[str, Any] = {"kind": "cloudwatch", "region": region, "groups": dict(log_groups)}
    else:
        logs = {"kind": "cloud-logging", "project": project, "cluster": cluster_name}
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "stack": stack, "cloud": cloud, "region": region, "project": project,
        "kubernetesVersion": kubernetes_version,
        "cluster": {"name": cluster_name, "kubeconfig": dict(kubeconfig)},
        "image": image, "registries": list(registries), "repositories": list(repositories),
        "nvmeHostPath": nvme_host_path,
        "pools": [pool_document(p) for p in pool_list],
        "teams": team_docs,
        "kueue": {
            "clusterQueues": tenancy.cluster_queues(teams, pool_list),
            "resourceFlavors": [tenancy.resource_flavor(p) for p in pool_list],
            "limitRange": tenancy.limit_range(),
            "excludedResourcePrefixes": list(tenancy.EXCLUDED_RESOURCE_PREFIXES),
        },
        "buckets": dict(buckets),
        "endpoints": {"objectStore": object_store_endpoint, "cache": cache_endpoint, "tracking": tracking_uri},
        "identities": {key: {"namespaces": list(i.namespaces), "serviceAccount": i.name}
                       for key, i in sorted((identities or {}).items()) if key.startswith("trainer/")},
        "logs": logs,
    }


# ------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class TeamInfo:
    name: str
    namespace: str
    namespace_labels: Mapping[str, str]
    local_queue: str
    cluster_queue: str
    gpu_quota: Mapping[str, int]
    service_account: str
    nvme_workdir: str


def _need(doc: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = doc.get(key) if isinstance(doc, Mapping) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ContractError(f"{where}: {key} is missing or not a {kind.__name__}")
    return value


@dataclass(frozen=True)
class Contract:
    """A platform contract read back, with the objects the stack's own functions take."""

    source: str  # where it came from (a file, or configmap <namespace>/gpu-train-platform)
    doc: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_document(cls, doc: Any, source: str) -> Contract:
        if not isinstance(doc, Mapping):
            raise ContractError(f"{source}: not a platform contract (a JSON object)")
        if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
            raise ContractError(f"{source}: apiVersion/kind are {doc.get('apiVersion')!r}/{doc.get('kind')!r}, this "
                                f"gpu-train reads {API_VERSION}/{KIND}")
        for key, kind in (("cloud", str), ("region", str), ("image", str), ("nvmeHostPath", str), ("pools", list),
                          ("teams", list), ("kueue", dict), ("buckets", dict), ("endpoints", dict), ("logs", dict),
                          ("cluster", dict), ("registries", list)):
            _need(doc, key, kind, source)
        if doc["cloud"] not in ("aws", "gcp"):
            raise ContractError(f"{source}: cloud is {doc['cloud']!r}, not aws or gcp")
        return cls(source=source, doc=doc)

    @classmethod
    def from_json(cls, text: str, source: str) -> Contract:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ContractError(f"{source}: not JSON ({exc})") from None
        return cls.from_document(doc, source)

    # ---------------------------------------------------------------- fields

    @property
    def cloud(self) -> str:
        return self.doc["cloud"]

    @property
    def region(self) -> str:
        return self.doc["region"]

    @property
    def image(self) -> str:
        return self.doc["image"]

    @property
    def nvme_host_path(self) -> str:
        return self.doc["nvmeHostPath"]

    @property
    def cluster_name(self) -> str:
        return str(self.doc["cluster"].get("name", ""))

    @property
    def kubeconfig(self) -> Mapping[str, Any]:
        return _need(self.doc["cluster"], "kubeconfig", dict, f"{self.source}: cluster")

    @property
    def registries(self) -> list[str]:
        return list(self.doc["registries"])

    @property
    def repositories(self) -> list[str]:
        return list(self.doc.get("repositories") or [])

    def bucket(self, name: str) -> str:
        return str(self.doc["buckets"].get(name) or "")

    def endpoint(self, name: str) -> str:
        return str(self.doc["endpoints"].get(name) or "")

    @property
    def logs(self) -> Mapping[str, Any]:
        return self.doc["logs"]

    @property
    def kueue(self) -> Mapping[str, Any]:
        return self.doc["kueue"]

    def team_names(self) -> list[str]:
        return [str(t.get("name")) for t in self.doc["teams"] if isinstance(t, Mapping)]

    def pool_names(self) -> list[str]:
        return [str(p.get("name")) for p in self.doc["pools"] if isinstance(p, Mapping)]

    def team(self, name: str) -> TeamInfo:
        for i, t in enumerate(self.doc["teams"]):
            if isinstance(t, Mapping) and t.get("name") == name:
                where = f"{self.source}: teams[{i}]"
                return TeamInfo(
                    name=name, namespace=_need(t, "namespace", str, where),
                    namespace_labels=_need(t, "namespaceLabels", dict, where),
                    local_queue=_need(t, "localQueue", str, where), cluster_queue=_need(t, "clusterQueue", str, where),
                    gpu_quota={str(k): int(v) for k, v in _need(t, "gpuQuota", dict, where).items()},
                    service_account=_need(t, "serviceAccount", str, where),
                    nvme_workdir=_need(t, "nvmeWorkdir", str, where))
        raise ContractError(f"team {name!r} is not on this platform (teams: {', '.join(self.team_names())})")

    def pool(self, name: str) -> GpuPool:
        for i, p in enumerate(self.doc["pools"]):
            if isinstance(p, Mapping) and p.get("name") == name:
                where = f"{self.source}: pools[{i}]"
                f = _need(p, "fabric", dict, where)
                try:
                    return GpuPool(
                        name=name, instance_type=_need(p, "instanceType", str, where),
                        capacity=_need(p, "capacity", str, where), gpu_type=_need(p, "gpuType", str, where),
                        gpus_per_node=_need(p, "gpusPerNode", int, where), min_nodes=_need(p, "minNodes", int, where),
                        max_nodes=_need(p, "maxNodes", int, where), zone=str(p.get("zone") or ""),
                        node_selector=_need(p, "nodeSelector", dict, where),
                        tolerations=_need(p, "tolerations", list, where), provisioner=_need(p, "provisioner", str, where),
                        fabric=Fabric(kind=_need(f, "kind", str, f"{where}.fabric"), resources=f.get("resources") or {},
                                      annotations=f.get("annotations") or {},
                                      nccl_env={e["name"]: e["value"] for e in f.get("ncclEnv") or []},
                                      volumes=f.get("volumes") or [], volume_mounts=f.get("volumeMounts") or [],
                                      sidecars=f.get("sidecars") or []))
                except (TypeError, ValueError) as exc:
                    raise ContractError(f"{where}: {exc}") from None
        raise ContractError(f"pool {name!r} is not on this platform (pools: {', '.join(self.pool_names())})")

    def stack_config(self) -> stack_config.StackConfig:
        """The slice of stack settings the plan-time job checks read (config.read_job): the cloud, the pools
        with their instance types and sizes, the teams with their GPU quota per pool."""
        pools = tuple(stack_config.GpuPoolConfig(
            name=p.name, instance_type=p.instance_type, capacity=p.capacity, min_nodes=p.min_nodes,
            max_nodes=p.max_nodes, zone=p.zone) for p in (self.pool(n) for n in self.pool_names()))
        teams = tuple(stack_config.TeamConfig(name=t.name, gpu_quota=dict(t.gpu_quota))
                      for t in (self.team(n) for n in self.team_names()))
        return stack_config.StackConfig(cloud=self.cloud, environment="dev", region=self.region, zones=(),
                                        stack=str(self.doc.get("stack") or ""), gpu_pools=pools, teams=teams)


# ------------------------------------------------------------------------------------------ the stack side


@dataclass(frozen=True, kw_only=True)
class PlatformContractArgs:
    platform: ClusterPlatform  # the cloud contract
    cfg: stack_config.StackConfig  # stack name, project, teams, image.prebuilt
    image: pulumi.Input[str]  # the digest-pinned trainer image (TrainerImage.ref)
    cache_endpoint: str  # the Alluxio S3 proxy ("" without the cache)
    tracking_uri: pulumi.Input[str]  # MLflow ("" without it)
    team_namespaces: Sequence[pulumi.Resource]  # the ConfigMaps go into these


class PlatformContract(pulumi.ComponentResource):
    """The contract document (`document`, for the stack output) and its ConfigMap in every team namespace."""

    document: pulumi.Output[dict]

    def __init__(self, name: str, args: PlatformContractArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:PlatformContract", name, None, opts)
        from infra.k8s.pod_admission import registry_prefix, repository_of

        p, cfg = args.platform, args.cfg
        store = p.log_store
        groups = dict(store.groups) if store is not None else {}
        group_keys = sorted(groups)
        prebuilt = [repository_of(cfg.image.prebuilt)] if cfg.image.prebuilt else []

        def build(values: list[Any]) -> dict[str, Any]:
            cluster_name, kubeconfig, image, repo, datasets, checkpoints, artifacts, tracking, *names = values
            return contract_document(
                stack=cfg.stack, cloud=p.cloud, region=p.region, project=cfg.project,
                kubernetes_version=p.kubernetes_version, cluster_name=cluster_name,
                kubeconfig=json.loads(kubeconfig), image=image, registries=[registry_prefix(repo)],
                repositories=prebuilt, pools=list(p.gpu_pools), teams=list(cfg.teams), nvme_host_path=p.nvme_host_path,
                buckets={"datasets": datasets, "checkpoints": checkpoints, "artifacts": artifacts},
                object_store_endpoint=p.object_store_endpoint, cache_endpoint=args.cache_endpoint,
                tracking_uri=tracking or "", log_groups=dict(zip(group_keys, names, strict=True)),
                identities=p.identities)

        # The kubeconfig holds no credential (its user runs `aws eks get-token` / gke-gcloud-auth-plugin), so
        # the contract that carries it to team members is not a secret.
        self.document = pulumi.Output.all(
            p.cluster_name, pulumi.Output.unsecret(p.kubeconfig), args.image, p.registry.repository,
            p.buckets.datasets, p.buckets.checkpoints, p.buckets.artifacts, args.tracking_uri,
            *[groups[k] for k in group_keys]).apply(build)
        text = self.document.apply(lambda d: json.dumps(d, indent=1, sort_keys=True))
        for team in cfg.teams:
            ns = naming.team_namespace(team.name)
            k8s.core.v1.ConfigMap(
                f"{name}-{team.name}",
                metadata={"name": tenancy.PLATFORM_CONFIGMAP, "namespace": ns,
                          "labels": {"app.kubernetes.io/part-of": "gpu-train", naming.TEAM_LABEL: team.name}},
                data={tenancy.PLATFORM_CONFIGMAP_KEY: text},
                opts=pulumi.ResourceOptions(parent=self, provider=p.provider, depends_on=list(args.team_namespaces)))
        self.register_outputs({"document": self.document})
