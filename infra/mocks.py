"""Pulumi mocks with realistic cloud answers, for offline plans and tests.

Usage:
    mocks = PlanMocks(MockContext(region="us-east-1"))
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="aws-dev", preview=False)

Each cloud keeps its own answers in `infra/<cloud>/mocks.py`, as two functions:
`invoke(token, args, ctx) -> dict | None` (None: not this cloud's invoke) and
`computed(typ, name, inputs, ctx) -> dict` (output properties the provider would compute, such as
ARNs, endpoints and digests). Invoke results use the engine's camelCase keys. An invoke that no
cloud answers fails the plan loudly instead of returning `{}` (which would silently become None).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pulumi

from infra.aws import mocks as aws_mocks
from infra.gcp import mocks as gcp_mocks


@dataclass(frozen=True, kw_only=True)
class MockContext:
    region: str
    project: str = "acme-ml"  # GCP project id
    account_id: str = "123456789012"  # AWS account id
    # AWS service-linked roles the account already has (service principals, e.g. "spot.amazonaws.com");
    # none by default: a fresh account, where the program must create the ones it names.
    service_linked_roles: tuple[str, ...] = ()


def fake_digest(*parts: str) -> str:
    """A stable sha256 digest for a mocked image or object."""
    return "sha256:" + hashlib.sha256("/".join(parts).encode()).hexdigest()


class UnmockedInvokeError(RuntimeError):
    pass


class PlanMocks(pulumi.runtime.Mocks):
    def __init__(self, ctx: MockContext) -> None:
        self.ctx = ctx

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        state = dict(args.inputs)
        for cloud in (aws_mocks, gcp_mocks):
            state.update(cloud.computed(args.typ, args.name, args.inputs, self.ctx))
        if args.typ == "docker-build:index:Image":
            state.setdefault("digest", fake_digest(args.name, str(args.inputs.get("tags"))))
            tags = args.inputs.get("tags") or []
            if tags:
                state.setdefault("ref", f"{str(tags[0]).rsplit(':', 1)[0]}@{state['digest']}")
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs):
        for cloud in (aws_mocks, gcp_mocks):
            result = cloud.invoke(args.token, args.args, self.ctx)
            if result is not None:
                return result
        raise UnmockedInvokeError(f"the offline plan has no mock for invoke {args.token} (args {args.args})")
