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

Regions: GCP resources name a region or zone; AWS resources say where they are through their
`region` input (pulumi-aws 7), availability zones, the region field of the ARNs they use
(https://docs.aws.amazon.com/IAM/latest/UserGuide/reference-arns.html) and VPC endpoint service
names (`com.amazonaws.<region>.<service>`), so a stack planned in another region is caught even
though the default provider itself is not a resource of the offline plan.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Iterator, Mapping
from functools import cache

from gpu_train.spec.placement import AWS_REGION, AWS_ZONE, region_of
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


_REGION_KEYS = ("region", "location", "zone")
# Where an AWS resource shows its region when it has no `region` input: availability zones, ARNs
# (arn:partition:service:region:account:resource) and VPC endpoint service names
# (com.amazonaws.<region>.<service>).
_AWS_ZONE_KEYS = ("availabilityZone", "availabilityZones")
_ARN = re.compile(r"^arn:aws[a-z-]*:[a-z0-9-]+:([a-z0-9-]*):")
_ENDPOINT_SERVICE = re.compile(r"^com\.amazonaws\.([a-z0-9-]+)\.")


def _aws_places(value, path: str = "") -> Iterator[tuple[str, str]]:
    """(where, region) for every AWS zone, ARN region and endpoint service region in a prop tree."""
    if isinstance(value, Mapping):
        for key, v in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in _AWS_ZONE_KEYS:
                for zone in (items(v) if not isinstance(v, str) else [v]):
                    if isinstance(zone, str) and AWS_ZONE.match(zone):
                        yield where, region_of(zone)
            else:
                yield from _aws_places(v, where)
    elif isinstance(value, str):
        for pattern in (_ARN, _ENDPOINT_SERVICE):
            m = pattern.match(value)
            if m and AWS_REGION.match(m.group(1)):
                yield path, m.group(1)
    else:
        for i, v in enumerate(items(value)):
            yield from _aws_places(v, f"{path}[{i}]")


def allowed_regions(res: Resource, ctx: Context) -> Iterator[str]:
    """Resources and providers are placed only in the allowed regions.

    GCP resources name their region or zone; AWS resources their `region` (pulumi-aws 7), their
    availability zones, and the region inside the ARNs and endpoint service names they use.
    """
    if not res.type.startswith(("aws:", "gcp:", "pulumi:providers:aws", "pulumi:providers:gcp")):
        return
    for key in _REGION_KEYS:
        value = res.get(key)
        if not isinstance(value, str) or not value or value.lower() == "global":
            continue
        if region_of(value) not in ctx.allowed_regions:
            yield f"{key} {value!r} is outside the allowed regions ({', '.join(ctx.allowed_regions)})."
    if res.type.startswith("aws:"):
        outside = sorted({(where, region) for where, region in _aws_places(res.props)
                          if region not in ctx.allowed_regions})
        if outside:
            shown = ", ".join(f"{where} in {region}" for where, region in outside[:3])
            more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
            yield f"{shown}{more} is outside the allowed regions ({', '.join(ctx.allowed_regions)})."
