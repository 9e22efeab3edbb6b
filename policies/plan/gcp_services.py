"""Every Google Cloud resource of a plan waits for the Service that enables its API.

Usage:
    api_for(record)                                        # "compute.googleapis.com", or None
    api_problems(plan_records(plan), project, check_order=True)   # [] when every API is enabled first

On a new project only the Service Usage API is on; creating a key ring, a cluster or a bucket
before its API is enabled fails. `api_for(record)` names the API that serves a resource (from the
pulumi-gcp module of its type token) and `api_problems(records)` finds resources whose API no
`gcp.projects.Service` enables, or that do not wait for it. The program's side, which APIs a stack
enables, is `required_apis` in infra/gcp/services.py. Pure; tested without mocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.plan.graph import PlanGraph, Record

SERVICE = "gcp:projects/service:Service"
SERVICE_IDENTITY = "gcp:projects/serviceIdentity:ServiceIdentity"
# The pulumi-gcp module of a resource type and the Google API whose endpoint the provider calls
# for it (the provider's per-product base URLs: compute.googleapis.com, container.googleapis.com...).
MODULE_APIS = {
    "artifactregistry": "artifactregistry.googleapis.com",
    "compute": "compute.googleapis.com",
    "container": "container.googleapis.com",
    "dns": "dns.googleapis.com",
    "kms": "cloudkms.googleapis.com",
    "projects": "cloudresourcemanager.googleapis.com",  # project IAM policy
    "serviceaccount": "iam.googleapis.com",
    "servicenetworking": "servicenetworking.googleapis.com",
    "sql": "sqladmin.googleapis.com",
    "storage": "storage.googleapis.com",
}


def api_for(record: Record) -> str | None:
    """The API a plan resource needs enabled; None for an API enablement itself and for
    resources that are not Google Cloud resources. Raises KeyError for an unmapped gcp module."""
    typ = record["type"]
    if not typ.startswith("gcp:") or typ == SERVICE or typ.startswith("pulumi:providers:"):
        return None
    if typ == SERVICE_IDENTITY:
        return (record.get("inputs") or {}).get("service")
    module = typ.split(":", 2)[1].split("/", 1)[0]
    try:
        return MODULE_APIS[module]
    except KeyError:
        raise KeyError(f"no API known for resource type {typ} (module {module!r}); add it to "
                       "policies/plan/gcp_services.py MODULE_APIS") from None


def api_problems(records: Iterable[Record], project: str, *, check_order: bool) -> list[str]:
    """One line per resource whose API no Service of `project` enables and, with `check_order`
    (the records must carry `dependencies`), per resource that does not wait for that Service.
    Resources without a `project` input (IAM members, keys) belong to `project`."""
    graph = PlanGraph(records)
    services: dict[tuple[str, str], str] = {}
    for svc in graph.of_type(SERVICE):
        i = svc.get("inputs") or {}
        services[(i.get("project") or project, i.get("service") or "")] = svc["urn"]
    problems = []
    for record in graph.records:
        try:
            api = api_for(record)
        except KeyError as exc:
            problems.append(f"{record['name']}: {exc.args[0]}")
            continue
        if api is None:
            continue
        owner = (record.get("inputs") or {}).get("project") or project
        svc_urn = services.get((owner, api))
        if svc_urn is None:
            problems.append(f"{record['name']} ({record['type']}) needs {api}, which no "
                            f"gcp.projects.Service enables in project {owner!r}")
        elif check_order and svc_urn not in graph.waits_for(record["urn"]):
            problems.append(f"{record['name']} ({record['type']}) does not wait for {api} to be enabled")
    return problems
