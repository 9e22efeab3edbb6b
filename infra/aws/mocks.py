"""AWS answers for offline plans: invokes the program calls and provider-computed properties.

Usage: used by `infra.mocks.PlanMocks`; see that module for the contract.
"""

from __future__ import annotations

from typing import Any


def invoke(token: str, args: dict[str, Any], ctx) -> dict[str, Any] | None:
    region = ctx.region
    if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
        names = [f"{region}{s}" for s in "abcdef"]
        return {"names": names, "zoneIds": [f"use1-az{i}" for i in range(1, 7)], "id": region}
    if token == "aws:index/getCallerIdentity:getCallerIdentity":
        return {"accountId": ctx.account_id, "arn": f"arn:aws:iam::{ctx.account_id}:user/ci",
                "userId": "AIDAEXAMPLE", "id": ctx.account_id}
    if token == "aws:index/getPartition:getPartition":
        return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}
    if token == "aws:index/getRegion:getRegion":
        return {"name": region, "region": region, "id": region, "endpoint": f"ec2.{region}.amazonaws.com"}
    return None


def computed(typ: str, name: str, inputs: dict[str, Any], ctx) -> dict[str, Any]:
    if not typ.startswith("aws:"):
        return {}
    service = typ.split(":")[1].split("/")[0]
    return {"arn": f"arn:aws:{service}:{ctx.region}:{ctx.account_id}:{name}"}
