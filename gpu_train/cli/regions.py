"""`gpu-train regions`: the regions that can run a GPU machine type, ranked by grid carbon intensity, within the
countries, groups and regions a team may use and a latency limit from its home region.

Usage:
    gpu-train regions --pool-type p5.48xlarge --allow EU
    gpu-train regions --pool-type a3-megagpu-8g --allow EU,CH --home europe-west3 --max-latency-ms 20 --explain

The numbers come from the shipped tables (gpu_train/carbon; docs/carbon.md): grid intensity, Google's CFE%,
kg CO2e per node-hour at full power (GPUs x TDP x PUE x intensity) and an estimated round trip to --home from the
regions' coordinates (gpu_train/carbon/advisor.py).
"""

from __future__ import annotations

import sys

from gpu_train import carbon
from gpu_train.carbon import advisor
from gpu_train.client.errors import ClientError
from gpu_train.spec import catalog


def cloud_of(instance_type: str) -> str:
    clouds = [c for c in ("aws", "gcp") if catalog.shape(c, instance_type) is not None]
    if not clouds:
        known = ", ".join(catalog.known("aws") + catalog.known("gcp"))
        raise ClientError(f"--pool-type {instance_type!r} is in neither catalog ({known})")
    return clouds[0]


def offerings_check(instance_type: str) -> str:
    """The AWS CLI command that answers, for one region, whether it offers the type."""
    return (f"`aws ec2 describe-instance-type-offerings --location-type region --filters "
            f"Name=instance-type,Values={instance_type} --region REGION`")


def _check_home(home: str, cloud: str, pool_type: str) -> None:
    """--home is a region of the pool type's cloud: the latency is estimated between regions of that cloud."""
    try:
        carbon.region(cloud, home)
    except carbon.CarbonDataError as exc:
        other = next((c for c in ("aws", "gcp") if c != cloud and (c, home) in carbon.regions()), None)
        if other is None:
            raise ClientError(f"--home: {exc}") from None
        article = "an" if other == "aws" else "a"
        raise ClientError(f"--home {home!r} is {article} {other.upper()} region, and --pool-type {pool_type} runs on "
                          f"{cloud.upper()}: give the {cloud.upper()} region your users or data are nearest to") \
            from None


def regions(*, pool_type: str, allow: str = "", home: str = "", max_latency_ms: float | None = None,
            explain: bool = False, out=None) -> int:
    out = out or sys.stdout
    cloud = cloud_of(pool_type)
    try:
        allowed = carbon.allowed([t for t in allow.split(",") if t.strip()]) if allow else None
    except carbon.CarbonDataError as exc:
        raise ClientError(f"--allow: {exc}") from None
    if home:
        _check_home(home, cloud, pool_type)
    if max_latency_ms is not None and not max_latency_ms > 0:  # NaN too
        raise ClientError(f"--max-latency-ms {max_latency_ms:g} must be > 0 (the longest round trip from --home, in "
                          "milliseconds)")
    if max_latency_ms is not None and not home:
        raise ClientError("--max-latency-ms needs --home REGION (the latency is estimated from there)")
    ranking = advisor.rank(cloud, pool_type, allow=allowed, home=home, max_latency_ms=max_latency_ms)
    shape = catalog.shape(cloud, pool_type)
    out.write(f"{pool_type} ({shape.gpus} x {shape.gpu_type}) on {cloud}: regions by grid carbon intensity"
              + (f", allowed: {allow}" if allow else "") + "\n")
    rows = [("#", "REGION", "LOCATION", "COUNTRY", "gCO2e/kWh", "CFE%", "kgCO2e/node-h", "RTT ms", "OFFERED")]
    for i, row in enumerate(ranking.rows, 1):
        r = row.region
        rows.append((str(i), r.name, r.location, r.country, f"{r.intensity:.0f}",
                     "-" if r.cfe_percent is None else str(r.cfe_percent),
                     "-" if row.kg_per_node_hour is None else f"{row.kg_per_node_hour:.2f}",
                     "-" if row.latency_ms is None else f"~{row.latency_ms:.0f}",
                     "yes" if row.offered else "unknown"))
    if len(rows) == 1:
        out.write("no region is left within the limits (--explain says why each was left out)\n")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")
    offered = carbon.offered(cloud, pool_type)
    if offered is None:
        out.write(f"which of these regions offer {pool_type} is not in the shipped table: check with "
                  f"{offerings_check(pool_type)}\n")
    elif cloud == "aws":
        out.write(f"offered: from SkyPilot's AWS catalog, which lists only the regions SkyPilot has enabled; a region "
                  f"left out as not listed may still offer {pool_type}: check with {offerings_check(pool_type)}\n")
    if ranking.rows and ranking.rows[0].kg_per_node_hour is None:
        out.write(f"no kg CO2e per node-hour: no published power figure for {shape.gpu_type}\n")
    if explain and ranking.excluded:
        out.write("left out:\n")
        for name, why in sorted(ranking.excluded.items()):
            out.write(f"  {name}: {why}\n")
    out.write(f"sources: docs/carbon.md (grid intensity, CFE%, PUE {carbon.pue(cloud)}; latency is an estimate from "
              "coordinates)\n")
    return 0
