"""Artifact Registry Docker repositories (CMEK, cleanup) for the trainer image and its build cache.

Usage (inside the Pulumi program; `build_platform` does this):
    reg = ArtifactRegistry("registry", ArtifactRegistryArgs(stack=cfg.stack, project=cfg.project,
                                                            region=cfg.region, labels=tags, kms_key=key),
                           opts=ResourceOptions(depends_on=[keys.grants["registry"]]))
    reg.contract   # infra.platform.Registry for the image build

Two repositories: the image repository has immutable tags, so a pushed trainer tag can never be
moved; BuildKit's registry cache is one tag (`:buildcache`) overwritten by every build, which an
immutable repository refuses from the second `pulumi up` on. The cache therefore lives in a second,
tag-mutable repository (`Registry.cache_repository`), encrypted with the same key and cleaned up
on its own schedule. Artifact Registry's immutable tags apply to every tag of a repository, with no
per-tag exception (`DockerRepositoryConfig.immutableTags`,
https://cloud.google.com/artifact-registry/docs/reference/rest/v1/projects.locations.repositories).

Pushes authenticate with a short-lived OAuth access token of whoever runs `pulumi up`
(username "oauth2accesstoken", https://cloud.google.com/artifact-registry/docs/docker/authentication#token),
so no long-lived key exists anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming
from infra.platform import Registry

IMAGE = "trainer"
KEEP_RECENT = 20  # newest versions kept whatever their age
UNTAGGED_MAX_AGE = "604800s"  # untagged manifests (superseded pushes) deleted after 7 days
# Build cache: a rebuilt cache leaves the previous manifest untagged (gone after a day); a cache
# no build has refreshed for 30 days goes too, except the newest two versions.
CACHE_KEEP_RECENT = 2
CACHE_UNTAGGED_MAX_AGE = "86400s"
CACHE_MAX_AGE = "2592000s"


def registry_host(region: str) -> str:
    return f"{region}-docker.pkg.dev"


def cleanup_policies() -> list[dict]:
    """Cleanup policies as plain dicts: keep the newest versions, delete old untagged ones."""
    return [
        {"id": "keep-recent", "action": "KEEP", "most_recent_versions": {"keep_count": KEEP_RECENT}},
        {"id": "delete-old-untagged", "action": "DELETE",
         "condition": {"tag_state": "UNTAGGED", "older_than": UNTAGGED_MAX_AGE}},
    ]


def cache_cleanup_policies() -> list[dict]:
    """Cleanup policies of the build-cache repository as plain dicts (KEEP wins over DELETE)."""
    return [
        {"id": "keep-newest", "action": "KEEP", "most_recent_versions": {"keep_count": CACHE_KEEP_RECENT}},
        {"id": "delete-superseded", "action": "DELETE",
         "condition": {"tag_state": "UNTAGGED", "older_than": CACHE_UNTAGGED_MAX_AGE}},
        {"id": "delete-stale", "action": "DELETE", "condition": {"tag_state": "ANY", "older_than": CACHE_MAX_AGE}},
    ]


def _policy_args(policies: list[dict]) -> list[gcp.artifactregistry.RepositoryCleanupPolicyArgs]:
    return [gcp.artifactregistry.RepositoryCleanupPolicyArgs(
        id=p["id"], action=p["action"],
        most_recent_versions=gcp.artifactregistry.RepositoryCleanupPolicyMostRecentVersionsArgs(
            **p["most_recent_versions"]) if "most_recent_versions" in p else None,
        condition=gcp.artifactregistry.RepositoryCleanupPolicyConditionArgs(**p["condition"])
        if "condition" in p else None) for p in policies]


@dataclass(frozen=True, kw_only=True)
class ArtifactRegistryArgs:
    stack: str  # the Pulumi stack name (names the repositories)
    project: str  # GCP project id
    region: str  # the repositories' location (regional, next to the cluster)
    labels: dict[str, str]  # common labels
    kms_key: pulumi.Input[str]  # CMEK for image layers


class ArtifactRegistry(pulumi.ComponentResource):
    """The trainer image repository and its build-cache repository."""

    def __init__(self, name: str, args: ArtifactRegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:ArtifactRegistry", name, None, opts)
        stack, project, region = args.stack, args.project, args.region
        self.repository = gcp.artifactregistry.Repository(
            f"{name}-docker", repository_id=naming.resource_name(stack, "images"), project=project,
            location=region, format="DOCKER", kms_key_name=args.kms_key,
            docker_config=gcp.artifactregistry.RepositoryDockerConfigArgs(immutable_tags=True),
            cleanup_policies=_policy_args(cleanup_policies()), cleanup_policy_dry_run=False, labels=args.labels,
            description=f"Trainer images for {stack}",
            opts=pulumi.ResourceOptions(parent=self))
        self.cache_repository = gcp.artifactregistry.Repository(
            f"{name}-cache", repository_id=naming.resource_name(stack, "buildcache"), project=project,
            location=region, format="DOCKER", kms_key_name=args.kms_key,
            docker_config=gcp.artifactregistry.RepositoryDockerConfigArgs(immutable_tags=False),
            cleanup_policies=_policy_args(cache_cleanup_policies()), cleanup_policy_dry_run=False,
            labels={**args.labels, "purpose": "build-cache"},
            description=f"BuildKit layer cache of the trainer image build for {stack} (tags are overwritten)",
            opts=pulumi.ResourceOptions(parent=self))
        server = registry_host(region)
        client = gcp.organizations.get_client_config_output(opts=pulumi.InvokeOutputOptions(parent=self))
        self.contract = Registry(
            repository=pulumi.Output.concat(server, "/", project, "/", self.repository.repository_id,
                                            "/", IMAGE),
            server=pulumi.Output.from_input(server),
            username=pulumi.Output.from_input("oauth2accesstoken"),
            password=pulumi.Output.secret(client.access_token),
            cache_repository=pulumi.Output.concat(server, "/", project, "/",
                                                  self.cache_repository.repository_id, "/", IMAGE),
        )
        self.register_outputs({"repository": self.contract.repository,
                               "cache_repository": self.contract.cache_repository})
