"""Who must be able to use each Cloud KMS key of a plan, and whether the plan lets them.

Usage:
    problems = key_access_problems(plan["resources"], project_number="123456789012")
    problems += ordering_problems(records)      # records with `dependencies` (component tests)
    uses = key_uses(records)                     # [KeyUse(consumer, field, key, agent)]

Everything is read from the plan graph, not from the program's intent: a resource that names a
key in one of the fields below is a consumer, and the Google service agent that field's service
encrypts with must hold the encrypter/decrypter role on exactly that key (matched by resource, not
by name), its key ring or the project. Any other field of any resource that names a key is
reported as a consumer this module does not know, so a new kind of CMEK use cannot slip through.

The agent addresses and which agent serves which field come from Google's documentation, cited
per entry below; `service-<project number>@<domain>` is the form of every agent used here
(https://cloud.google.com/iam/docs/service-agents). Conditional grants are not counted: whether
a condition holds for the agent's calls cannot be decided offline.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from policies.core import dig
from policies.plan.graph import PlanGraph, Record

ENCRYPTER_DECRYPTER = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
KEY_RING = "gcp:kms/keyRing:KeyRing"
CRYPTO_KEY = "gcp:kms/cryptoKey:CryptoKey"
SERVICE_IDENTITY = "gcp:projects/serviceIdentity:ServiceIdentity"
KEY_ID = re.compile(r"^projects/([^/]+)/locations/([^/]+)/keyRings/([^/]+)/cryptoKeys/([^/]+)$")
RING_ID = re.compile(r"^projects/([^/]+)/locations/([^/]+)/keyRings/([^/]+)$")
KEY_ID_ANYWHERE = re.compile(r"projects/[^/\s\"]+/locations/[^/\s\"]+/keyRings/[^/\s\"]+/cryptoKeys/[^/\s\"]+")
AGENT_MEMBER = re.compile(r"^serviceAccount:service-(\d+)@([a-z0-9.-]+)$")


@dataclass(frozen=True, kw_only=True)
class Agent:
    """A Google-managed service agent of one project."""

    api: str  # the API it belongs to
    domain: str  # service-<project number>@<domain>
    # How it comes to exist on a project that never used the API: "service-identity" (generated
    # by gcp.projects.ServiceIdentity, Service Usage generateServiceIdentity) or "storage-api"
    # (the Cloud Storage JSON API's projects.serviceAccount.get creates it on first read).
    created_by: str

    def member(self, project_number: str) -> str:
        return f"serviceAccount:service-{project_number}@{self.domain}"


AGENTS: dict[str, Agent] = {
    # Kubernetes Engine Service Agent: application-layer Secrets encryption
    # (https://cloud.google.com/kubernetes-engine/docs/how-to/encrypting-secrets).
    "container": Agent(api="container.googleapis.com", domain="container-engine-robot.iam.gserviceaccount.com",
                       created_by="service-identity"),
    # Compute Engine Service Agent: CMEK boot disks of GKE nodes and PD CSI volumes
    # (https://cloud.google.com/kubernetes-engine/docs/how-to/using-cmek).
    "compute": Agent(api="compute.googleapis.com", domain="compute-system.iam.gserviceaccount.com",
                     created_by="service-identity"),
    # Cloud Storage service agent: bucket default keys
    # (https://cloud.google.com/storage/docs/encryption/using-customer-managed-keys).
    "storage": Agent(api="storage.googleapis.com", domain="gs-project-accounts.iam.gserviceaccount.com",
                     created_by="storage-api"),
    # Artifact Registry Service Agent: CMEK repositories (https://cloud.google.com/artifact-registry/docs/cmek).
    "artifactregistry": Agent(api="artifactregistry.googleapis.com",
                              domain="gcp-sa-artifactregistry.iam.gserviceaccount.com",
                              created_by="service-identity"),
    # Cloud SQL Service Agent: CMEK instances (https://cloud.google.com/sql/docs/postgres/configure-cmek).
    "sqladmin": Agent(api="sqladmin.googleapis.com", domain="gcp-sa-cloud-sql.iam.gserviceaccount.com",
                      created_by="service-identity"),
}


def _always(_inputs: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class Consumer:
    """A field through which a resource type hands a key to a Google service."""

    resource_type: str
    path: tuple[str, ...]  # camelCase input path to the key id
    agent: str  # key of AGENTS
    applies: Callable[[Mapping[str, Any]], bool] = _always  # e.g. only the PD CSI provisioner


def _pd_csi(inputs: Mapping[str, Any]) -> bool:
    return inputs.get("provisioner") == "pd.csi.storage.gke.io"


CONSUMERS: tuple[Consumer, ...] = (
    Consumer(resource_type="gcp:container/cluster:Cluster", path=("databaseEncryption", "keyName"),
             agent="container"),
    Consumer(resource_type="gcp:container/cluster:Cluster", path=("nodeConfig", "bootDiskKmsKey"), agent="compute"),
    Consumer(resource_type="gcp:container/nodePool:NodePool", path=("nodeConfig", "bootDiskKmsKey"), agent="compute"),
    # The PD CSI driver creates CMEK disks from the StorageClass parameter
    # (https://github.com/kubernetes-sigs/gcp-compute-persistent-disk-csi-driver#createvolume-parameters).
    Consumer(resource_type="kubernetes:storage.k8s.io/v1:StorageClass",
             path=("parameters", "disk-encryption-kms-key"), agent="compute", applies=_pd_csi),
    Consumer(resource_type="gcp:storage/bucket:Bucket", path=("encryption", "defaultKmsKeyName"), agent="storage"),
    Consumer(resource_type="gcp:artifactregistry/repository:Repository", path=("kmsKeyName",),
             agent="artifactregistry"),
    Consumer(resource_type="gcp:sql/databaseInstance:DatabaseInstance", path=("encryptionKeyName",),
             agent="sqladmin"),
)
# The IAM resources that grant on keys, key rings and projects, and the input naming the target.
KEY_GRANTS = {"gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember": "cryptoKeyId",
              "gcp:kms/cryptoKeyIAMBinding:CryptoKeyIAMBinding": "cryptoKeyId"}
RING_GRANTS = {"gcp:kms/keyRingIAMMember:KeyRingIAMMember": "keyRingId",
               "gcp:kms/keyRingIAMBinding:KeyRingIAMBinding": "keyRingId"}
PROJECT_GRANTS = {"gcp:projects/iAMMember:IAMMember": "project",
                  "gcp:projects/iAMBinding:IAMBinding": "project"}


def canonical_key_id(value: str) -> str | None:
    """projects/P/locations/L/keyRings/R/cryptoKeys/K from that form or the provider's short
    `P/L/R/K` form (google_kms_crypto_key_iam_member's crypto_key_id); None otherwise."""
    if KEY_ID.match(value):
        return value
    parts = value.split("/")
    if len(parts) == 4 and all(parts):
        return f"projects/{parts[0]}/locations/{parts[1]}/keyRings/{parts[2]}/cryptoKeys/{parts[3]}"
    return None


def canonical_ring_id(value: str) -> str | None:
    """projects/P/locations/L/keyRings/R from that form or the provider's `P/L/R` form."""
    if RING_ID.match(value):
        return value
    parts = value.split("/")
    if len(parts) == 3 and all(parts):
        return f"projects/{parts[0]}/locations/{parts[1]}/keyRings/{parts[2]}"
    return None


def key_index(graph: PlanGraph) -> dict[str, str]:
    """Canonical key id -> URN of the CryptoKey resource the plan creates under that id."""
    rings: dict[str, str] = {}
    for ring in graph.of_type(KEY_RING):
        i = ring.get("inputs") or {}
        if i.get("project") and i.get("location") and i.get("name"):
            rings[f"projects/{i['project']}/locations/{i['location']}/keyRings/{i['name']}"] = ring["urn"]
    keys: dict[str, str] = {}
    for key in graph.of_type(CRYPTO_KEY):
        i = key.get("inputs") or {}
        ring = canonical_ring_id(str(i.get("keyRing") or ""))
        if ring in rings and i.get("name"):
            keys[f"{ring}/cryptoKeys/{i['name']}"] = key["urn"]
    return keys


def _strings(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, (*path, str(k)))
    elif isinstance(value, list | tuple):
        for n, v in enumerate(value):
            yield from _strings(v, (*path, str(n)))
    elif isinstance(value, str):
        yield path, value


@dataclass(frozen=True, kw_only=True)
class KeyUse:
    consumer: str  # URN
    consumer_name: str
    field: str  # dotted input path
    key_id: str  # as written in the consumer
    key: str | None  # URN of the CryptoKey resource, None if the plan creates no such key
    agent: str | None  # key of AGENTS; None for a field this module does not know


def key_uses(records: Iterable[Record]) -> list[KeyUse]:
    """Every place a resource of the plan names a Cloud KMS key."""
    graph = PlanGraph(records)
    keys = key_index(graph)
    uses: list[KeyUse] = []
    for record in graph.records:
        typ = record["type"]
        if typ.startswith("gcp:kms/"):
            continue  # keys, rings and their IAM are not consumers
        inputs = record.get("inputs") or {}
        known: set[tuple[str, ...]] = set()
        for consumer in CONSUMERS:
            if consumer.resource_type != typ or not consumer.applies(inputs):
                continue
            known.add(consumer.path)
            value = dig(inputs, *consumer.path)
            if isinstance(value, str) and value:
                uses.append(KeyUse(consumer=record["urn"], consumer_name=record["name"],
                                   field=".".join(consumer.path), key_id=value,
                                   key=keys.get(canonical_key_id(value) or ""), agent=consumer.agent))
        for path, value in _strings(inputs):
            if path in known:
                continue
            for found in KEY_ID_ANYWHERE.findall(value):
                uses.append(KeyUse(consumer=record["urn"], consumer_name=record["name"], field=".".join(path),
                                   key_id=found, key=keys.get(found), agent=None))
    return uses


@dataclass(frozen=True, kw_only=True)
class Grant:
    urn: str
    name: str
    role: str
    members: tuple[str, ...]
    scope: str  # "key" | "ring" | "project"
    target: str  # key URN, canonical ring id, or project id ("" when it names nothing in the plan)
    conditional: bool


def grants(records: Iterable[Record]) -> list[Grant]:
    """Every IAM grant of the plan on a key, a key ring or a project."""
    graph = PlanGraph(records)
    keys = key_index(graph)
    out = []
    for record in graph.records:
        typ, i = record["type"], record.get("inputs") or {}
        members = tuple(m for m in ([i.get("member")] if "member" in i else (i.get("members") or [])) if m)
        common = {"urn": record["urn"], "name": record["name"], "role": i.get("role") or "",
                  "members": members, "conditional": bool(i.get("condition"))}
        if typ in KEY_GRANTS:
            key = canonical_key_id(str(i.get(KEY_GRANTS[typ]) or "")) or ""
            out.append(Grant(scope="key", target=keys.get(key, ""), **common))
        elif typ in RING_GRANTS:
            out.append(Grant(scope="ring", target=canonical_ring_id(str(i.get(RING_GRANTS[typ]) or "")) or "",
                             **common))
        elif typ in PROJECT_GRANTS:
            out.append(Grant(scope="project", target=str(i.get(PROJECT_GRANTS[typ]) or ""), **common))
    return out


def _covers(grant: Grant, use: KeyUse, member: str) -> bool:
    if grant.role != ENCRYPTER_DECRYPTER or grant.conditional or member not in grant.members:
        return False
    canonical = canonical_key_id(use.key_id) or ""
    if grant.scope == "key":
        return bool(use.key) and grant.target == use.key
    if grant.scope == "ring":
        return bool(grant.target) and canonical.startswith(grant.target + "/cryptoKeys/")
    match = KEY_ID.match(canonical)
    return bool(match) and grant.target == match.group(1)


def satisfying_grants(records: Iterable[Record], use: KeyUse, project_number: str) -> list[Grant]:
    """The grants that let `use`'s agent use its key."""
    if use.agent is None:
        return []
    member = AGENTS[use.agent].member(project_number)
    return [g for g in grants(records) if _covers(g, use, member)]


def key_access_problems(records: Iterable[Record], project_number: str) -> list[str]:
    """One line per key use no grant allows, unknown consumer field, key the plan does not create,
    or service-agent member that is not a known agent address of this project."""
    records = list(records)
    problems = []
    all_grants = grants(records)
    for use in key_uses(records):
        where = f"{use.consumer_name} ({use.field})"
        if use.agent is None:
            problems.append(f"{where} names key {use.key_id}, but no Google service agent is known for "
                            "that field (add it to policies/plan/gcp_kms.py CONSUMERS)")
            continue
        if use.key is None:
            problems.append(f"{where} names key {use.key_id}, which this plan does not create")
            continue
        member = AGENTS[use.agent].member(project_number)
        if not any(_covers(g, use, member) for g in all_grants):
            problems.append(f"{where} uses key {use.key_id}, but {member} has no {ENCRYPTER_DECRYPTER} on it")
    domains = {a.domain for a in AGENTS.values()}
    for grant in all_grants:
        for member in grant.members:
            match = AGENT_MEMBER.match(member)
            if match is None:
                continue
            if match.group(2) not in domains:
                problems.append(f"{grant.name}: member {member} is not a known service agent address "
                                f"(known domains: {', '.join(sorted(domains))})")
            elif match.group(1) != project_number:
                problems.append(f"{grant.name}: member {member} names project number {match.group(1)}, "
                                f"not {project_number}")
    return problems


def ordering_problems(records: Iterable[Record], project_number: str) -> list[str]:
    """With each registration's `dependencies` recorded: every consumer waits for a grant that
    lets its agent use its key, and every such grant to an agent that `gcp.projects.ServiceIdentity`
    creates waits for that ServiceIdentity."""
    graph = PlanGraph(records)
    identities = {(r.get("inputs") or {}).get("service"): r["urn"] for r in graph.of_type(SERVICE_IDENTITY)}
    problems = []
    for use in key_uses(graph.records):
        if use.agent is None or use.key is None:
            continue
        agent = AGENTS[use.agent]
        found = satisfying_grants(graph.records, use, project_number)
        if found and not any(g.urn in graph.waits_for(use.consumer) for g in found):
            problems.append(f"{use.consumer_name} ({use.field}) may be created before "
                            f"{', '.join(g.name for g in found)} lets {agent.domain} use {use.key_id}")
        if agent.created_by != "service-identity":
            continue
        identity = identities.get(agent.api)
        for g in found:
            if identity is None:
                problems.append(f"{g.name} grants to the {agent.api} service agent, which no "
                                "gcp.projects.ServiceIdentity creates")
            elif identity not in graph.waits_for(g.urn):
                problems.append(f"{g.name} may be created before the {agent.api} service agent exists")
    return sorted(set(problems))
