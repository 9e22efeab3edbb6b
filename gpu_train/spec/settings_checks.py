"""The checks across stack settings that hold on either cloud: `problems(settings)` -> one line per problem.

Usage:
    settings = parse(raw, stack="aws-dev")   # raw: {"gpu-train:<key>": value}: gpu_train.spec.settings.read, then
                                             # `problems`; raises SettingsError naming every problem
    problems(settings)                       # one line per problem, on settings whose values all have their types
The cloud layers add their own (infra/aws/settings_checks.py, infra/gcp/settings_checks.py) before they create
anything.

What is checked here: the stack name; the region against the policy pack's allowed regions and the networks
against private address space (gpu_train/spec/placement.py, whose rules the policy pack uses too); zones; the
address plan (valid, large enough, disjoint); the public endpoint; GPU pools against the GPU catalog
(gpu_train/spec/catalog), their sizes, capacity types and node labels, and the GPU cap; the cache quorum; monitoring and health values; teams, their groups and quotas; the job against its pool
and team (gpu_train/spec/job.py); serving's GPU pools and the stack's services (gpu_train/spec/serving.py); the
prebuilt image's digest; and, for a stack marked `deploy: true`, the placeholder values that example stacks carry.
Over 400 lines because it is the one home of the checks that hold on either cloud; what a job or a service spec
must satisfy on its own lives beside its model (gpu_train/spec/job.py, gpu_train/spec/serving.py).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from gpu_train.spec import catalog
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.job import IMAGE_DIGEST, job_problems
from gpu_train.spec.naming import CPU_FLAVOR, DNS_LABEL, PROJECT
from gpu_train.spec.placement import ALLOWED_REGIONS, PRIVATE_RANGES, label_problem, private_range, region_of
from gpu_train.spec.serving import service_problems as one_service
from gpu_train.spec.serving import stack_service_problems
from gpu_train.spec.settings import HealthSettings, StackSettings, TeamSettings, read

K = f"{PROJECT}:"
# XIDs the NVIDIA driver raises for faults of an application, not of the GPU: the device plugin ignores them for
# its own health checks (internal/rm/health.go of NVIDIA/k8s-device-plugin v0.20.0), and a node must not be
# quarantined because a user's kernel faulted.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
# An allowed registry: a host with a dot or a port (Docker's rule for telling a registry from a repository path),
# then path segments, ending in "/" so that "ghcr.io/acme/" never matches "ghcr.io/acme-evil/...".
REGISTRY_PREFIX = re.compile(r"^(?:[a-z0-9-]+(?:\.[a-z0-9-]+)+|[a-z0-9-]+:[0-9]+|localhost)(?::[0-9]+)?/(?:[a-z0-9._-]+/)*$")
# The object store's URI scheme on each cloud: job URIs must name a bucket there.
BUCKET_SCHEME = {"aws": "s3://", "gcp": "gs://"}
RESERVED_LABEL_PREFIXES = ("gpu-train.io/", "nvidia.com/", "karpenter.sh/")

# Placeholders that example stacks carry and a deployed stack must not: documentation address ranges (RFC 5737,
# RFC 3849), reserved example domains (RFC 2606, RFC 6761), the account ids AWS's documentation uses, the "acme"
# of example company names, and made-up reservation ids.
DOCUMENTATION_RANGES = tuple(ipaddress.ip_network(n) for n in (
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32"))
_EXAMPLE_DOMAIN = re.compile(r"(^|[.@/])(example\.(com|org|net)|[a-z0-9-]+\.(example|test|invalid|localhost))($|[/:])")
_SAMPLE_ACCOUNTS = frozenset({"123456789012", "111122223333", "444455556666", "555555555555", "777788889999",
                              "000000000000", "012345678901", "210987654321"})
_ACME = re.compile(r"(?<![a-z0-9])acme(?![a-z0-9])", re.IGNORECASE)
_PLACEHOLDER_WORD = re.compile(r"(?<![a-z0-9])(example|sample|placeholder|changeme|replace-?me|dummy|xxx+)(?![a-z0-9])",
                               re.IGNORECASE)
_SEQUENCE = re.compile(r"0123456|1234567|abcdef0|0a1b2c3d|a1b2c3d4|(.)\1{7}")


@dataclass(frozen=True)
class PoolFacts:
    """A pool as the job checks see it, from the settings and the catalog."""

    name: str
    instance_type: str
    gpus_per_node: int
    max_nodes: int
    gpu_type: str = ""  # "" when the catalog does not know the instance type


@dataclass(frozen=True)
class TeamFacts:
    name: str
    gpu_quota: Mapping[str, int]


def pool_facts(s: StackSettings) -> list[PoolFacts]:
    out = []
    for pool in s.gpu_pools:
        shape = catalog.shape(s.cloud, pool.instance_type)
        out.append(PoolFacts(pool.name, pool.instance_type, shape.gpus if shape else 0, pool.max_nodes,
                             shape.gpu_type if shape else ""))
    return out


def team_facts(s: StackSettings) -> list[TeamFacts]:
    return [TeamFacts(t.name, s.team_quota(t)) for t in s.teams]


def parse(raw: Mapping[str, Any], stack: str) -> StackSettings:
    """Read and check one stack's settings: types and ranges, then every cloud-neutral check across settings."""
    settings = read(raw).model_copy(update={"stack": stack})
    found = problems(settings)
    if found:
        raise SettingsError(found)
    return settings


def problems(s: StackSettings) -> list[str]:
    """Every cloud-neutral problem of a stack whose values have their types."""
    p: list[str] = []
    if not DNS_LABEL.match(s.stack):
        p.append(f"stack name {s.stack!r} must be a lowercase DNS label")
    if region_of(s.region) not in ALLOWED_REGIONS:
        p.append(f"{K}region {s.region!r} is not one of the policy pack's allowed regions "
                 f"({', '.join(ALLOWED_REGIONS)}): its allowed-regions rule would refuse the stack's resources")
    if not s.zones:
        p.append(f"{K}zones must list at least one zone")
    if len(set(s.zones)) != len(s.zones):
        p.append(f"{K}zones lists a zone twice")
    for tag, value in s.tags.items():
        if len(value) > 63:
            p.append(f"{K}tags.{tag} must be a string of at most 63 characters")
    p += network_problems(s) + cluster_problems(s) + pool_problems(s) + service_problems(s)
    p += health_problems(s.health)
    p += team_problems(s)
    p += serving_problems(s)
    if s.job is not None:
        p += job_problems(s.job, pools=pool_facts(s), teams=team_facts(s), scheme=BUCKET_SCHEME[s.cloud])
    if s.image.prebuilt and not IMAGE_DIGEST.match(s.image.prebuilt):
        p.append(f"{K}image.prebuilt must be pinned by digest, like repo/name@sha256:<64 hex> "
                 f"(got {s.image.prebuilt!r})")
    for i, prefix in enumerate(s.image.allowed_registries):
        if not REGISTRY_PREFIX.match(prefix):
            p.append(f"{K}image.allowedRegistries[{i}] must be a registry host and optional path ending in '/', like "
                     f"'ghcr.io/acme/' (got {prefix!r})")
    if s.deploy:
        p += placeholder_problems(s)
    return p


# The platform needs Kubernetes 1.31 or later: the job's Job uses successPolicy, on by default from 1.31 (KEP-3998).
PLATFORM_MIN_KUBERNETES = (1, 31)


def kubernetes_version_problems(version: str, offered: tuple[str, ...], where: str) -> list[str]:
    """`cluster.kubernetesVersion` against the minors `where` (a cloud's service or channel) offers for new
    clusters, of which the platform takes those from PLATFORM_MIN_KUBERNETES on."""
    key = f"{K}cluster.kubernetesVersion"
    supported = [v for v in offered if tuple(int(x) for x in v.split(".")) >= PLATFORM_MIN_KUBERNETES]
    if version in supported:
        return []
    if version in offered:
        return [f"{key} {version!r} is older than this platform supports (Job successPolicy needs 1.31 or later; "
                f"{where} offers {', '.join(supported)})"]
    return [f"{key} {version!r} is not a Kubernetes minor {where} offers for new clusters "
            f"(supported: {', '.join(supported)})"]


def network(value: str, key: str, problems: list[str]) -> ipaddress.IPv4Network | None:
    """An IPv4 CIDR setting, or None after reporting why it is not one."""
    try:
        return ipaddress.IPv4Network(value, strict=True)
    except ValueError as exc:
        problems.append(f"{key} must be an IPv4 CIDR block (got {value!r}: {exc})")
        return None


def networks(s: StackSettings) -> dict[str, ipaddress.IPv4Network]:
    """The stack's valid node, pod and service ranges by full key."""
    out = {}
    for name, camel in (("vpc_cidr", "vpcCidr"), ("pod_cidr", "podCidr"), ("service_cidr", "serviceCidr")):
        net = network(getattr(s.network, name), f"{K}network.{camel}", [])
        if net is not None:
            out[f"{K}network.{camel}"] = net
    return out


def network_problems(s: StackSettings) -> list[str]:
    p: list[str] = []
    nets = {}
    for name, camel in (("vpc_cidr", "vpcCidr"), ("pod_cidr", "podCidr"), ("service_cidr", "serviceCidr")):
        key = f"{K}network.{camel}"
        net = network(getattr(s.network, name), key, p)
        if net is not None:
            nets[key] = net
            if net.prefixlen > 20:
                p.append(f"{key} must be /20 or larger (got /{net.prefixlen})")
            if private_range(str(net)) is None:
                p.append(f"{key} {net} is not private address space: it must lie in one of "
                         f"{', '.join(PRIVATE_RANGES)}")
    items = list(nets.items())
    for i, (ka, a) in enumerate(items):
        for kb, b in items[i + 1:]:
            if a.overlaps(b):
                p.append(f"{kb} {b} overlaps {ka} {a}")
    return p


def cluster_problems(s: StackSettings) -> list[str]:
    p: list[str] = []
    c = s.cluster
    if c.endpoint_public_access and not c.public_access_cidrs:
        p.append(f"{K}cluster.publicAccessCidrs must list the allowed CIDRs when endpointPublicAccess is true")
    public = [net for i, cidr in enumerate(c.public_access_cidrs)
              if (net := network(cidr, f"{K}cluster.publicAccessCidrs[{i}]", p)) is not None]
    # Normalise the set: several ranges can add up to the whole internet (0.0.0.0/1 + 128.0.0.0/1).
    for net in ipaddress.collapse_addresses(public):
        if net.prefixlen == 0:
            p.append(f"{K}cluster.publicAccessCidrs {list(c.public_access_cidrs)} together open the API "
                     "endpoint to the whole internet (0.0.0.0/0)")
    if c.system_nodes_max < c.system_nodes_min:
        p.append(f"{K}cluster.systemNodesMax must be >= systemNodesMin "
                 f"(got {c.system_nodes_max} < {c.system_nodes_min})")
    return p


def pool_problems(s: StackSettings) -> list[str]:
    p: list[str] = []
    if not s.gpu_pools:
        p.append(f"{K}gpuPools must list at least one pool")
    seen: set[str] = set()
    total_gpus = 0
    for i, pool in enumerate(s.gpu_pools):
        pk = f"{K}gpuPools[{i}]"
        if not DNS_LABEL.match(pool.name):
            p.append(f"{pk}.name {pool.name!r} must be a lowercase DNS label of at most 32 characters")
        if pool.name in seen:
            p.append(f"{pk}.name {pool.name!r} is used by another pool")
        if pool.name == CPU_FLAVOR:
            p.append(f"{pk}.name {pool.name!r} is the name of Kueue's flavor for the CPU (system) nodes; choose "
                     "another")
        seen.add(pool.name)
        shape = catalog.shape(s.cloud, pool.instance_type)
        if shape is None:
            p.append(f"{pk}.instanceType {pool.instance_type!r} is not a known {s.cloud} GPU type "
                     f"(known: {', '.join(catalog.known(s.cloud))})")
        if pool.max_nodes < pool.min_nodes:
            p.append(f"{pk}.maxNodes must be >= minNodes (got {pool.max_nodes} < {pool.min_nodes})")
        if not s.is_prod and pool.min_nodes != 0:
            p.append(f"{pk}.minNodes must be 0 in a {s.environment} stack (GPU pools scale to zero)")
        if pool.capacity in ("reservation", "capacity-block") and not pool.reservation_id:
            p.append(f"{pk}.reservationId is required for capacity {pool.capacity!r}")
        if pool.capacity not in ("reservation", "capacity-block") and pool.reservation_id:
            p.append(f"{pk}.reservationId only applies to reservation or capacity-block capacity")
        if pool.fabric:
            if not pool.zone:
                p.append(f"{pk}.zone is required when fabric is true (compact placement is in one zone)")
            if shape is not None and shape.fabric == "none":
                p.append(f"{pk}.fabric is true but {pool.instance_type} has no high-bandwidth fabric")
        if pool.zone and pool.zone not in s.zones:
            p.append(f"{pk}.zone {pool.zone!r} is not one of zones {list(s.zones)}")
        if shape is not None and shape.accelerator == "neuron":
            p.append(f"{pk}.instanceType {pool.instance_type} has Trainium chips; the trainer image needs NVIDIA GPUs")
        for label, value in pool.labels.items():
            if label.startswith(RESERVED_LABEL_PREFIXES):
                p.append(f"{pk}.labels.{label} uses a reserved prefix")
            elif why := label_problem(label, value):
                p.append(f"{pk}.labels.{label} is not a Kubernetes label: {why}")
        if shape is not None:
            total_gpus += shape.gpus * pool.max_nodes
    if total_gpus > s.limits.max_gpus:
        p.append(f"{K}gpuPools allow up to {total_gpus} GPUs, over {K}limits.maxGpus = {s.limits.max_gpus}")
    return p


def service_problems(s: StackSettings) -> list[str]:
    """The cache, monitoring and MLflow settings."""
    p: list[str] = []
    if s.cache.masters not in (1, 3, 5):
        p.append(f"{K}cache.masters must be 1, 3 or 5 (an odd journal quorum; got {s.cache.masters})")
    if s.is_prod and s.cache.enabled and s.cache.masters == 1:
        p.append(f"{K}cache.masters must be 3 or 5 in a prod stack (a single master is a single point of failure)")
    m = s.monitoring
    if not DURATION.match(m.retention):
        p.append(f"{K}monitoring.retention must be a Prometheus duration like '15d' (got {m.retention!r})")
    return p


def health_problems(h: HealthSettings) -> list[str]:
    k = f"{K}health"
    p = []
    seen: set[int] = set()
    for i, code in enumerate(h.xid_codes):
        if code in APPLICATION_XIDS:
            p.append(f"{k}.xidCodes[{i}] XID {code} is raised by an application fault, not a GPU fault "
                     f"(application XIDs: {sorted(APPLICATION_XIDS)}); quarantining on it would empty healthy nodes")
        elif code in seen:
            p.append(f"{k}.xidCodes[{i}] XID {code} is listed twice")
        seen.add(code)
    return p


def serving_problems(s: StackSettings) -> list[str]:
    """Serving: its GPU pools exist and carry no team quota (Kueue does not see serving pods, so it would admit
    training onto GPUs a service holds); each of the stack's services fits the platform and pins its version."""
    sv, p = s.serving, []
    if not sv.enabled:
        if sv.services or sv.gpu_pools:
            p.append(f"{K}serving.services and serving.gpuPools need serving.enabled: true")
        return p
    if not s.mlflow.enabled:
        p.append(f"{K}serving.enabled needs mlflow.enabled: served versions come from MLflow's registry and "
                 "artifact store")
    pools = {pool.name for pool in s.gpu_pools}
    for i, name in enumerate(sv.gpu_pools):
        if name not in pools:
            p.append(f"{K}serving.gpuPools[{i}] {name!r} is not one of gpuPools[].name ({', '.join(sorted(pools))})")
            continue
        for j, team in enumerate(s.teams):
            gpus = s.team_quota(team).get(name, 0)
            if gpus:
                p.append(f"{K}teams[{j}].gpuQuota gives team {team.name!r} {gpus} GPUs on pool {name!r}, which "
                         f"serving.gpuPools[{i}] lends to serving: Kueue would admit training onto GPUs a service "
                         "holds (give the team 0 there)")
    names: set[str] = set()
    for i, spec in enumerate(sv.services):
        key = f"{K}serving.services[{i}]"
        if spec.name in names:
            p.append(f"{key}.name {spec.name!r} is used by another service")
        names.add(spec.name)
        p += one_service(spec, teams=[t.name for t in s.teams], gpu_pools=list(sv.gpu_pools),
                         scrape_interval_s=sv.scrape_interval_seconds, key=key)
        p += stack_service_problems(spec, key)
    return p


def team_problems(s: StackSettings) -> list[str]:
    p: list[str] = []
    if not s.teams:
        p.append(f"{K}teams must list at least one team")
    names: set[str] = set()
    for i, team in enumerate(s.teams):
        tk = f"{K}teams[{i}]"
        if not DNS_LABEL.match(team.name):
            p.append(f"{tk}.name {team.name!r} must be a lowercase DNS label")
        if team.name in names:
            p.append(f"{tk}.name {team.name!r} is used by another team")
        names.add(team.name)
        p += quota_problems(s, team, tk)
        prep = team.prepare_quota
        if (prep.cpus == 0) != (prep.memory_gi == 0):
            p.append(f"{tk}.prepareQuota.memoryGi must be 0 exactly when cpus is (got cpus {prep.cpus}, memoryGi "
                     f"{prep.memory_gi}): one without the other admits no data preparation")
        for field_name in ("submitters", "viewers"):
            for j, group in enumerate(getattr(team, field_name)):
                if not group.strip():
                    p.append(f"{tk}.{field_name}[{j}] must name a group (got {group!r})")
                elif group.startswith("system:"):
                    # https://kubernetes.io/docs/reference/access-authn-authz/authentication/ (system: is reserved)
                    p.append(f"{tk}.{field_name}[{j}] {group!r} uses the system: prefix Kubernetes reserves for "
                             "its own groups")
        seen: set[str] = set()
        for j, member in enumerate(team.members):
            if member.principal in seen:
                p.append(f"{tk}.members[{j}].principal {member.principal!r} is listed twice in team {team.name!r}")
            seen.add(member.principal)
    return p


def quota_problems(s: StackSettings, team: TeamSettings, tk: str) -> list[str]:
    p = []
    pools = {pool.name: pool for pool in s.gpu_pools}
    # The one-number form is that number on every pool: both forms are held to each pool's capacity alike.
    per_pool = isinstance(team.gpu_quota, Mapping)
    entries = team.gpu_quota if isinstance(team.gpu_quota, Mapping) else dict.fromkeys(pools, team.gpu_quota)
    for name, gpus in entries.items():
        key = f"{tk}.gpuQuota.{name}" if per_pool else f"{tk}.gpuQuota"
        capacity = s.pool_capacity(pools[name]) if name in pools else 0
        if name not in pools:
            p.append(f"{key} is not one of gpuPools[].name ({', '.join(pools)})")
        elif capacity and gpus > capacity:
            p.append(f"{key} {gpus} is more than pool {name!r} can ever hold "
                     f"({capacity} GPUs: maxNodes x GPUs per node)")
    if not p and pools and sum(s.team_quota(team).values()) == 0:
        p.append(f"{tk}.gpuQuota gives team {team.name!r} no GPUs on any pool: it could only run on what "
                 "other teams lend")
    return p


def walk(value: Any, key: str):
    """(full key, value) for every scalar in a settings tree."""
    if isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            if name != "stack":
                alias = field.alias or name
                yield from walk(getattr(value, name), f"{key}.{alias}" if key else f"{K}{alias}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from walk(v, f"{key}.{k}")
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            yield from walk(v, f"{key}[{i}]")
    else:
        yield key, value


def placeholder(key: str, value: str) -> str | None:
    """Why a value looks like an example stack's placeholder rather than something real."""
    for token in re.split(r"[\s,;]+", value):
        try:
            net = ipaddress.ip_network(token, strict=False)
        except ValueError:
            continue
        for doc in DOCUMENTATION_RANGES:
            if net.version == doc.version and net.overlaps(doc):
                return f"{net} is in the documentation range {doc} (RFC {'3849' if doc.version == 6 else '5737'})"
    if _EXAMPLE_DOMAIN.search(value.lower()):
        return "it names a reserved example domain (RFC 2606)"
    if any(acct in re.findall(r"(?<![0-9])[0-9]{12}(?![0-9])", value) for acct in _SAMPLE_ACCOUNTS):
        return "it holds an AWS documentation sample account id"
    if _ACME.search(value):
        return "'acme' is the example company of the example stacks"
    if _PLACEHOLDER_WORD.search(value) and ".overrides." not in key:  # trainer settings are not names
        return "it reads as a placeholder"
    if key.endswith(".reservationId") and _SEQUENCE.search(value.lower()):
        return "it is a made-up reservation id (a run of sequential or repeated characters)"
    return None


def placeholder_problems(s: StackSettings) -> list[str]:
    """Values of a stack marked for deployment that are an example's placeholders, by full key."""
    out = []
    for key, value in walk(s, ""):
        if isinstance(value, str) and value:
            why = placeholder(key, value)
            if why:
                out.append(f"{key} {value!r} is a placeholder in a stack marked deploy: true: {why}")
    return out
