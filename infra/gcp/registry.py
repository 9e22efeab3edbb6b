"""Artifact Registry Docker repository (CMEK, immutable tags, cleanup) and push credentials.

Usage (inside the Pulumi program; `build_platform` does this):
    reg = ArtifactRegistry("registry", ArtifactRegistryArgs(cfg=cfg, labels=tags, kms_key=key),
                           opts=ResourceOptions(depends_on=[keys.grants["registry"]]))
    reg.contract   # infra.platform.Registry for the image build

Pushes authenticate with a short-lived OAuth access token of whoever runs `pulumi up`
(username "oauth2accesstoken", https://cloud.google.com/artifact-registry/docs/docker/authentication#token),
so no long-lived key exists anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import naming
from infra.config import StackConfig
from infra.platform import Registry

IMAGE = "trainer"
KEEP_RECENT = 20  # newest versions kept whatever their age
UNTAGGED_MAX_AGE = "604800s"  # untagged manifests (superseded pushes) deleted after 7 days


def registry_host(region: str) -> str:
    return f"{region}-docker.pkg.dev"


def cleanup_policies() -> list[dict]:
    """Cleanup policies as plain dicts: keep the newest versions, delete old untagged ones."""
    return [
        {"id": "keep-recent", "action": "KEEP", "most_recent_versions": {"keep_count": KEEP_RECENT}},
        {"id": "delete-old-untagged", "action": "DELETE",
         "condition": {"tag_state": "UNTAGGED", "older_than": UNTAGGED_MAX_AGE}},
    ]


@dataclass(frozen=True, kw_only=True)
class ArtifactRegistryArgs:
    cfg: StackConfig  # project and region (the repository is regional, next to the cluster)
    labels: dict[str, str]  # common labels
    kms_key: pulumi.Input[str]  # CMEK for image layers


class ArtifactRegistry(pulumi.ComponentResource):
    """The trainer image repository."""

    def __init__(self, name: str, args: ArtifactRegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:ArtifactRegistry", name, None, opts)
        cfg = args.cfg
        policies = []
        for p in cleanup_policies():
            policies.append(gcp.artifactregistry.RepositoryCleanupPolicyArgs(
                id=p["id"], action=p["action"],
                most_recent_versions=gcp.artifactregistry.RepositoryCleanupPolicyMostRecentVersionsArgs(
                    **p["most_recent_versions"]) if "most_recent_versions" in p else None,
                condition=gcp.artifactregistry.RepositoryCleanupPolicyConditionArgs(**p["condition"])
                if "condition" in p else None))
        self.repository = gcp.artifactregistry.Repository(
            f"{name}-docker", repository_id=naming.resource_name(cfg, "images"), project=cfg.project,
            location=cfg.region, format="DOCKER", kms_key_name=args.kms_key,
            docker_config=gcp.artifactregistry.RepositoryDockerConfigArgs(immutable_tags=True),
            cleanup_policies=policies, cleanup_policy_dry_run=False, labels=args.labels,
            description=f"Trainer images for {cfg.stack}",
            opts=pulumi.ResourceOptions(parent=self))
        server = registry_host(cfg.region)
        client = gcp.organizations.get_client_config_output(opts=pulumi.InvokeOutputOptions(parent=self))
        self.contract = Registry(
            repository=pulumi.Output.concat(server, "/", cfg.project, "/", self.repository.repository_id,
                                            "/", IMAGE),
            server=pulumi.Output.from_input(server),
            username=pulumi.Output.from_input("oauth2accesstoken"),
            password=pulumi.Output.secret(client.access_token),
        )
        self.register_outputs({"repository": self.contract.repository})
