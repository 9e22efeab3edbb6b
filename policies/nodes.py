"""Node and image-registry rules: IMDSv2 (and GKE's metadata server), immutable scanned registries.

Usage: `from policies import nodes; list(nodes.imdsv2_required(res, ctx))` yields one detail string
per problem.

References: IMDSv2 (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html);
Karpenter's EC2NodeClass defaults httpTokens to "required"
(https://karpenter.sh/docs/concepts/nodeclasses/#specmetadataoptions); GKE metadata server
(https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity); ECR tag immutability and
scan on push (https://docs.aws.amazon.com/AmazonECR/latest/userguide/image-tag-mutability.html).
"""

from __future__ import annotations

from collections.abc import Iterator

from policies.core import Context, Resource, truthy

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
EC2_NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
GKE_NODE_POOL = "gcp:container/nodePool:NodePool"
ECR_REPOSITORY = "aws:ecr/repository:Repository"
GAR_REPOSITORY = "gcp:artifactregistry/repository:Repository"


def imdsv2_required(res: Resource, ctx: Context) -> Iterator[str]:
    """Instances require IMDSv2 session tokens; GKE nodes hide the node metadata from pods."""
    if res.type in (LAUNCH_TEMPLATE, INSTANCE):
        tokens = res.get("metadataOptions", "httpTokens")
        if tokens != "required":
            yield f"metadataOptions.httpTokens is {tokens!r}; IMDSv1 stays reachable unless it is 'required'."
    elif res.type == EC2_NODE_CLASS:
        tokens = res.get("spec", "metadataOptions", "httpTokens", default="required")
        if tokens != "required":
            yield f"spec.metadataOptions.httpTokens is {tokens!r}, not 'required'."
    elif res.type == GKE_NODE_POOL:
        mode = res.get("nodeConfig", "workloadMetadataConfig", "mode")
        if mode != "GKE_METADATA":
            yield (f"nodeConfig.workloadMetadataConfig.mode is {mode!r}; pods can read the node's "
                   "credentials unless it is 'GKE_METADATA'.")


def registry_immutable_scanned(res: Resource, ctx: Context) -> Iterator[str]:
    """Image repositories have immutable tags; ECR also scans every pushed image."""
    if res.type == ECR_REPOSITORY:
        mutability = res.get("imageTagMutability", default="MUTABLE")
        if mutability != "IMMUTABLE":
            yield f"imageTagMutability is {mutability!r}, not 'IMMUTABLE'."
        if not truthy(res.get("imageScanningConfiguration", "scanOnPush")):
            yield "imageScanningConfiguration.scanOnPush is not true."
    elif (res.type == GAR_REPOSITORY and res.get("format", default="DOCKER") == "DOCKER"
          and not truthy(res.get("dockerConfig", "immutableTags"))):
        yield "dockerConfig.immutableTags is not true."
