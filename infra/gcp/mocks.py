"""GCP answers for offline plans: invokes the program calls and provider-computed properties.

Usage: used by `infra.mocks.PlanMocks`; see that module for the contract.
"""

from __future__ import annotations

from typing import Any


def invoke(token: str, args: dict[str, Any], ctx) -> dict[str, Any] | None:
    if token == "gcp:organizations/getClientConfig:getClientConfig":
        return {"project": ctx.project, "region": ctx.region, "zone": f"{ctx.region}-a",
                "accessToken": "ya29.mock-token", "id": ctx.project}
    if token == "gcp:organizations/getProject:getProject":
        return {"projectId": ctx.project, "number": "123456789012", "name": ctx.project, "id": ctx.project}
    return None


def computed(typ: str, name: str, inputs: dict[str, Any], ctx) -> dict[str, Any]:
    if not typ.startswith("gcp:"):
        return {}
    return {"selfLink": f"https://www.googleapis.com/compute/v1/projects/{ctx.project}/{name}"}
