"""APIs enabled before use: `pytest tests/policies/plan/test_gcp_services.py`."""

from __future__ import annotations

import copy

import pytest

from policies.plan import gcp_services
from policies.plan.graph import plan_records


def rec(typ, name, inputs=None, deps=(), parent=None):
    return {"urn": f"urn:{typ}::{name}", "type": typ, "name": name, "parent": parent, "inputs": inputs or {},
            "dependencies": list(deps)}


@pytest.mark.parametrize(("typ", "inputs", "api"), [
    # The Google API behind each pulumi-gcp module the program uses (the provider's base URLs).
    ("gcp:compute/network:Network", {}, "compute.googleapis.com"),
    ("gcp:container/nodePool:NodePool", {}, "container.googleapis.com"),
    ("gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember", {}, "cloudkms.googleapis.com"),
    ("gcp:storage/bucketIAMMember:BucketIAMMember", {}, "storage.googleapis.com"),
    ("gcp:serviceaccount/account:Account", {}, "iam.googleapis.com"),
    ("gcp:projects/iAMMember:IAMMember", {}, "cloudresourcemanager.googleapis.com"),
    ("gcp:sql/user:User", {}, "sqladmin.googleapis.com"),
    ("gcp:servicenetworking/connection:Connection", {}, "servicenetworking.googleapis.com"),
    ("gcp:dns/recordSet:RecordSet", {}, "dns.googleapis.com"),
    ("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember", {}, "artifactregistry.googleapis.com"),
    ("gcp:projects/serviceIdentity:ServiceIdentity", {"service": "sqladmin.googleapis.com"}, "sqladmin.googleapis.com"),
    ("gcp:projects/service:Service", {"service": "dns.googleapis.com"}, None),
    ("kubernetes:core/v1:Namespace", {}, None),
])
def test_api_of_each_resource_type(typ, inputs, api):
    assert gcp_services.api_for(rec(typ, "r", inputs)) == api


def test_unmapped_module_is_an_error_naming_the_type():
    with pytest.raises(KeyError, match="gcp:pubsub/topic:Topic"):
        gcp_services.api_for(rec("gcp:pubsub/topic:Topic", "t"))
    assert "gcp:pubsub/topic:Topic" in gcp_services.api_problems([rec("gcp:pubsub/topic:Topic", "t")], "p",
                                                             check_order=False)[0]


def test_resources_wait_for_their_api():
    svc = rec(gcp_services.SERVICE, "apis-compute", {"project": "p", "service": "compute.googleapis.com"})
    comp = rec("gpu-train:gcp:Network", "network", deps=[svc["urn"]])
    vpc = rec("gcp:compute/network:Network", "vpc", {"project": "p"}, parent=comp["urn"])
    assert gcp_services.api_problems([svc, comp, vpc], "p", check_order=True) == []
    loose = dict(comp, dependencies=[])
    assert gcp_services.api_problems([svc, loose, vpc], "p", check_order=True) == [
        "vpc (gcp:compute/network:Network) does not wait for compute.googleapis.com to be enabled"]
    assert gcp_services.api_problems([loose, vpc], "p", check_order=False) == [
        "vpc (gcp:compute/network:Network) needs compute.googleapis.com, which no gcp.projects.Service "
        "enables in project 'p'"]
    other = rec(gcp_services.SERVICE, "apis-compute", {"project": "q", "service": "compute.googleapis.com"})
    assert gcp_services.api_problems([other, comp, vpc], "p", check_order=False)  # enabled in another project


# ---------------------------------------------------------------------------------------------
# The session's GCP plans
# ---------------------------------------------------------------------------------------------


def test_gcp_plans_enable_every_api_before_use(all_plans):
    gcp = {s: p for s, p in all_plans.items() if p["outputs"].get("cloud") == "gcp"}
    assert len(gcp) >= 4, sorted(gcp)
    for stack, plan in gcp.items():
        records = plan_records(plan)
        project = next(r["inputs"]["project"] for r in records if r["type"] == gcp_services.SERVICE)
        assert gcp_services.api_problems(records, project, check_order=True) == [], stack
        enabled = {r["inputs"]["service"] for r in records if r["type"] == gcp_services.SERVICE}
        assert all(r["inputs"].get("disableOnDestroy") is False for r in records if r["type"] == gcp_services.SERVICE)
        # A broken copy: the KMS API is no longer enabled, then no longer waited for.
        without = [r for r in records if not (r["type"] == gcp_services.SERVICE
                                              and r["inputs"]["service"] == "cloudkms.googleapis.com")]
        problems = gcp_services.api_problems(without, project, check_order=False)
        assert problems and all("cloudkms.googleapis.com" in p for p in problems), stack
        assert any(p.startswith("keys-ring (gcp:kms/keyRing:KeyRing)") for p in problems)
        broken = copy.deepcopy(records)
        kms = next(r["urn"] for r in broken if r["type"] == gcp_services.SERVICE
                   and r["inputs"]["service"] == "cloudkms.googleapis.com")
        for r in broken:
            r["dependencies"] = [d for d in r["dependencies"] if d != kms]
        assert any("does not wait for cloudkms.googleapis.com" in p
                   for p in gcp_services.api_problems(broken, project, check_order=True)), stack
        assert "sqladmin.googleapis.com" in enabled or not any(r["type"].startswith("gcp:sql/") for r in records)
