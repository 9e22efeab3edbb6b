"""Service-linked roles that must exist before a key policy or a launch can name them.

Usage:
    slr = ServiceLinkedRoles("service-roles", ServiceLinkedRolesArgs(account_id=..., services=[AUTOSCALING],
                                                                     tags=...))
    slr.arns[AUTOSCALING]   # Output[str]: resolves once the role exists

AWS creates a service-linked role the first time its service needs it, but two things here need the
role earlier: the ebs key policy names EC2 Auto Scaling's role as a principal, and KMS rejects a policy
that names a principal that does not exist yet; and Karpenter launches spot capacity without the
`iam:CreateServiceLinkedRole` permission, so EC2 Spot's role must already be there
(https://karpenter.sh/docs/getting-started/getting-started-with-karpenter/, "first time you're
using EC2 Spot in this account").

At deploy time each role is looked up (`aws.iam.get_roles` with its path and name, which returns an
empty list, not an error, when the role is absent). An absent role is created with
`aws.iam.ServiceLinkedRole`, kept on delete: the role belongs to the account, other stacks and services
use it, and IAM refuses to delete a service-linked role that is still in use. On the next `pulumi up`
the lookup finds it, the program no longer declares it, and Pulumi drops it from this stack's state
without touching it (the retain-on-delete option).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

AUTOSCALING = "autoscaling.amazonaws.com"
SPOT = "spot.amazonaws.com"
# Role names AWS gives each service's service-linked role
# (https://docs.aws.amazon.com/IAM/latest/UserGuide/using-service-linked-roles.html).
ROLE_NAMES = {
    AUTOSCALING: "AWSServiceRoleForAutoScaling",
    SPOT: "AWSServiceRoleForEC2Spot",
}


def role_path(service: str) -> str:
    return f"/aws-service-role/{service}/"


def role_arn(account_id: str, service: str) -> str:
    """The ARN AWS gives a service's default service-linked role in an account (pure)."""
    if service not in ROLE_NAMES:
        raise ValueError(f"no service-linked role known for {service!r} (known: {sorted(ROLE_NAMES)})")
    return f"arn:aws:iam::{account_id}:role{role_path(service)}{ROLE_NAMES[service]}"


@dataclass(frozen=True, kw_only=True)
class ServiceLinkedRolesArgs:
    account_id: str  # the account the roles live in
    services: Sequence[str]  # service principals from ROLE_NAMES
    tags: Mapping[str, str]  # common tags (applied only to a role this stack creates)


class ServiceLinkedRoles(pulumi.ComponentResource):
    def __init__(self, name: str, args: ServiceLinkedRolesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:ServiceLinkedRoles", name, None, opts)
        self.arns: dict[str, pulumi.Output[str]] = {}
        self.created: list[str] = []
        for service in args.services:
            arn = role_arn(args.account_id, service)
            found = aws.iam.get_roles(path_prefix=role_path(service), name_regex=f"^{ROLE_NAMES[service]}$",
                                      opts=pulumi.InvokeOptions(parent=self))
            if arn in (found.arns or []):
                self.arns[service] = pulumi.Output.from_input(arn)
                continue
            role = aws.iam.ServiceLinkedRole(
                f"{name}-{service.split('.')[0]}", aws_service_name=service, tags=dict(args.tags),
                opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True))
            self.arns[service] = role.arn
            self.created.append(service)
        self.register_outputs({"arns": self.arns})
