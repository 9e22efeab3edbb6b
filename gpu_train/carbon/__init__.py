"""The carbon facts of every region the stack settings accept: grid intensity, carbon-free energy share,
country, coordinates, which GPU machine types each offers, and each cloud's fleet PUE; read from the data files
shipped beside this module.

Usage:
    from gpu_train import carbon
    r = carbon.region("gcp", "europe-west4")      # Region(intensity=208.81 gCO2e/kWh, cfe_percent=83, ...)
    carbon.pue("aws")                             # 1.15
    carbon.offered("aws", "p5.48xlarge")          # frozenset of regions, or None for a type the table lacks
    carbon.allowed(["EU", "CH", "us-east-1"])     # the regions those countries, groups and names allow
    carbon.settings_problems(["EU", "Mars"])      # a stack's carbon.allowedRegions checked: one line per bad entry

Data (source, vintage and licence in each file's header and in docs/carbon.md): regions.csv (one row per cloud
and region), availability.csv (the GPU machine types of both catalogs by region, from SkyPilot's catalogs),
carbon.json (PUE, sources, groups such as EU). Beside the tables: a job's estimate (estimate.py) and the region
ranking (advisor.py).
Hand-written: the files are small and fixed, so the standard library's csv and json read them; a region that is
not in the table is an error naming it, never a silent default.
"""

from __future__ import annotations

import csv
import functools
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpu_train.spec.naming import PROJECT

HERE = Path(__file__).resolve().parent


class CarbonDataError(ValueError):
    """A region, group or machine type the shipped tables do not know; the message names it."""


@dataclass(frozen=True, kw_only=True)
class Region:
    cloud: str
    name: str
    location: str
    country: str  # ISO 3166-1 alpha-2
    latitude: float
    longitude: float
    intensity: float  # grid carbon intensity, gCO2e per kWh
    cfe_percent: int | None  # Google's carbon-free energy share (GCP only)
    source: str  # id into carbon.json "sources"


def _rows(name: str) -> list[dict[str, str]]:
    text = (HERE / name).read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return list(csv.DictReader(io.StringIO(body)))


@functools.cache
def _meta() -> dict:
    return json.loads((HERE / "carbon.json").read_text())


@functools.cache
def regions() -> dict[tuple[str, str], Region]:
    """Every region of both clouds, by (cloud, region name)."""
    out = {}
    for row in _rows("regions.csv"):
        out[(row["cloud"], row["region"])] = Region(
            cloud=row["cloud"], name=row["region"], location=row["location"], country=row["country"],
            latitude=float(row["latitude"]), longitude=float(row["longitude"]),
            intensity=float(row["grid_gco2e_per_kwh"]), source=row["source"],
            cfe_percent=int(row["cfe_percent"]) if row["cfe_percent"] else None)
    return out


def region(cloud: str, name: str) -> Region:
    try:
        return regions()[(cloud, name)]
    except KeyError:
        raise CarbonDataError(f"region {name!r} of cloud {cloud!r} is not in the shipped carbon table "
                              f"(gpu_train/carbon/regions.csv)") from None


def pue(cloud: str) -> float:
    """The cloud's published fleet PUE (carbon.json, with its year and source)."""
    return float(_meta()["pue"][cloud]["value"])


def source(source_id: str) -> dict:
    return dict(_meta()["sources"][source_id])


def groups() -> dict[str, frozenset[str]]:
    """Named groups of countries (EU, EEA), by name."""
    return {name: frozenset(countries) for name, countries in _meta()["groups"].items()}


@functools.cache
def _availability() -> dict[tuple[str, str], frozenset[str]]:
    return {(row["cloud"], row["instance_type"]): frozenset(row["regions"].split())
            for row in _rows("availability.csv")}


def offered(cloud: str, instance_type: str) -> frozenset[str] | None:
    """The regions that offer a machine type, or None for a type the shipped table has no row for (unknown, never
    "nowhere"). AWS rows list only the regions SkyPilot's catalog covers: a region outside one may still offer it."""
    return _availability().get((cloud, instance_type))


def allowed(tokens: Iterable[str]) -> frozenset[tuple[str, str]]:
    """The (cloud, region) pairs a list of countries (ISO codes), groups (EU, EEA) and region names allows;
    an unknown token is an error naming it."""
    table, named = regions(), groups()
    countries = {r.country for r in table.values()}
    out: set[tuple[str, str]] = set()
    for raw in tokens:
        token = raw.strip()
        if token.upper() in named:
            out |= {k for k, r in table.items() if r.country in named[token.upper()]}
        elif token.upper() in countries and len(token) == 2:
            out |= {k for k, r in table.items() if r.country == token.upper()}
        elif any(name == token for _, name in table):
            out |= {k for k in table if k[1] == token}
        else:
            raise CarbonDataError(f"{token!r} is neither a country code of the region table, a group "
                                  f"({', '.join(sorted(named))}) nor a region name")
    return frozenset(out)


# The group a stack's region is compared within when carbon.allowedRegions is empty: a region in an EU country is
# compared with every EU region (one market, one data-protection regime), any other with its own country's.
DEFAULT_GROUP = "EU"


def partition(cloud: str, name: str) -> str:
    """AWS's partitions (aws, aws-cn, aws-us-gov) are separate clouds with separate accounts; GCP has one."""
    if cloud != "aws":
        return cloud
    return "aws-us-gov" if name.startswith("us-gov-") else "aws-cn" if name.startswith("cn-") else "aws"


def same_area(cloud: str, name: str) -> frozenset[tuple[str, str]]:
    """The regions of the same partition in the same country as this one, or in the EU when it is in an EU country:
    the default set a stack's advisory compares its region with."""
    home = region(cloud, name)
    eu = groups()[DEFAULT_GROUP]
    area = eu if home.country in eu else frozenset({home.country})
    return frozenset(k for k, r in regions().items()
                     if r.country in area and partition(*k) == partition(cloud, name))


def settings_problems(allowed_regions: Iterable[str]) -> list[str]:
    """A stack's carbon.allowedRegions: each entry a country code, group or region name of the table."""
    p = []
    for i, token in enumerate(allowed_regions):
        try:
            allowed([token])
        except CarbonDataError as exc:
            p.append(f"{PROJECT}:carbon.allowedRegions[{i}]: {exc}")
    return p
