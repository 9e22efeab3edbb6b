"""GCP answers for offline plans: invokes the program calls and provider-computed properties.

Usage: used by `infra.mocks.PlanMocks`; see that module for what a mock answers. Invoke results use the
engine's camelCase keys; `computed` returns the output properties the real provider fills in and
that the program reads (emails, endpoints, the cluster CA, repository ids, self links).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

PROJECT_NUMBER = "123456789012"
# Service agents generateServiceIdentity returns, by API (https://cloud.google.com/iam/docs/service-agents).
SERVICE_AGENT_DOMAINS = {
    "container.googleapis.com": "container-engine-robot",
    "compute.googleapis.com": "compute-system",
    "artifactregistry.googleapis.com": "gcp-sa-artifactregistry",
    "sqladmin.googleapis.com": "gcp-sa-cloud-sql",
}
# A syntactically valid PEM body is not needed by anything offline; base64 like the real field.
CLUSTER_CA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nmock-gke-ca\n-----END CERTIFICATE-----\n").decode()


def invoke(token: str, args: dict[str, Any], ctx) -> dict[str, Any] | None:
    if token == "gcp:organizations/getClientConfig:getClientConfig":
        return {"project": ctx.project, "region": ctx.region, "zone": f"{ctx.region}-a",
                "accessToken": "ya29.mock-token", "id": ctx.project}
    if token == "gcp:organizations/getProject:getProject":
        project = args.get("projectId") or ctx.project
        return {"projectId": project, "number": PROJECT_NUMBER, "name": project, "id": f"projects/{project}"}
    if token == "gcp:storage/getProjectServiceAccount:getProjectServiceAccount":
        project = args.get("project") or ctx.project
        email = f"service-{PROJECT_NUMBER}@gs-project-accounts.iam.gserviceaccount.com"
        return {"emailAddress": email, "member": f"serviceAccount:{email}", "project": project, "id": email}
    return None


def computed(typ: str, name: str, inputs: dict[str, Any], ctx) -> dict[str, Any]:
    if not typ.startswith("gcp:"):
        return {}
    project = inputs.get("project") or ctx.project
    base = f"https://www.googleapis.com/compute/v1/projects/{project}"
    out: dict[str, Any] = {"selfLink": f"{base}/{name}"}
    if typ == "gcp:compute/network:Network":
        out["selfLink"] = f"{base}/global/networks/{inputs.get('name', name)}"
    elif typ == "gcp:compute/subnetwork:Subnetwork":
        out["selfLink"] = f"{base}/regions/{inputs.get('region', ctx.region)}/subnetworks/{inputs.get('name', name)}"
    elif typ == "gcp:serviceaccount/account:Account":
        email = f"{inputs['accountId']}@{project}.iam.gserviceaccount.com"
        out.update(email=email, member=f"serviceAccount:{email}",
                   name=f"projects/{project}/serviceAccounts/{email}", uniqueId="100000000000000000001")
    elif typ == "gcp:container/cluster:Cluster":
        private = (inputs.get("privateClusterConfig") or {}).get("enablePrivateEndpoint")
        endpoints = dict(inputs.get("controlPlaneEndpointsConfig") or {})
        if "dnsEndpointConfig" in endpoints:
            # gke-<32 hex>-<project number>.<location>.gke.goog, as the API reports it.
            digest = hashlib.sha256(f"{project}/{inputs.get('name', name)}".encode()).hexdigest()[:32]
            endpoints["dnsEndpointConfig"] = {
                **endpoints["dnsEndpointConfig"],
                "endpoint": f"gke-{digest}-{PROJECT_NUMBER}.{inputs.get('location', ctx.region)}.gke.goog"}
        out.update(endpoint="172.16.0.2" if private else "34.118.0.10",
                   controlPlaneEndpointsConfig=endpoints,
                   masterAuth={**(inputs.get("masterAuth") or {}), "clusterCaCertificate": CLUSTER_CA},
                   masterVersion=f"{inputs.get('minMasterVersion', '1.33')}.5-gke.1000")
    elif typ == "gcp:artifactregistry/repository:Repository":
        out.update(name=inputs.get("repositoryId", name),
                   registryUri=f"{inputs.get('location')}-docker.pkg.dev/{project}/{inputs.get('repositoryId')}")
    elif typ == "gcp:projects/serviceIdentity:ServiceIdentity":
        agent = SERVICE_AGENT_DOMAINS.get(inputs.get("service", ""), "gcp-sa-unknown")
        email = f"service-{PROJECT_NUMBER}@{agent}.iam.gserviceaccount.com"
        out.update(email=email, member=f"serviceAccount:{email}")
    elif typ == "gcp:sql/databaseInstance:DatabaseInstance":
        iname = inputs.get("name", name)
        # Private IP from the Private Service Access range: the mocks do not see the range here, so a
        # fixed address stands in (tests compare it with nothing but its form).
        out.update(name=iname, privateIpAddress="10.255.240.3", publicIpAddress="",
                   connectionName=f"{project}:{inputs.get('region', ctx.region)}:{iname}",
                   selfLink=f"https://sqladmin.googleapis.com/sql/v1beta4/projects/{project}/instances/{iname}")
    elif typ == "gcp:storage/bucket:Bucket":
        out.update(url=f"gs://{inputs.get('name', name)}")
    return out
