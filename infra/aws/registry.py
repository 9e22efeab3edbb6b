"""ECR repository for the trainer image, and push credentials for the Registry contract.

Usage:
    reg = ContainerRegistry("registry", RegistryArgs(name="gpu-train-aws-dev-trainer", key_arn=k, tags=t))
    reg.registry  # infra.platform.Registry (repository URL, server, user, secret password)
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


@dataclass(frozen=True, kw_only=True)
class RegistryArgs:
    name: str  # repository name
    key_arn: pulumi.Input[str]  # the ECR KMS key
    force_delete: bool  # dev: delete with images inside
    tags: Mapping[str, str]  # common tags


class ContainerRegistry(pulumi.ComponentResource):
    def __init__(self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        repo = aws.ecr.Repository(
            name, name=args.name, image_tag_mutability="IMMUTABLE", force_delete=args.force_delete,
            image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
            encryption_configurations=[aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="KMS",
                                                                                     kms_key=args.key_arn)],
            tags=args.tags, opts=child)
        aws.ecr.LifecyclePolicy(name, repository=repo.name, policy=json.dumps(lifecycle_policy()), opts=child)
        token = aws.ecr.get_authorization_token_output(registry_id=repo.registry_id)
        self.repository_url = repo.repository_url
        self.registry = Registry(
            repository=repo.repository_url,
            server=token.proxy_endpoint.apply(lambda e: e.removeprefix("https://")),
            username=token.user_name,
            password=pulumi.Output.secret(token.password),
        )
        self.register_outputs({"repository_url": repo.repository_url})
