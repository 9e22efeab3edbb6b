"""Node and image-registry rules: node credentials out of pods' reach, immutable scanned registries.

Usage: `from policies import nodes; list(nodes.imdsv2_required(res, ctx))` yields one detail string
per problem.

Node credentials: a pod reaches the node's instance role through the instance metadata service
unless IMDSv2 is required (tokens) and the token's hop limit is 1, which stops a token from
crossing the container's extra network hop. EC2 launch templates must say so explicitly: without
`httpPutResponseHopLimit`, the AMI's default applies, and AL2023 AMIs default to 2
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-IMDS-new-instances.html). Karpenter's
EC2NodeClass defaults to tokens required and hop limit 1 (its CRD's `metadataOptions` default at the
pinned chart version, https://karpenter.sh/docs/concepts/nodeclasses/#specmetadataoptions). On GKE,
the GKE metadata server hides the node's credentials, and the legacy Compute Engine metadata
endpoints (v0.1, v1beta1, which need no `Metadata-Flavor` header) must stay disabled: GKE disables
them unless the node metadata sets `disable-legacy-endpoints` to "false"
(https://cloud.google.com/kubernetes-engine/docs/how-to/protecting-cluster-metadata).

Registries: tags are immutable, so a tag always names the image that was built and reviewed, and ECR
scans every push (https://docs.aws.amazon.com/AmazonECR/latest/userguide/image-tag-mutability.html;
`IMMUTABLE_WITH_EXCLUSION` counts when its exclusion filters name specific tags, not `*`). One
exemption: a repository tagged or labelled `purpose: build-cache` may keep mutable tags when no typed
workload of the stack runs an image from it, because BuildKit's registry cache rewrites one tag on
every build (https://docs.docker.com/build/cache/backends/registry/).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from policies import pods
from policies.core import Context, Resource, as_int, dig, falsy, items, truthy

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
EC2_NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
GKE_CLUSTER = "gcp:container/cluster:Cluster"
GKE_NODE_POOL = "gcp:container/nodePool:NodePool"
ECR_REPOSITORY = "aws:ecr/repository:Repository"
GAR_REPOSITORY = "gcp:artifactregistry/repository:Repository"
MAX_HOP_LIMIT = 1
KARPENTER_DEFAULT_HOP_LIMIT = 1
LEGACY_ENDPOINTS_KEY = "disable-legacy-endpoints"
BUILD_CACHE = "build-cache"  # purpose tag/label of a BuildKit cache repository


def _hop_problem(where: str, hops, default: int | None) -> str | None:
    value = as_int(hops)
    if value is None and default is None:
        return (f"{where}.httpPutResponseHopLimit is not set, so the AMI's default applies (2 on AL2023) "
                "and containers can reach the node's IMDSv2 tokens.")
    value = default if value is None else value
    if value > MAX_HOP_LIMIT:
        return (f"{where}.httpPutResponseHopLimit is {value}; above {MAX_HOP_LIMIT}, IMDSv2 tokens reach "
                "containers and with them the node's instance role.")
    return None


def _gke_node_config(config: Mapping, where: str) -> Iterator[str]:
    mode = dig(config, "workloadMetadataConfig", "mode")
    if mode != "GKE_METADATA":
        yield (f"{where}.workloadMetadataConfig.mode is {mode!r}; pods can read the node's credentials unless "
               "it is 'GKE_METADATA'.")
    if falsy(dig(config, "metadata", LEGACY_ENDPOINTS_KEY)):
        yield (f"{where}.metadata.{LEGACY_ENDPOINTS_KEY} is false, which turns the legacy Compute Engine "
               "metadata endpoints back on.")


def imdsv2_required(res: Resource, ctx: Context) -> Iterator[str]:
    """Nodes keep their credentials from pods: IMDSv2 with hop limit 1; GKE metadata server, no legacy endpoints."""
    if res.type in (LAUNCH_TEMPLATE, INSTANCE):
        if res.get("metadataOptions", "httpEndpoint") == "disabled":
            return
        tokens = res.get("metadataOptions", "httpTokens")
        if tokens != "required":
            yield f"metadataOptions.httpTokens is {tokens!r}; IMDSv1 stays reachable unless it is 'required'."
        problem = _hop_problem("metadataOptions", res.get("metadataOptions", "httpPutResponseHopLimit"), None)
        if problem:
            yield problem
    elif res.type == EC2_NODE_CLASS:
        if res.get("spec", "metadataOptions", "httpEndpoint") == "disabled":
            return
        tokens = res.get("spec", "metadataOptions", "httpTokens", default="required")
        if tokens != "required":
            yield f"spec.metadataOptions.httpTokens is {tokens!r}, not 'required'."
        problem = _hop_problem("spec.metadataOptions", res.get("spec", "metadataOptions", "httpPutResponseHopLimit"),
                               KARPENTER_DEFAULT_HOP_LIMIT)
        if problem:
            yield problem
    elif res.type == GKE_NODE_POOL:
        yield from _gke_node_config(res.get("nodeConfig") or {}, "nodeConfig")
    elif res.type == GKE_CLUSTER and not truthy(res.get("removeDefaultNodePool")):
        # The default node pool exists unless removed; its nodes follow the cluster's nodeConfig.
        yield from _gke_node_config(res.get("nodeConfig") or {}, "nodeConfig (default node pool)")


def _repository_name(res: Resource) -> str:
    return str(res.get("name") or res.get("repositoryId") or "")


def _is_immutable(res: Resource) -> tuple[bool, str]:
    """(immutable, what the setting is) for an ECR or Artifact Registry Docker repository."""
    if res.type == ECR_REPOSITORY:
        mutability = res.get("imageTagMutability", default="MUTABLE")
        if mutability == "IMMUTABLE":
            return True, mutability
        filters = [dig(f, "filter") for f in items(res.get("imageTagMutabilityExclusionFilters"))]
        if mutability == "IMMUTABLE_WITH_EXCLUSION" and filters and all(f and f != "*" for f in filters):
            return True, mutability
        return False, f"imageTagMutability is {mutability!r}, not 'IMMUTABLE'"
    return truthy(res.get("dockerConfig", "immutableTags")), "dockerConfig.immutableTags is not true"


def _images_run(resources: Sequence[Resource]) -> set[str]:
    """Image repositories (registry/path, no tag or digest) of every container of every typed workload."""
    found = set()
    for res in resources:
        obj = pods.k8s_object(res)
        for _, spec in pods.pod_specs(obj) if obj is not None else []:
            found |= {pods.image_repository(c.get("image")) for _, c in pods.containers(spec)}
    return found


def registry_immutable_scanned(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Image repositories have immutable tags and ECR scans on push; a build cache that no workload runs
    from may keep mutable tags."""
    run = _images_run(resources)
    for res in resources:
        if res.type == ECR_REPOSITORY and not truthy(res.get("imageScanningConfiguration", "scanOnPush")):
            yield res, "imageScanningConfiguration.scanOnPush is not true."
        if res.type not in (ECR_REPOSITORY, GAR_REPOSITORY) or (
                res.type == GAR_REPOSITORY and res.get("format", default="DOCKER") != "DOCKER"):
            continue
        immutable, setting = _is_immutable(res)
        if immutable:
            continue
        name = _repository_name(res)
        purpose = (res.get("tags") or res.get("labels") or {}).get("purpose")
        runs_from = sorted(i for i in run if name and name in i.split("/")[1:])
        if purpose == BUILD_CACHE and not runs_from:
            continue  # the documented build-cache exemption: BuildKit overwrites its cache tag each build
        why = (f"; workloads run {', '.join(runs_from)} from it" if runs_from
               else f" (only a repository labelled purpose={BUILD_CACHE} that no workload runs from may be mutable)")
        yield res, f"{setting}, so a tag can be re-pointed at another image{why}."
