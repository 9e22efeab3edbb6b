"""The platform contract a team member's `gpu-train` works from: the stack's `platform` output, also published in
every team namespace (ConfigMap gpu-train-platform, key platform.json).

Usage:
    contract = PlatformContract("platform-contract", PlatformContractArgs(platform=..., stack=cfg.stack, teams=cfg.teams,
                                                                         image=image.ref, ...))
    pulumi.export("platform", contract.document)        # infra/__main__.py

The document is gpu_train.spec.contract.PlatformContract, filled here from the cloud's contract, the settings and
the image once their values are known; `gpu-train` reads it back with the same model (docs/teams.md). It holds
no credential: the kubeconfig it carries authenticates with the cloud CLI's exec plugin.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.jobs import queues as kueue
from gpu_train.spec import naming
from gpu_train.spec.contract import Cluster, Endpoints, Identity
from gpu_train.spec.contract import PlatformContract as ContractDocument
from gpu_train.spec.pod_rules import registry_prefix
from gpu_train.spec.settings import TeamSettings
from infra.platform import ClusterPlatform


@dataclass(frozen=True, kw_only=True)
class PlatformContractArgs:
    platform: ClusterPlatform  # the cloud contract
    stack: str  # the stack's name
    project: str  # the cloud project ("" on AWS)
    teams: Sequence[TeamSettings]  # the teams: their quotas, namespaces and queues
    allowed_registries: Sequence[str]  # image.allowedRegistries: registries a job's own image may come from
    repositories: Sequence[str]  # single repositories allowed besides (the prebuilt trainer image's)
    image: pulumi.Input[str]  # the digest-pinned trainer image (TrainerImage.ref)
    cache_endpoint: str  # the Alluxio S3 proxy ("" without the cache)
    tracking_uri: pulumi.Input[str]  # MLflow ("" without it)
    team_namespaces: Sequence[pulumi.Resource]  # the ConfigMaps go into these
    serving: pulumi.Input[dict] | None = None  # the `serving` section (infra/k8s/serving.py), where the stack serves


def contract_document(p: ClusterPlatform, args: PlatformContractArgs, *, cluster_name: str,
                      kubeconfig: dict[str, Any], image: str, repository: str, buckets: dict[str, str],
                      tracking_uri: str, logs: dict[str, Any], serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """The contract document from resolved values."""
    pools = list(p.gpu_pools)
    return ContractDocument(
        stack=args.stack, cloud=p.cloud, region=p.region, project=args.project,
        kubernetes_version=p.kubernetes_version, cluster=Cluster(name=cluster_name, kubeconfig=kubeconfig),
        image=image, registries=[registry_prefix(repository), *args.allowed_registries],
        repositories=list(args.repositories),
        nvme_host_path=p.nvme_host_path, pools=pools, teams=kueue.team_entries(args.teams, pools, p.nvme_host_path),
        kueue=kueue.kueue_objects(args.teams, pools, p.system_node_selector),
        buckets=buckets,
        endpoints=Endpoints(object_store=p.object_store_endpoint, cache=args.cache_endpoint, tracking=tracking_uri),
        identities={key: Identity(namespaces=list(i.namespaces), service_account=i.name)
                    for key, i in sorted(p.identities.items()) if key.startswith(("trainer/", "sweeps/", "data-prep/"))},
        logs=logs, pod_env=dict(p.pod_env), serving=serving,
    ).document()


class PlatformContract(pulumi.ComponentResource):
    """The contract document (`document`, for the stack output) and its ConfigMap in every team namespace."""

    document: pulumi.Output[dict]

    def __init__(self, name: str, args: PlatformContractArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:PlatformContract", name, None, opts)
        p = args.platform

        def build(values: list[Any]) -> dict[str, Any]:
            cluster_name, kubeconfig, image, repo, datasets, checkpoints, artifacts, tracking, logs, serving = values
            return contract_document(
                p, args, cluster_name=cluster_name, kubeconfig=json.loads(kubeconfig), image=image, repository=repo,
                buckets={"datasets": datasets, "checkpoints": checkpoints, "artifacts": artifacts},
                tracking_uri=tracking or "", logs=logs, serving=serving)

        # The kubeconfig holds no credential (its user runs `aws eks get-token` / gke-gcloud-auth-plugin), so the
        # contract that carries it to team members is not a secret.
        self.document = pulumi.Output.all(
            p.cluster_name, pulumi.Output.unsecret(p.kubeconfig), args.image, p.registry.repository,
            p.buckets.datasets, p.buckets.checkpoints, p.buckets.artifacts, args.tracking_uri,
            pulumi.Output.from_input(dict(p.logs)), args.serving).apply(build)
        text = self.document.apply(lambda d: json.dumps(d, indent=1, sort_keys=True))
        for team in args.teams:
            ns = naming.team_namespace(team.name)
            k8s.core.v1.ConfigMap(
                f"{name}-{team.name}",
                metadata={"name": naming.PLATFORM_CONFIGMAP, "namespace": ns,
                          "labels": {"app.kubernetes.io/part-of": "gpu-train", naming.TEAM_LABEL: team.name}},
                data={naming.PLATFORM_CONFIGMAP_KEY: text},
                opts=pulumi.ResourceOptions(parent=self, provider=p.provider, depends_on=list(args.team_namespaces)))
        self.register_outputs({"document": self.document})
