"""The stack settings that only make sense on GCP, checked before the GCP layer creates anything.

Usage: `problems(settings)` -> one line per problem, each with its full key; `infra.gcp.build_platform` refuses
settings with any (gpu_train.spec.settings has already checked every value's type and the cloud-neutral rules).

Held against Google's own definitions: the region list, zone names, project id syntax, label syntax, the
Kubernetes minors of each GKE release channel, GCE machine type and reservation syntax, GKE's Google Groups for
RBAC (one domain per cluster), the control plane's /28, and room for the layer's own address plans (fabric
subnets, Cloud SQL's private service access range).
"""

from __future__ import annotations

import difflib
import ipaddress
import re

from gpu_train.spec.errors import SettingsError
from gpu_train.spec.naming import PROJECT
from gpu_train.spec.settings import StackSettings, TeamSettings
from gpu_train.spec.settings_checks import kubernetes_version_problems, network, networks

K = f"{PROJECT}:"
# Kubernetes minors per release channel ("Available minor versions" of
# https://cloud.google.com/kubernetes-engine/docs/release-notes, February 2026); the platform takes those from
# gpu_train.spec.settings_checks.PLATFORM_MIN_KUBERNETES on.
KUBERNETES_VERSIONS = {"RAPID": ("1.32", "1.33", "1.34", "1.35"), "REGULAR": ("1.32", "1.33", "1.34"),
                       "STABLE": ("1.32", "1.33")}
# https://cloud.google.com/compute/docs/regions-zones (February 2026).
REGIONS = frozenset({
    "africa-south1", "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast2", "asia-northeast3",
    "asia-south1", "asia-south2", "asia-southeast1", "asia-southeast2", "australia-southeast1",
    "australia-southeast2", "europe-central2", "europe-north1", "europe-north2", "europe-southwest1",
    "europe-west1", "europe-west2", "europe-west3", "europe-west4", "europe-west6", "europe-west8",
    "europe-west9", "europe-west10", "europe-west12", "me-central1", "me-central2", "me-west1",
    "northamerica-northeast1", "northamerica-northeast2", "northamerica-south1", "southamerica-east1",
    "southamerica-west1", "us-central1", "us-east1", "us-east4", "us-east5", "us-south1", "us-west1",
    "us-west2", "us-west3", "us-west4",
})


def problems(s: StackSettings) -> list[str]:
    p = region_problems(s)
    p += label_problems(s)
    channel = s.cluster.release_channel
    p += kubernetes_version_problems(s.cluster.kubernetes_version, KUBERNETES_VERSIONS.get(channel, ()),
                                     f"GKE's {channel} channel")
    node_type = s.cluster.system_node_type
    if node_type and not re.fullmatch(r"[a-z][a-z0-9]*-[a-z0-9-]+", node_type):
        p.append(f"{K}cluster.systemNodeType {node_type!r} is not a GCE machine type name (like 'e2-standard-4')")
    p += master_cidr_problems(s)
    for i, pool in enumerate(s.gpu_pools):
        pk = f"{K}gpuPools[{i}]"
        # A GCE reservation is a lowercase resource name, or projects/<p>/reservations/<name> when shared.
        pattern = r"(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/reservations/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
        if pool.reservation_id and not re.fullmatch(pattern, pool.reservation_id):
            p.append(f"{pk}.reservationId {pool.reservation_id!r} is not a GCE reservation name (lowercase letters, "
                     "digits and hyphens)")
        if pool.capacity == "capacity-block":
            p.append(f"{pk}.capacity 'capacity-block' is an AWS market type; use 'reservation' on GCP")
    for i, team in enumerate(s.teams):
        for j, _ in enumerate(team.members):
            p.append(f"{K}teams[{i}].members[{j}] is an AWS setting (EKS access entries); on GKE add people to the "
                     f"Google groups in {K}teams[{i}].submitters / viewers")
    p += gke_group_problems(s.teams)
    if s.logs.retention_days is not None:
        p.append(f"{K}logs.retentionDays applies to CloudWatch Logs on AWS; GKE keeps container logs in Cloud Logging, "
                 "whose retention is the project's _Default log bucket setting")
    if s.deploy_runner.kind == "codebuild":
        p.append(f"{K}deployRunner.kind 'codebuild' is an AWS runner; GKE's control plane is reached through its "
                 "DNS-based endpoint")
    elif s.deploy_runner.repository or s.deploy_runner.connection_arn:
        p.append(f"{K}deployRunner.repository and connectionArn only apply with kind 'codebuild'")
    if not p:
        p += address_plan_problems(s)
    return p


def region_problems(s: StackSettings) -> list[str]:
    p = []
    if s.region not in REGIONS:
        close = difflib.get_close_matches(s.region, sorted(REGIONS), n=1)
        p.append(f"{K}region {s.region!r} is not a GCP region" + (f" (did you mean {close[0]!r}?)" if close else ""))
    else:
        for i, zone in enumerate(s.zones):
            if not re.fullmatch(re.escape(s.region) + "-[a-z]", zone):
                p.append(f"{K}zones[{i}] {zone!r} is not a zone of region {s.region!r}")
    if not s.project:
        p.append(f"{K}project is required when cloud is gcp")
    elif not re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]", s.project):
        # https://cloud.google.com/resource-manager/docs/creating-managing-projects (project ID rules)
        p.append(f"{K}project {s.project!r} is not a GCP project id (6 to 30 lowercase letters, digits and hyphens, "
                 "starting with a letter)")
    return p


def label_problems(s: StackSettings) -> list[str]:
    """Tags become GCP labels: https://cloud.google.com/compute/docs/labeling-resources (requirements)."""
    p = []
    for tag, value in s.tags.items():
        if not re.match(r"^[a-z][a-z0-9_-]{0,62}$", tag):
            p.append(f"{K}tags.{tag} is not a valid GCP label key (lowercase letters, digits, _ and -)")
        if len(value) <= 63 and not re.fullmatch(r"[a-z0-9_-]*", value):
            p.append(f"{K}tags.{tag} value {value!r} is not a valid GCP label value (lowercase letters, digits, _ and -)")
    return p


def master_cidr_problems(s: StackSettings) -> list[str]:
    p: list[str] = []
    net = network(s.cluster.master_cidr, f"{K}cluster.masterCidr", p)
    if net is not None and net.prefixlen != 28:
        p.append(f"{K}cluster.masterCidr must be a /28 (got /{net.prefixlen})")
    if net is not None:
        for other_key, other in networks(s).items():
            if net.overlaps(other):
                p.append(f"{K}cluster.masterCidr {net} overlaps {other_key} {other}: the control plane's range must "
                         "lie outside the cluster's networks")
    return p


def address_plan_problems(s: StackSettings) -> list[str]:
    """The layer's own address planning (fabric subnets in 192.168.0.0/16, the Private Service Access range in
    10.0.0.0/8) must find room beside the stack's ranges."""
    try:
        ipaddress.IPv4Network(s.cluster.master_cidr)
    except ValueError:
        return []
    from infra.gcp import network as plan

    p = []
    if any(pool.fabric for pool in s.gpu_pools):
        try:
            plan.fabric_sets(s)
        except (ValueError, KeyError) as exc:
            p.append(f"{K}network ranges leave no room for the GPU fabric subnets: {exc}")
    if s.mlflow.enabled and s.mlflow.database == "managed":
        try:
            plan.psa_range(s)
        except ValueError as exc:
            p.append(f"{K}network ranges leave no room for Cloud SQL's private range: {exc}")
    return p


def _group_domains(teams: tuple[TeamSettings, ...]) -> tuple[dict[str, str], list[str]]:
    """Domain -> the first setting naming a group of it, and the settings whose group is not an e-mail address."""
    domains: dict[str, str] = {}
    bad: list[str] = []
    for t, team in enumerate(teams):
        for field_name, groups in (("submitters", team.submitters), ("viewers", team.viewers)):
            for g, group in enumerate(groups):
                key = f"{K}teams[{t}].{field_name}[{g}]"
                if "@" not in group:
                    bad.append(f"{key} must be a Google group e-mail address on GKE (got {group!r})")
                else:
                    domains.setdefault(group.rsplit("@", 1)[1].lower(), key)
    return domains, bad


def gke_group_problems(teams: tuple[TeamSettings, ...]) -> list[str]:
    """GKE's Google Groups for RBAC reads one gke-security-groups@<domain> group per cluster: the team groups must be
    e-mail addresses of one domain."""
    domains, bad = _group_domains(teams)
    if len(domains) > 1:
        listed = ", ".join(f"{d} ({k})" for d, k in sorted(domains.items()))
        bad.append(f"{K}teams groups span several domains ({listed}); Google Groups for RBAC reads one "
                   "gke-security-groups@<domain> group per cluster")
    return bad


def gke_security_group(teams: tuple[TeamSettings, ...]) -> str | None:
    """The Google Groups for RBAC security group, gke-security-groups@<domain> of the teams' groups; None when no team
    names a group. Refuses what gke_group_problems reports."""
    found = gke_group_problems(teams)
    if found:
        raise SettingsError(found)
    domains, _ = _group_domains(teams)
    return f"gke-security-groups@{next(iter(domains))}" if domains else None
