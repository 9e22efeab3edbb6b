"""CIDR-set normalisation: any set of ranges that covers every public address counts as open.

Usage: `.venv/bin/pytest tests/policies/test_cidrs.py -q` (pure functions; the reference sets are built
with the standard library's `address_exclude`, independently of the interval code under test).
"""

from __future__ import annotations

import ipaddress

import pytest

from gpu_train.spec import placement
from policies.cidrs import blocks_coverage, internet_coverage

V4 = "every public IPv4 address"
V6 = "every public IPv6 address"
# RFC 1918, CGNAT, loopback, link-local, multicast and reserved: not public.
NOT_PUBLIC = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8",
              "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4"]


def everything_but(*holes: str) -> list[str]:
    """0.0.0.0/0 minus the holes, as CIDRs computed by ipaddress.address_exclude."""
    nets = [ipaddress.ip_network("0.0.0.0/0")]
    for hole in map(ipaddress.ip_network, holes):
        nxt = []
        for net in nets:
            nxt += list(net.address_exclude(hole)) if hole.subnet_of(net) else [net]
        nets = nxt
    return [str(n) for n in nets]


@pytest.mark.parametrize(("cidrs", "expected"), [
    (["0.0.0.0/0"], V4),
    (["::/0"], V6),
    (["0::/0"], V6),
    (["0000:0000::/0"], V6),
    (["0.0.0.0/1", "128.0.0.0/1"], V4),
    (["1.2.3.4/0"], V4),  # host bits are ignored, as AWS and GCP normalise them
    ([f"{i}.0.0.0/8" for i in range(256)], V4),
    ([f"{i}.0.0.0/8" for i in range(256) if i != 8], None),  # 8.0.0.0/8 is public
    (everything_but(*NOT_PUBLIC), V4),  # "everything except the private ranges" is still the internet
    (everything_but("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"), V4),
    (everything_but("8.8.8.0/24"), None),
    (everything_but("203.0.113.7/32", "1.1.1.1/32"), None),
    (["2000::/3"], V6),
    (["2000::/4", "3000::/4"], V6),
    (["2000::/4"], None),
    (["2001:db8::/32"], None),
    (["0.0.0.0/0", "::/0"], f"{V4} and {V6}"),
    (["10.0.0.0/8", "203.0.113.0/24"], None),
    (["sg-0123", "pl-abc", "", None, "not/a/cidr"], None),
])
def test_internet_coverage(cidrs, expected):
    assert internet_coverage(cidrs) == expected


def test_exclusions_apply_to_their_own_block_only():
    assert blocks_coverage([("0.0.0.0/0", ["10.0.0.0/8"])]) == V4  # excepting a private range changes nothing
    assert blocks_coverage([("0.0.0.0/0", ["8.0.0.0/8"])]) is None
    assert blocks_coverage([("0.0.0.0/0", ["8.0.0.0/8"]), ("8.0.0.0/8", [])]) == V4
    assert internet_coverage(["0.0.0.0/0"], exclude=["0.0.0.0/1"]) is None


@pytest.mark.parametrize("cidr", [*placement.PRIVATE_RANGES, "172.20.0.0/16", "100.64.0.0/16", "8.8.0.0/16",
                                  "172.32.0.0/16", "192.169.0.0/16", "100.128.0.0/16"])
def test_the_plans_private_ranges_are_what_the_pack_counts_as_not_public(cidr):
    """The plan refuses a network outside the private ranges (gpu_train.spec.placement); the pack counts exactly
    those, among others, as not public: the internet minus a private block is still the whole internet to it."""
    private = placement.private_range(cidr) is not None
    assert (internet_coverage(everything_but(cidr)) == V4) is private
