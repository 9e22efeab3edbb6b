"""`gpu-train regions`: an AWS type ranks only the allowed regions SkyPilot's catalog lists for it, says where that
list comes from and how to check a region it leaves out; a type without a row is ranked with availability unknown.

Run: .venv/bin/pytest tests/gpu_train/cli/test_regions.py -q
"""

from __future__ import annotations

import pytest

from gpu_train import carbon

CHECK = "aws ec2 describe-instance-type-offerings --location-type region --filters Name=instance-type,Values="


def ranked(out: str) -> list[list[str]]:
    """The table's data rows (after the header line that starts with '#'), split into columns."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  REGION"))
    return [line.split() for line in lines[start + 1:] if line[:1].isdigit()]


def test_p5_within_the_eu_ranks_only_the_eu_region_that_offers_it(cli):
    # catalogs/v7/aws/vms.csv at commit 001367d2 (skypilot-org/skypilot-catalog) lists p5.48xlarge in two European
    # regions (GpuInfo elided as "{...}"):
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",105.2024,28.528000,eu-north-1,eun1-az3
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",127.816,43.014500,eu-west-2,euw2-az1
    # eu-north-1 is Stockholm (SE, in the EU); eu-west-2 is London (GB, not in the EU). So one row.
    code, out, _ = cli("regions", "--pool-type", "p5.48xlarge", "--allow", "EU", "--explain")
    assert code == 0
    assert [(row[1], row[3], row[-1]) for row in ranked(out)] == [("eu-north-1", "SE", "yes")]
    assert "  eu-central-1: p5.48xlarge is not listed there (availability.csv)" in out
    assert "  eu-west-2: not allowed (GB, London)" in out
    assert "a region left out as not listed may still offer p5.48xlarge" in out and CHECK + "p5.48xlarge" in out
    assert "is not in the shipped table" not in out


def test_g6_within_the_eu_is_ranked_by_grid_intensity(cli):
    # The same file lists g6.xlarge in four European regions and no other (for example):
    #   g6.xlarge,L4,1.0,4.0,16.0,"{...}",1.0064,0.360300,eu-central-1,euc1-az2
    #   g6.xlarge,L4,1.0,4.0,16.0,"{...}",0.8536,0.296900,eu-north-1,eun1-az1
    #   g6.xlarge,L4,1.0,4.0,16.0,"{...}",1.0216,0.362600,eu-west-2,euw2-az2
    #   g6.xlarge,L4,1.0,4.0,16.0,"{...}",1.0216,0.436600,eu-west-3,euw3-az2
    # Without GB (eu-west-2), by grid intensity (regions.csv, ccf-aws): eu-north-1 8.8, eu-west-3 51.1,
    # eu-central-1 311.0 g/kWh.
    code, out, _ = cli("regions", "--pool-type", "g6.xlarge", "--allow", "EU")
    assert code == 0
    assert [(row[1], row[4]) for row in ranked(out)] == [("eu-north-1", "9"), ("eu-west-3", "51"),
                                                         ("eu-central-1", "311")]


def test_a_type_without_a_row_is_shown_as_unknown(cli, monkeypatch):
    table = {k: v for k, v in carbon._availability().items() if k != ("aws", "p5.48xlarge")}
    monkeypatch.setattr(carbon, "_availability", lambda: table)
    code, out, _ = cli("regions", "--pool-type", "p5.48xlarge", "--allow", "EU")
    rows = ranked(out)
    assert code == 0
    assert [row[1] for row in rows][:3] == ["eu-north-1", "eu-west-3", "eu-south-2"]  # 8.8, 51.1, 89.04 g/kWh
    assert {row[-1] for row in rows} == {"unknown"}
    assert f"which of these regions offer p5.48xlarge is not in the shipped table: check with `{CHECK}" in out


def test_a_home_region_of_the_other_cloud_is_named_as_such(cli):
    aws, gcp = (next(name for cloud, name in carbon.regions() if cloud == c) for c in ("aws", "gcp"))
    code, out, err = cli("regions", "--pool-type", "p5.48xlarge", "--home", gcp)
    assert code == 2 and out == ""
    assert err.strip() == (f"gpu-train: error: --home {gcp!r} is a GCP region, and --pool-type p5.48xlarge runs on "
                           "AWS: give the AWS region your users or data are nearest to")
    code, _, err = cli("regions", "--pool-type", "a3-megagpu-8g", "--home", aws)
    assert code == 2 and f"--home {aws!r} is an AWS region, and --pool-type a3-megagpu-8g runs on GCP" in err
    code, _, err = cli("regions", "--pool-type", "p5.48xlarge", "--home", "mars-north-1")
    assert code == 2 and "--home: region 'mars-north-1' of cloud 'aws' is not in the shipped carbon table" in err


@pytest.mark.parametrize("limit", ["-5", "0", "nan"])
def test_a_latency_limit_must_be_positive(cli, limit):
    code, out, err = cli("regions", "--pool-type", "p5.48xlarge", "--home", "eu-west-1", "--max-latency-ms", limit)
    assert code == 2 and out == ""
    assert err.strip() == (f"gpu-train: error: --max-latency-ms {float(limit):g} must be > 0 (the longest round trip "
                           "from --home, in milliseconds)")
