"""The Google APIs the program uses, enabled in the project before anything that needs them.

Usage (inside the Pulumi program; `build_platform` does this):
    apis = ProjectServices("apis", ProjectServicesArgs(project=cfg.project, managed_database=managed_db))
    later = pulumi.ResourceOptions(depends_on=[apis])   # every component waits for every API
    apis.services["cloudkms.googleapis.com"]            # one gcp.projects.Service per API

On a new project only the Service Usage API is on; creating a key ring, a cluster or a bucket
before its API is enabled fails, and a service agent does not exist before its API is enabled.
`required_apis(managed_database)` lists what a stack needs (pure). APIs stay enabled when the stack is
destroyed (`disable_on_destroy=False`): other workloads in the project may use them.

The plan check that every resource waits for the Service enabling its API is
policies/plan/gcp_services.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

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


def required_apis(managed_database: bool) -> tuple[str, ...]:
    """Every API a stack's resources and service agents need, sorted."""
    apis = set(BASE_APIS)
    if managed_database:
        apis.update(MANAGED_DATABASE_APIS)
    return tuple(sorted(apis))


@dataclass(frozen=True, kw_only=True)
class ProjectServicesArgs:
    project: str  # the GCP project id the APIs are enabled in
    managed_database: bool  # MLflow's managed Cloud SQL database: its APIs as well


class ProjectServices(pulumi.ComponentResource):
    """One gcp.projects.Service per required API."""

    def __init__(self, name: str, args: ProjectServicesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:ProjectServices", name, None, opts)
        self.services: dict[str, gcp.projects.Service] = {}
        for api in required_apis(args.managed_database):
            self.services[api] = gcp.projects.Service(
                f"{name}-{api.split('.', 1)[0]}", project=args.project, service=api,
                # Leave APIs on at destroy: disabling one breaks anything else in the project using it.
                disable_on_destroy=False, opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"services": sorted(self.services)})
