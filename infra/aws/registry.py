"""ECR repositories for the trainer image and its build cache, and push credentials for the platform's Registry.

Usage:
    reg = ContainerRegistry("registry", RegistryArgs(name="gpu-train-aws-dev-trainer", key_arn=k, tags=t))
    reg.registry  # infra.platform.Registry (repository URL, cache repository, server, user, secret password)

Two repositories, both KMS-encrypted with the ecr key:

- `<name>`: the images jobs run. Tags are immutable: a tag (the content hash, infra/image.py) always
  names the same image.
- `<name>-buildcache`: BuildKit's registry cache. The cache is one manifest that every build
  overwrites under the same tag, which an immutable repository refuses on the second `pulumi up`;
  so this repository alone has mutable tags. Nothing runs from it (the JobSet pulls the trainer by
  digest from the first repository), and its lifecycle policy expires the cache manifests each build
  replaces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.platform import Registry

KEEP_IMAGES = 50
UNTAGGED_DAYS = 7
CACHE_SUFFIX = "-buildcache"
CACHE_UNTAGGED_DAYS = 1  # a replaced cache manifest is never read again


def lifecycle_policy() -> dict:
    """Drop untagged layers after a week; keep the newest KEEP_IMAGES images."""
    return {"rules": [
        {"rulePriority": 1, "description": f"expire untagged images after {UNTAGGED_DAYS} days",
         "selection": {"tagStatus": "untagged", "countType": "sinceImagePushed", "countUnit": "days",
                       "countNumber": UNTAGGED_DAYS},
         "action": {"type": "expire"}},
        {"rulePriority": 2, "description": f"keep the newest {KEEP_IMAGES} images",
         "selection": {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": KEEP_IMAGES},
         "action": {"type": "expire"}},
    ]}


def cache_lifecycle_policy() -> dict:
    """The cache tag moves to each new cache manifest; the one it left is untagged and can go."""
    return {"rules": [
        {"rulePriority": 1, "description": f"expire replaced cache manifests after {CACHE_UNTAGGED_DAYS} day",
         "selection": {"tagStatus": "untagged", "countType": "sinceImagePushed", "countUnit": "days",
                       "countNumber": CACHE_UNTAGGED_DAYS},
         "action": {"type": "expire"}},
    ]}


@dataclass(frozen=True, kw_only=True)
class RegistryArgs:
    name: str  # repository name; the cache repository is <name>-buildcache
    key_arn: pulumi.Input[str]  # the ECR KMS key
    force_delete: bool  # dev: delete with images inside
    tags: Mapping[str, str]  # common tags


class ContainerRegistry(pulumi.ComponentResource):
    def __init__(self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        encryption = [aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="KMS", kms_key=args.key_arn)]
        repo = aws.ecr.Repository(
            name, name=args.name, image_tag_mutability="IMMUTABLE", force_delete=args.force_delete,
            image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
            encryption_configurations=encryption, tags=args.tags, opts=child)
        aws.ecr.LifecyclePolicy(name, repository=repo.name, policy=json.dumps(lifecycle_policy()), opts=child)
        cache = aws.ecr.Repository(
            f"{name}-cache", name=f"{args.name}{CACHE_SUFFIX}", image_tag_mutability="MUTABLE",
            # A cache is always disposable, in every environment.
            force_delete=True,
            image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
            encryption_configurations=encryption, tags={**args.tags, "purpose": "build-cache"}, opts=child)
        aws.ecr.LifecyclePolicy(f"{name}-cache", repository=cache.name, policy=json.dumps(cache_lifecycle_policy()),
                                opts=child)
        token = aws.ecr.get_authorization_token_output(registry_id=repo.registry_id,
                                                       opts=pulumi.InvokeOutputOptions(parent=self))
        self.repository_url = repo.repository_url
        self.registry = Registry(
            repository=repo.repository_url,
            cache_repository=cache.repository_url,
            server=token.proxy_endpoint.apply(lambda e: e.removeprefix("https://")),
            username=token.user_name,
            password=pulumi.Output.secret(token.password),
        )
        self.register_outputs({"repository_url": repo.repository_url, "cache_repository_url": cache.repository_url})
