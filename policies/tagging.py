"""Tagging and placement rules: required tags/labels on every taggable resource, allowed regions.

Usage: `from policies import tagging; tagging.tag_field("aws:s3/bucket:Bucket")` -> "tags";
`list(tagging.required_tags(res, ctx))` yields one detail string per problem.

Which types are taggable is read from the installed provider SDKs, not from a hand-kept list: a
type is taggable when its resource class takes a `tags` input (AWS) or a `labels` /
`resource_labels` input (GCP). The SDKs are the pinned, maintained source of that fact, so a
type without tags (an IAM policy attachment, a firewall rule) is never flagged, and a new
taggable type is covered the day it appears. Two nested places where the platform's GPU nodes
get their cloud tags are added by hand (`NESTED_TAGS`): a GKE node pool's
`nodeConfig.resourceLabels` and a Karpenter EC2NodeClass's `spec.tags`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Iterator, Mapping
from functools import cache

from policies.core import Context, Resource, dig, items

_SDK_PACKAGES = {"aws": "pulumi_aws", "gcp": "pulumi_gcp"}
# (type token) -> (prop path of the tag map, what to call it in messages)
NESTED_TAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "gcp:container/nodePool:NodePool": (("nodeConfig", "resourceLabels"), "nodeConfig.resourceLabels"),
    "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass": (("spec", "tags"), "spec.tags"),
}
_TOKEN = re.compile(r"^(?P<pkg>[a-z0-9-]+):(?P<mod>[A-Za-z0-9/.-]+):(?P<cls>[A-Za-z0-9]+)$")


@cache
def tag_field(type_token: str) -> str | None:
    """The camelCase input holding a type's tags or labels, or None if the type has none."""
    if type_token in NESTED_TAGS:
        return NESTED_TAGS[type_token][1]
    match = _TOKEN.match(type_token)
    if not match or match["pkg"] not in _SDK_PACKAGES:
        return None
    module_name = match["mod"].split("/")[0]
    package = _SDK_PACKAGES[match["pkg"]]
    try:
        with warnings.catch_warnings():  # SDK modules warn about their own deprecated aliases on import
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(package if module_name == "index" else f"{package}.{module_name}")
            cls = getattr(module, match["cls"], None)  # SDK modules load their classes lazily, here
    except ImportError:
        return None
    init = getattr(cls, "_internal_init", None)
    if init is None:
        return None
    params = inspect.signature(init).parameters
    if match["pkg"] == "aws":
        return "tags" if "tags" in params else None
    if "labels" in params:
        return "labels"
    return "resourceLabels" if "resource_labels" in params else None


def _tag_map(res: Resource, field: str) -> dict[str, str]:
    path = NESTED_TAGS[res.type][0] if res.type in NESTED_TAGS else (field,)
    value = res.get(*path)
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    # aws:autoscaling/group takes tags as a list of {key, value, propagateAtLaunch}.
    return {str(dig(t, "key")): dig(t, "value") for t in items(value) if dig(t, "key")}


def required_tags(res: Resource, ctx: Context) -> Iterator[str]:
    """Every taggable resource carries the required tags (AWS) or labels (GCP) with values."""
    field = tag_field(res.type)
    if field is None:
        return
    tags = _tag_map(res, field)
    missing = [k for k in ctx.required_tags if not isinstance(tags.get(k), str) or not tags.get(k)]
    if missing:
        yield f"{field} lacks {', '.join(missing)} (has: {', '.join(sorted(tags)) or 'none'})."


_AWS_ZONE = re.compile(r"^([a-z]{2}(-gov)?-[a-z]+-[0-9])[a-z]$")
_GCP_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
_REGION_KEYS = ("region", "location", "zone")


def region_of(location: str) -> str:
    """The region a location names: zones map to their region; regions stay as they are."""
    loc = location.lower()
    for pattern in (_AWS_ZONE, _GCP_ZONE):
        m = pattern.match(loc)
        if m:
            return m.group(1)
    return loc


def allowed_regions(res: Resource, ctx: Context) -> Iterator[str]:
    """Resources and providers are placed only in the allowed regions."""
    if not res.type.startswith(("aws:", "gcp:", "pulumi:providers:aws", "pulumi:providers:gcp")):
        return
    for key in _REGION_KEYS:
        value = res.get(key)
        if not isinstance(value, str) or not value or value.lower() == "global":
            continue
        if region_of(value) not in ctx.allowed_regions:
            yield f"{key} {value!r} is outside the allowed regions ({', '.join(ctx.allowed_regions)})."
