"""CIDR sets normalised: does a set of ranges, however written, reach the whole public internet?

Usage:
    from policies.cidrs import internet_coverage
    internet_coverage(["0.0.0.0/1", "128.0.0.0/1"])   # -> "every public IPv4 address"
    internet_coverage(["10.0.0.0/8"])                  # -> None
    internet_coverage(["0.0.0.0/0"], exclude=["0.0.0.0/1"])  # NetworkPolicy ipBlock.except -> None

A set counts as open when its union covers every *public* address of IPv4 or IPv6, so `0.0.0.0/0`,
`0::/0`, `0.0.0.0/1` + `128.0.0.0/1`, 256 `/8`s, or "everything except RFC 1918" are all open, while
any set that leaves out a public range is not. Public means globally reachable unicast:
- IPv4: all of 0.0.0.0/0 except the ranges the IANA IPv4 Special-Purpose Address Registry marks as not
  globally reachable, and multicast
  (https://www.iana.org/assignments/iana-ipv4-special-registry/iana-ipv4-special-registry.xhtml,
  https://www.iana.org/assignments/multicast-addresses/multicast-addresses.xhtml);
- IPv6: the global unicast space 2000::/3 except the documentation prefix 2001:db8::/32
  (https://www.iana.org/assignments/ipv6-address-space/ipv6-address-space.xhtml, RFC 3849).

The standard library's `ipaddress` parses and normalises the ranges (`0::/0`, host bits, leading
zeros); it exposes "is this address global" only per address, not as a list of ranges, so the
special-purpose ranges are listed here and the coverage is computed as integer intervals.
Strings that are not CIDRs (unknown values under `pulumi preview`, prefix-list ids) are ignored.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from gpu_train.spec.placement import PRIVATE_RANGES

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# IANA IPv4 special-purpose ranges that are not globally reachable: the private ranges a stack's networks must lie
# in (gpu_train/spec/placement.py, which the plan's settings checks use too) and the others, plus multicast
# (224.0.0.0/4), which is never a unicast source. 255.255.255.255/32 lies inside 240.0.0.0/4.
_NOT_PUBLIC_V4 = (
    *PRIVATE_RANGES, "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16",
    "192.0.0.0/24", "192.0.2.0/24", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
)
_GLOBAL_V6 = "2000::/3"
_NOT_PUBLIC_V6 = ("2001:db8::/32",)

Interval = tuple[int, int]  # inclusive [first, last] address as integers


def parse(value: object) -> Network | None:
    """A normalised network from a CIDR string (host bits allowed), or None when it is not one."""
    if not isinstance(value, str) or "/" not in value:
        return None
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        return None


def _interval(net: Network) -> Interval:
    return int(net.network_address), int(net.broadcast_address)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping, non-adjacent intervals with the same union."""
    out: list[Interval] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def subtract(intervals: list[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """`intervals` minus `holes` (both as inclusive integer intervals)."""
    result = merge(intervals)
    for h_lo, h_hi in merge(holes):
        nxt: list[Interval] = []
        for lo, hi in result:
            if h_hi < lo or h_lo > hi:
                nxt.append((lo, hi))
                continue
            if lo < h_lo:
                nxt.append((lo, h_lo - 1))
            if hi > h_hi:
                nxt.append((h_hi + 1, hi))
        result = nxt
    return result


def _public(version: int) -> list[Interval]:
    if version == 4:
        return subtract([(0, 2**32 - 1)], [_interval(ipaddress.ip_network(n)) for n in _NOT_PUBLIC_V4])
    return subtract([_interval(ipaddress.ip_network(_GLOBAL_V6))],
                    [_interval(ipaddress.ip_network(n)) for n in _NOT_PUBLIC_V6])


PUBLIC: dict[int, list[Interval]] = {4: _public(4), 6: _public(6)}


def covers(intervals: list[Interval], targets: list[Interval]) -> bool:
    """Whether the union of `intervals` contains every target interval."""
    return not subtract(targets, intervals)


def blocks_coverage(blocks: Iterable[tuple[object, Iterable[object]]]) -> str | None:
    """Which public space the union of several (cidr, excepted cidrs) blocks covers entirely, or None.

    Returns "every public IPv4 address", "every public IPv6 address" or both joined with "and".
    Each block's exceptions apply to that block only (as in a NetworkPolicy ipBlock).
    """
    have: dict[int, list[Interval]] = {4: [], 6: []}
    for cidr, excepted in blocks:
        net = parse(cidr)
        if net is None:
            continue
        holes = [_interval(h) for h in (parse(e) for e in excepted) if h is not None and h.version == net.version]
        have[net.version] += subtract([_interval(net)], holes)
    found = [f"every public IPv{v} address" for v in (4, 6) if have[v] and covers(have[v], PUBLIC[v])]
    return " and ".join(found) or None


def internet_coverage(cidrs: Iterable[object], exclude: Iterable[object] = ()) -> str | None:
    """Which public space the union of `cidrs` minus `exclude` covers entirely, or None."""
    excluded = list(exclude)
    return blocks_coverage((c, excluded) for c in cidrs)
