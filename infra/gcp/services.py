"""The Google APIs the program uses, enabled in the project before anything that needs them.

Usage (inside the Pulumi program; `build_platform` does this):
    apis = ProjectServices("apis", ProjectServicesArgs(cfg=cfg))
    later = pulumi.ResourceOptions(depends_on=[apis])   # every component waits for every API
    apis.services["cloudkms.googleapis.com"]            # one gcp.projects.Service per API

On a new project only the Service Usage API is on; creating a key ring, a cluster or a bucket
before its API is enabled fails, and a service agent does not exist before its API is enabled.
`required_apis(cfg)` lists what this stack needs (pure). APIs stay enabled when the stack is
destroyed (`disable_on_destroy=False`): other workloads in the project may use them.

`api_for(record)` names the API that serves a resource of an offline plan (from the pulumi-gcp
module of its type token) and `api_problems(records)` finds resources that do not wait for the
Service enabling their API; both are pure and tested without mocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec.settings import StackSettings
from infra.gcp.plan_graph import PlanGraph, Record

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
BASE_APIS = (
    "artifactregistry.googleapis.com",
    "cloudkms.googleapis.com",
    # organizations.get_project and project-level IAM members.
    "cloudresourcemanager.googleapis.com",
    "compute.googleapis.com",
    "container.googleapis.com",
    "dns.googleapis.com",
    "iam.googleapis.com",
    # Workload Identity: a pod bound to a Google service account gets that account's tokens by
    # impersonation, which the IAM Service Account Credentials API serves (generateAccessToken,
    # https://cloud.google.com/iam/docs/reference/credentials/rest).
    "iamcredentials.googleapis.com",
    # The cluster ships system and workload logs and system metrics (cluster.py logging_config).
    "logging.googleapis.com",
    "monitoring.googleapis.com",
    "storage.googleapis.com",
)
# Cloud SQL with a private IP through Private Service Access (database.py).
MANAGED_DATABASE_APIS = ("servicenetworking.googleapis.com", "sqladmin.googleapis.com")


def required_apis(cfg: StackSettings) -> tuple[str, ...]:
    """Every API this stack's resources and service agents need, sorted."""
    apis = set(BASE_APIS)
    if cfg.mlflow.enabled and cfg.mlflow.database == "managed":
        apis.update(MANAGED_DATABASE_APIS)
    return tuple(sorted(apis))


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
                       "infra/gcp/services.py MODULE_APIS") from None


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


@dataclass(frozen=True, kw_only=True)
class ProjectServicesArgs:
    cfg: StackSettings  # project, and which features (managed database) need extra APIs


class ProjectServices(pulumi.ComponentResource):
    """One gcp.projects.Service per required API."""

    def __init__(self, name: str, args: ProjectServicesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:ProjectServices", name, None, opts)
        self.services: dict[str, gcp.projects.Service] = {}
        for api in required_apis(args.cfg):
            self.services[api] = gcp.projects.Service(
                f"{name}-{api.split('.', 1)[0]}", project=args.cfg.project, service=api,
                # Leave APIs on at destroy: disabling one breaks anything else in the project using it.
                disable_on_destroy=False, opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"services": sorted(self.services)})
