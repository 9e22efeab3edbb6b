"""Where a stack may live and what its addresses and labels may be: the rules both the plan's settings checks
(gpu_train.spec.settings_checks) and the policy pack (policies/) hold a stack to, defined once here.

Usage:
    region_of("us-east-1a")                    # "us-east-1": zones map to their region (AWS and GCP)
    ALLOWED_REGIONS                            # the policy pack's default allowedRegions
    private_range("172.20.0.0/16")             # "172.16.0.0/12"; None for public address space
    label_problem("team", "ml research")       # why a Kubernetes label is invalid, or None

The allowed regions are the ones with the GPU types the stacks use (H100, L4, L40S) in both clouds; the policy pack
takes them as its `allowedRegions` default, and a policy config may narrow or widen that list for the pack.
Private address space is RFC 1918's three ranges and RFC 6598's shared range (100.64.0.0/10, which AWS custom
pod networking and GKE take for pods); the policy pack counts them, with IANA's other special-purpose ranges, as
not reachable from the internet. Label keys and values follow Kubernetes' syntax
(https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set).
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["ALLOWED_REGIONS", "PRIVATE_RANGES", "label_problem", "private_range", "region_of"]

ALLOWED_REGIONS: tuple[str, ...] = (
    "us-east-1", "us-east-2", "us-west-2", "eu-west-1",
    "us-central1", "us-east4", "us-east5", "europe-west4",
)

AWS_ZONE = re.compile(r"^([a-z]{2}(-gov)?-[a-z]+-[0-9])[a-z]$")
AWS_REGION = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-[0-9]$")
GCP_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")


def region_of(location: str) -> str:
    """The region a location names: zones map to their region; regions stay as they are (lowercased)."""
    loc = location.lower()
    for pattern in (AWS_ZONE, GCP_ZONE):
        m = pattern.match(loc)
        if m:
            return m.group(1)
    return loc


PRIVATE_RANGES: tuple[str, ...] = ("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16")


def private_range(cidr: str) -> str | None:
    """The private range (PRIVATE_RANGES) that holds the whole IPv4 block `cidr`, or None."""
    net = ipaddress.IPv4Network(cidr, strict=False)
    return next((r for r in PRIVATE_RANGES if net.subnet_of(ipaddress.IPv4Network(r))), None)


# A label key: an optional DNS subdomain prefix of at most 253 characters and "/", then a name of at most 63
# characters; a value: at most 63 characters, empty or alphanumeric at both ends, with "-", "_", "." between.
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def label_problem(key: str, value: str) -> str | None:
    """Why `key: value` cannot be a Kubernetes label, or None when it can."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _PREFIX.match(prefix)):
        return f"label key {key!r}: its prefix must be a DNS subdomain (lowercase, at most 253 characters)"
    if len(name) > 63 or not _NAME.match(name):
        return (f"label key {key!r}: its name must be at most 63 characters, letters and digits at both ends and "
                "'-', '_', '.' between")
    if value and (len(value) > 63 or not _NAME.match(value)):
        return (f"label value {value!r}: at most 63 characters, empty or letters and digits at both ends and "
                "'-', '_', '.' between")
    return None
