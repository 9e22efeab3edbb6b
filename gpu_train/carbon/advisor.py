"""Rank regions by the carbon of a GPU machine type, within data-residency and latency limits, and say why each
other region was left out.

Usage:
    ranking = rank("aws", "p5.48xlarge", allow=carbon.allowed(["EU"]), home="eu-central-1", max_latency_ms=40)
    ranking.rows       # best first: Row(region, kg per node-hour, latency estimate, offered True/None)
    ranking.excluded   # {region: why}
    advisory("gcp", "us-east1", ["a3-megagpu-8g"], allow=None)   # the stack plan's one line, or None

Latency: no inter-region latency table could be shipped from a public source with a licence and a vintage
(published matrices are live dashboards), so the latency to `home` is an estimate from the regions'
coordinates: round trip = 2 x great-circle distance x ROUTE_STRETCH / FIBRE_KM_PER_MS. Light in fibre covers
about 200 km per millisecond (refractive index ~1.47); fibre routes are longer than the great circle, here by a
stated factor of 1.5. It is a lower-bound-style figure for ranking, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import gpu_train.carbon as carbon
from gpu_train.carbon.estimate import node_hour_kg

FIBRE_KM_PER_MS = 200.0
ROUTE_STRETCH = 1.5
EARTH_RADIUS_KM = 6371.0
# The stack plan warns when its region's grid intensity is more than this multiple of the best allowed region
# offering the pool's machine type.
ADVISORY_RATIO = 2.0


def distance_km(a: carbon.Region, b: carbon.Region) -> float:
    """Great-circle distance (haversine) between two regions' coordinates."""
    p1, p2 = math.radians(a.latitude), math.radians(b.latitude)
    dp, dl = p2 - p1, math.radians(b.longitude - a.longitude)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def rtt_ms(a: carbon.Region, b: carbon.Region) -> float:
    """Estimated round-trip time between two regions (module docstring)."""
    return 2 * distance_km(a, b) * ROUTE_STRETCH / FIBRE_KM_PER_MS


@dataclass(frozen=True)
class Row:
    region: carbon.Region
    kg_per_node_hour: float | None
    latency_ms: float | None  # to `home`; None without one
    offered: bool | None  # None: the shipped table does not know


@dataclass
class Ranking:
    cloud: str
    instance_type: str
    rows: list[Row] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)


def rank(cloud: str, instance_type: str, *, allow: frozenset[tuple[str, str]] | None = None, home: str = "",
         max_latency_ms: float | None = None) -> Ranking:
    """The cloud's regions that may run `instance_type` within the limits, lowest grid intensity first."""
    offered = carbon.offered(cloud, instance_type)
    home_region = carbon.region(cloud, home) if home else None
    out = Ranking(cloud=cloud, instance_type=instance_type)
    for (c, name), r in sorted(carbon.regions().items()):
        if c != cloud:
            continue
        latency = rtt_ms(home_region, r) if home_region is not None else None
        if allow is not None and (c, name) not in allow:
            out.excluded[name] = f"not allowed ({r.country}, {r.location})"
        elif offered is not None and name not in offered:
            out.excluded[name] = f"{instance_type} is not listed there (availability.csv)"
        elif max_latency_ms is not None and latency is not None and latency > max_latency_ms:
            out.excluded[name] = f"estimated {latency:.0f} ms from {home}, above --max-latency-ms {max_latency_ms:g}"
        else:
            out.rows.append(Row(r, node_hour_kg(cloud, name, instance_type), latency,
                                None if offered is None else True))
    out.rows.sort(key=lambda row: (row.region.intensity, row.region.name))
    return out


def greener(cloud: str, region: str, instance_type: str, *, allow: frozenset[tuple[str, str]] | None = None,
            limit: int = 3) -> list[Row]:
    """Up to `limit` regions that may run the type with a lower grid intensity than `region`, best first."""
    here = carbon.region(cloud, region).intensity
    return [row for row in rank(cloud, instance_type, allow=allow).rows if row.region.intensity < here][:limit]


def greener_text(cloud: str, region: str, instance_type: str, *,
                 allow: frozenset[tuple[str, str]] | None = None) -> str:
    """One line naming the greener regions for the type (or saying there is none)."""
    rows = greener(cloud, region, instance_type, allow=allow)
    if not rows:
        return f"no region with {instance_type} has a lower grid intensity than {region}"
    known = "" if carbon.offered(cloud, instance_type) is not None else \
        f" (which of them offer {instance_type} is not in the shipped table)"
    return (f"greener regions for {instance_type}{known}: "
            + ", ".join(f"{row.region.name} {row.region.intensity:.0f}" for row in rows) + " gCO2e/kWh")


def advisory(cloud: str, region: str, instance_types: list[str], *,
             allow: frozenset[tuple[str, str]] | None) -> str | None:
    """The stack plan's one line when its region is far above the best allowed region offering its pools' types:
    more than ADVISORY_RATIO times its grid intensity. `allow` None: the region's own country or group."""
    allow = allow if allow is not None else carbon.same_area(cloud, region)
    here = carbon.region(cloud, region)
    best: carbon.Region | None = None
    for instance_type in instance_types:
        rows = rank(cloud, instance_type, allow=allow).rows
        if rows and (best is None or rows[0].region.intensity < best.intensity):
            best = rows[0].region
    if best is None or here.intensity <= ADVISORY_RATIO * best.intensity:
        return None
    return (f"carbon: region {region} runs on {here.intensity:.0f} gCO2e/kWh, {here.intensity / best.intensity:.1f}x "
            f"the best allowed region offering {', '.join(sorted(set(instance_types)))} ({best.name}, "
            f"{best.intensity:.0f} gCO2e/kWh); see `gpu-train regions` and docs/carbon.md")
