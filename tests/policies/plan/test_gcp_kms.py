"""Customer-managed keys and their consumers: `pytest tests/policies/plan/test_gcp_kms.py`.

Hand-built plan records exercise each rule of policies/plan/gcp_kms.py; then every GCP plan of the
session (the stacks and their fabric variants) must give every consumer of every key a grant to
the right service agent, in the right order, and broken copies of those plans must fail.
"""

from __future__ import annotations

import copy

import pytest

from infra.gcp.mocks import PROJECT_NUMBER
from policies.plan import gcp_kms
from policies.plan.graph import plan_records

N = "42"
RING = "projects/p/locations/us-central1/keyRings/ring"
ROLE = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
# The agents' addresses as Google documents them (https://cloud.google.com/iam/docs/service-agents
# and each product's CMEK page), for project number 42.
DOCUMENTED = {
    "container": "serviceAccount:service-42@container-engine-robot.iam.gserviceaccount.com",
    "compute": "serviceAccount:service-42@compute-system.iam.gserviceaccount.com",
    "storage": "serviceAccount:service-42@gs-project-accounts.iam.gserviceaccount.com",
    "artifactregistry": "serviceAccount:service-42@gcp-sa-artifactregistry.iam.gserviceaccount.com",
    "sqladmin": "serviceAccount:service-42@gcp-sa-cloud-sql.iam.gserviceaccount.com",
}


def rec(typ, name, inputs, deps=(), parent=None):
    return {"urn": f"urn:{typ}::{name}", "type": typ, "name": name, "parent": parent, "inputs": inputs,
            "dependencies": list(deps)}


def key_records(*names):
    ring = rec(gcp_kms.KEY_RING, "ring", {"name": "ring", "project": "p", "location": "us-central1"})
    return [ring, *[rec(gcp_kms.CRYPTO_KEY, f"key-{k}", {"name": k, "keyRing": RING}) for k in names]]


def grant(name, key, member, deps=(), **extra):
    return rec("gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember", name,
               {"cryptoKeyId": f"{RING}/cryptoKeys/{key}", "role": ROLE, "member": member, **extra}, deps)


def bucket(name, key, deps=()):
    return rec("gcp:storage/bucket:Bucket", name, {"encryption": {"defaultKmsKeyName": f"{RING}/cryptoKeys/{key}"}},
               deps)


def test_agent_addresses_are_the_documented_ones():
    assert {k: a.member(N) for k, a in gcp_kms.AGENTS.items()} == DOCUMENTED


@pytest.mark.parametrize(("typ", "inputs", "agent"), [
    ("gcp:container/cluster:Cluster", {"databaseEncryption": {"state": "ENCRYPTED", "keyName": "K"}}, "container"),
    ("gcp:container/cluster:Cluster", {"nodeConfig": {"bootDiskKmsKey": "K"}}, "compute"),
    ("gcp:container/nodePool:NodePool", {"nodeConfig": {"bootDiskKmsKey": "K"}}, "compute"),
    ("kubernetes:storage.k8s.io/v1:StorageClass",
     {"provisioner": "pd.csi.storage.gke.io", "parameters": {"disk-encryption-kms-key": "K"}}, "compute"),
    ("gcp:storage/bucket:Bucket", {"encryption": {"defaultKmsKeyName": "K"}}, "storage"),
    ("gcp:artifactregistry/repository:Repository", {"kmsKeyName": "K"}, "artifactregistry"),
    ("gcp:sql/databaseInstance:DatabaseInstance", {"encryptionKeyName": "K"}, "sqladmin"),
])
def test_each_consumer_field_needs_its_agent_on_that_key(typ, inputs, agent):
    key_id = f"{RING}/cryptoKeys/a"
    inputs = copy.deepcopy(inputs)
    path = next(c.path for c in gcp_kms.CONSUMERS if c.resource_type == typ and c.agent == agent)
    target = inputs
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = key_id
    consumer = rec(typ, "c", inputs)
    records = [*key_records("a", "b"), consumer]
    (use,) = gcp_kms.key_uses(records)
    assert (use.agent, use.key) == (agent, "urn:gcp:kms/cryptoKey:CryptoKey::key-a")
    missing = gcp_kms.key_access_problems(records, N)
    assert len(missing) == 1 and DOCUMENTED[agent] in missing[0] and "c (" in missing[0]
    assert gcp_kms.key_access_problems([*records, grant("g", "a", DOCUMENTED[agent])], N) == []
    # The same grant on another key of the same ring does not help.
    assert gcp_kms.key_access_problems([*records, grant("g", "b", DOCUMENTED[agent])], N) == missing
    # Nor does a grant to another agent on the right key.
    other = next(m for k, m in DOCUMENTED.items() if k != agent)
    assert gcp_kms.key_access_problems([*records, grant("g", "a", other)], N) == missing


def test_ring_and_project_grants_cover_their_keys_but_conditions_and_other_roles_do_not():
    records = [*key_records("a"), bucket("b", "a")]
    member = DOCUMENTED["storage"]
    ring_grant = rec("gcp:kms/keyRingIAMMember:KeyRingIAMMember", "r",
                     {"keyRingId": "p/us-central1/ring", "role": ROLE, "member": member})
    project_grant = rec("gcp:projects/iAMMember:IAMMember", "pg", {"project": "p", "role": ROLE, "member": member})
    binding = rec("gcp:kms/cryptoKeyIAMBinding:CryptoKeyIAMBinding", "kb",
                  {"cryptoKeyId": "p/us-central1/ring/a", "role": ROLE, "members": ["user:x@example.com", member]})
    for ok in (ring_grant, project_grant, binding):
        assert gcp_kms.key_access_problems([*records, ok], N) == [], ok["name"]
    conditional = grant("g", "a", member, condition={"title": "t", "expression": "request.time < timestamp('2000-01-01T00:00:00Z')"})
    viewer = grant("g", "a", member)
    viewer["inputs"]["role"] = "roles/cloudkms.viewer"
    other_project = rec("gcp:projects/iAMMember:IAMMember", "pg", {"project": "q", "role": ROLE, "member": member})
    for bad in (conditional, viewer, other_project):
        assert len(gcp_kms.key_access_problems([*records, bad], N)) == 1, bad["name"]


def test_unknown_consumers_and_foreign_keys_are_reported():
    topic = rec("gcp:pubsub/topic:Topic", "t", {"kmsKeyName": f"{RING}/cryptoKeys/a"})
    (problem,) = gcp_kms.key_access_problems([*key_records("a"), topic], N)
    assert problem.startswith("t (kmsKeyName) names key") and "CONSUMERS" in problem
    # A PD StorageClass of another provisioner is no PD CSI consumer: its key is an unknown use.
    ebs = rec("kubernetes:storage.k8s.io/v1:StorageClass", "sc",
              {"provisioner": "ebs.csi.aws.com", "parameters": {"disk-encryption-kms-key": f"{RING}/cryptoKeys/a"}})
    assert "no Google service agent is known" in gcp_kms.key_access_problems([*key_records("a"), ebs], N)[0]
    foreign = bucket("b", "elsewhere")
    (problem,) = gcp_kms.key_access_problems([*key_records("a"), foreign], N)
    assert "which this plan does not create" in problem


def test_misspelled_or_foreign_agent_addresses_are_reported():
    records = [*key_records("a"), bucket("b", "a"), grant("ok", "a", DOCUMENTED["storage"])]
    typo = grant("typo", "a", "serviceAccount:service-42@gs-project-account.iam.gserviceaccount.com")
    (problem,) = gcp_kms.key_access_problems([*records, typo], N)
    assert problem.startswith("typo: member") and "not a known service agent address" in problem
    other = grant("other", "a", "serviceAccount:service-7@gs-project-accounts.iam.gserviceaccount.com")
    assert "project number 7, not 42" in gcp_kms.key_access_problems([*records, other], N)[0]


def test_key_ids_in_the_providers_short_forms():
    assert gcp_kms.canonical_key_id("p/l/r/k") == "projects/p/locations/l/keyRings/r/cryptoKeys/k"
    assert gcp_kms.canonical_key_id("projects/p/locations/l/keyRings/r/cryptoKeys/k") == \
        "projects/p/locations/l/keyRings/r/cryptoKeys/k"
    assert gcp_kms.canonical_key_id("k") is None
    assert gcp_kms.canonical_ring_id("l/r") is None and gcp_kms.canonical_ring_id("p/l/r") == \
        "projects/p/locations/l/keyRings/r"


def test_ordering_consumers_wait_for_grants_and_grants_for_agents():
    keys = key_records("a", "b")
    agent = rec(gcp_kms.SERVICE_IDENTITY, "ar", {"service": "artifactregistry.googleapis.com"})
    g = grant("g", "a", DOCUMENTED["artifactregistry"], deps=[agent["urn"]])
    comp = rec("gpu-train:gcp:ArtifactRegistry", "registry", {}, deps=[g["urn"]])
    repo = rec("gcp:artifactregistry/repository:Repository", "repo", {"kmsKeyName": f"{RING}/cryptoKeys/a"},
               parent=comp["urn"])
    assert gcp_kms.ordering_problems([*keys, agent, g, comp, repo], N) == []
    # The repository no longer waits (its component dropped the grant from depends_on).
    loose = dict(comp, dependencies=[])
    (problem,) = gcp_kms.ordering_problems([*keys, agent, g, loose, repo], N)
    assert problem.startswith("repo (kmsKeyName) may be created before g")
    # The grant no longer waits for the generated agent; or no ServiceIdentity exists at all.
    early = dict(g, dependencies=[])
    assert gcp_kms.ordering_problems([*keys, agent, early, comp, repo], N) == [
        "g may be created before the artifactregistry.googleapis.com service agent exists"]
    assert "no gcp.projects.ServiceIdentity creates" in gcp_kms.ordering_problems([*keys, g, comp, repo], N)[0]
    # The Cloud Storage agent is created by reading it through the Storage API, not by ServiceIdentity.
    gs = grant("gs", "b", DOCUMENTED["storage"])
    assert gcp_kms.ordering_problems([*keys, gs, bucket("bk", "b", deps=[gs["urn"]])], N) == []


# ---------------------------------------------------------------------------------------------
# The session's GCP plans
# ---------------------------------------------------------------------------------------------


def gcp_plans(all_plans):
    found = {s: p for s, p in all_plans.items() if p["outputs"].get("cloud") == "gcp"}
    # The stacks plus the A3 High and A3 Ultra variants of the prod stack.
    assert len(found) >= 4, sorted(found)
    return found


def test_every_key_consumer_in_every_gcp_plan_may_use_its_key(all_plans):
    for stack, plan in gcp_plans(all_plans).items():
        records = plan_records(plan)
        assert gcp_kms.key_access_problems(records, PROJECT_NUMBER) == [], stack
        assert gcp_kms.ordering_problems(records, PROJECT_NUMBER) == [], stack
        uses = gcp_kms.key_uses(records)
        keys = {r["urn"] for r in records if r["type"] == gcp_kms.CRYPTO_KEY}
        assert keys == {u.key for u in uses}, f"{stack}: a key nothing uses, or a use of no key"
        by_agent = {u.agent for u in uses}
        assert {"container", "compute", "storage", "artifactregistry"} <= by_agent, stack
        assert ("sqladmin" in by_agent) == any(r["type"] == "gcp:sql/databaseInstance:DatabaseInstance"
                                               for r in records), stack
        # The PD CSI StorageClass is a consumer of the disks key, like the node pools.
        assert any(u.field == "parameters.disk-encryption-kms-key" and u.agent == "compute" for u in uses), stack


def _grant_for(records, agent):
    member = gcp_kms.AGENTS[agent].member(PROJECT_NUMBER)
    return next(r for r in records if r["type"].startswith("gcp:kms/cryptoKeyIAM") and r["inputs"]["member"] == member)


def test_broken_copies_of_the_gcp_plans_fail(all_plans):
    for stack, plan in gcp_plans(all_plans).items():
        records = plan_records(plan)
        # One grant removed.
        gone = _grant_for(records, "storage")
        problems = gcp_kms.key_access_problems([r for r in records if r is not gone], PROJECT_NUMBER)
        assert problems and all("gs-project-accounts" in p for p in problems), (stack, problems)
        assert any(p.startswith("storage-checkpoints (encryption.defaultKmsKeyName)") for p in problems)
        # A grant on the wrong key: the registry agent granted on the GKE key instead.
        broken = copy.deepcopy(records)
        wrong = _grant_for(broken, "artifactregistry")
        gke_key = _grant_for(broken, "container")["inputs"]["cryptoKeyId"]
        wrong["inputs"]["cryptoKeyId"] = gke_key
        problems = gcp_kms.key_access_problems(broken, PROJECT_NUMBER)
        assert problems and all("gcp-sa-artifactregistry" in p for p in problems), (stack, problems)
        # A misspelled agent address.
        broken = copy.deepcopy(records)
        typo = _grant_for(broken, "container")
        typo["inputs"]["member"] = typo["inputs"]["member"].replace("container-engine-robot", "container-engine-robots")
        problems = gcp_kms.key_access_problems(broken, PROJECT_NUMBER)
        assert any("not a known service agent address" in p for p in problems), (stack, problems)
        assert any(p.startswith("cluster-gke (databaseEncryption.keyName)") for p in problems), (stack, problems)
        # Nothing waits for the disks grant any more.
        broken = copy.deepcopy(records)
        disks = _grant_for(broken, "compute")["urn"]
        for r in broken:
            r["dependencies"] = [d for d in r["dependencies"] if d != disks]
        problems = gcp_kms.ordering_problems(broken, PROJECT_NUMBER)
        assert any("bootDiskKmsKey) may be created before" in p for p in problems), (stack, problems)
        # The agents are granted before they are generated.
        broken = copy.deepcopy(records)
        agents = {r["urn"] for r in broken if r["type"] == gcp_kms.SERVICE_IDENTITY}
        for r in broken:
            r["dependencies"] = [d for d in r["dependencies"] if d not in agents]
        problems = gcp_kms.ordering_problems(broken, PROJECT_NUMBER)
        assert any("container.googleapis.com service agent exists" in p for p in problems), (stack, problems)
