"""The shipped carbon tables, the job estimate (against a hand computation), the latency estimate and the region
ranking.

Run: .venv/bin/pytest tests/gpu_train/carbon/test_carbon.py -q
"""

from __future__ import annotations

import math

import pytest

from gpu_train import carbon
from gpu_train.carbon import advisor
from gpu_train.carbon.estimate import ASSUMED_MFU, co2e_kg, job_estimate, node_hour_kg
from gpu_train.spec import catalog
from gpu_train.spec.catalog.gpus import tdp_watts
from gpu_train.spec.job import read_job
from infra.aws.settings_checks import regions as aws_regions
from infra.gcp.settings_checks import REGIONS as GCP_REGIONS


def test_every_region_the_stack_settings_accept_has_a_row():
    table = carbon.regions()
    assert {name for cloud, name in table if cloud == "aws"} >= set(aws_regions())
    assert {name for cloud, name in table if cloud == "gcp"} >= set(GCP_REGIONS)


def test_every_row_names_a_source_with_vintage_and_licence_and_sane_values():
    for (cloud, name), r in carbon.regions().items():
        src = carbon.source(r.source)
        assert src["licence"] and src["year"] >= 2020 and src["url"].startswith("https://github.com/"), r.source
        assert 0 < r.intensity < 1000, name
        assert -90 <= r.latitude <= 90 and -180 <= r.longitude <= 180 and len(r.country) == 2
        # Google publishes CFE% for its own regions only.
        assert (r.cfe_percent is not None) == (cloud == "gcp"), name
    for cloud in ("aws", "gcp"):
        fact = carbon._meta()["pue"][cloud]  # the shipped carbon.json's entry
        assert 1.0 < fact["value"] < 1.3 and fact["year"] == 2024 and "https://" in fact["source"]


def test_availability_names_only_catalog_types_and_known_regions():
    rows = carbon._availability()
    for cloud in ("aws", "gcp"):
        for instance_type in catalog.known(cloud):
            offered = carbon.offered(cloud, instance_type)
            assert offered, (cloud, instance_type)
            assert offered <= {name for c, name in carbon.regions() if c == cloud}, (cloud, instance_type)
            # SkyPilot's AWS catalog is the commercial partition's: no GovCloud or China region.
            assert {carbon.partition(cloud, name) for name in offered} == {cloud}, (cloud, instance_type)
    assert set(rows) == {(c, t) for c in ("aws", "gcp") for t in catalog.known(c)}  # no stray rows
    assert carbon.offered("aws", "m5.large") is None  # a type without a row is unknown, never "nowhere"


def test_p5_regions_are_those_of_skypilots_aws_catalog():
    # skypilot-org/skypilot-catalog catalogs/v7/aws/vms.csv at commit 001367d22a0033fac286a8c71aeac7109e431bcb:
    # the p5.48xlarge block (one row per availability zone; the GpuInfo column is elided here as "{...}") has rows
    # in exactly these ten regions, for example
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",123.19496,40.097600,ap-northeast-1,apne1-az1
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",117.984,15.684700,ap-south-1,aps1-az1
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",127.816,13.148700,ap-southeast-2,apse2-az3
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",113.068,113.068000,ca-central-1,cac1-az4
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",105.2024,28.528000,eu-north-1,eun1-az3
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",127.816,43.014500,eu-west-2,euw2-az1
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",98.32,30.326000,us-east-1,use1-az1
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",98.32,14.377300,us-east-2,use2-az1
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",122.9,17.137100,us-west-1,usw1-az3
    #   p5.48xlarge,H100,8.0,192.0,2048.0,"{...}",98.32,33.239900,us-west-2,usw2-az1
    # and none in eu-central-1, eu-west-1, eu-west-3, eu-south-1 or any other region.
    p5 = carbon.offered("aws", "p5.48xlarge")
    assert "us-east-1" in p5 and "eu-north-1" in p5 and "eu-central-1" not in p5
    assert p5 == {"ap-northeast-1", "ap-south-1", "ap-southeast-2", "ca-central-1", "eu-north-1", "eu-west-2",
                  "us-east-1", "us-east-2", "us-west-1", "us-west-2"}
    # The two p4de.24xlarge regions of the same file:
    #   p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{...}",40.96575,,us-east-1,use1-az1
    #   p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{...}",40.96575,,us-west-2,usw2-az1
    assert carbon.offered("aws", "p4de.24xlarge") == {"us-east-1", "us-west-2"}


def test_every_nvidia_gpu_of_the_catalogs_has_a_power_and_a_peak():
    from gpu_train.sizing.flops import gpu_peak_flops

    for cloud in ("aws", "gcp"):
        for instance_type in catalog.known(cloud):
            shape = catalog.shape(cloud, instance_type)
            if shape.accelerator == "nvidia":
                assert tdp_watts(shape.gpu_type) and gpu_peak_flops(shape.gpu_type), instance_type
    assert tdp_watts("Trainium") is None


def test_allow_reads_countries_groups_and_region_names():
    eu = carbon.allowed(["EU"])
    assert ("gcp", "europe-west4") in eu and ("aws", "eu-north-1") in eu
    assert ("aws", "eu-west-2") not in eu and ("gcp", "europe-west6") not in eu  # GB and CH are not in the EU
    assert carbon.allowed(["CH"]) == {("aws", "eu-central-2"), ("gcp", "europe-west6")}
    assert carbon.allowed(["us-east-1"]) == {("aws", "us-east-1")}
    with pytest.raises(carbon.CarbonDataError, match="'XX' is neither"):
        carbon.allowed(["XX"])


def test_the_estimate_matches_a_hand_computation():
    job = read_job({"name": "gpt2", "team": "research", "pool": "h100", "preset": "gpt2-124m", "nodes": "1:2",
                    "steps": 100000, "globalBatchTokens": 524288})
    est = job_estimate(job, cloud="aws", region="us-east-1", instance_type="p5.48xlarge")
    # gpt2-124m: L=12, d=768, H=12, Q=64, T=1024, vocab 50304, mlp_ratio 4.
    # matmul weights = 12 x (4 x 768^2 + 2 x 4 x 768^2) = 12 x 12 x 589,824 = 84,934,656
    # lm_head = 50,304 x 768 = 38,633,472; N = 123,568,128; 6N = 741,408,768
    # attention = 12 x 12 x 12 x 64 x 1024 = 113,246,208  ->  854,654,976 FLOPs per token
    # FLOPs = 100,000 steps x 524,288 tokens x 854,654,976 = 4.48085348057088e22
    # GPUs = MAX 2 nodes x 8 = 16; hours = 4.48085348057088e22 / (16 x 989.4e12 x 0.4) / 3600 = 1.965650776955731
    # GPU energy = 16 x 700 W x 1.965650776955731 h = 22.015288701904187 kWh
    # x PUE 1.15 (AWS 2024) = 25.317582007189815 kWh; x 379.069 g/kWh (us-east-1) = 9.597110493883436 kg CO2e
    assert ASSUMED_MFU == 0.4
    assert est.gpus == 16 and est.watts_per_gpu == 700 and est.pue == 1.15 and est.intensity == 379.069
    assert est.hours == pytest.approx(1.965650776955731, rel=1e-12)
    assert est.energy_kwh == pytest.approx(25.317582007189815, rel=1e-12)
    assert est.kg_co2e == pytest.approx(9.597110493883436, rel=1e-12)
    assert est.line().startswith("carbon: ~25.3 kWh, ~9.6 kg CO2e in us-east-1 (379 gCO2e/kWh, PUE 1.15;")
    # The same run on half the GPUs takes twice as long and emits the same.
    half = job_estimate(job.model_copy(update={"nodes": read_job({"name": "a", "team": "b", "pool": "c",
                                                                 "nodes": "1:1"}).nodes}),
                        cloud="aws", region="us-east-1", instance_type="p5.48xlarge")
    assert half.hours == pytest.approx(2 * est.hours) and half.kg_co2e == pytest.approx(est.kg_co2e)


def test_no_estimate_says_why():
    job = read_job({"name": "t", "team": "research", "pool": "trn", "preset": "tiny"})
    assert "no published power or peak figure for Trainium" in job_estimate(
        job, cloud="aws", region="us-east-1", instance_type="trn1.32xlarge").line()
    assert "not in the shipped carbon table" in job_estimate(
        job, cloud="aws", region="mars-1", instance_type="p5.48xlarge").line()


def test_node_hour_and_measured_conversion_by_hand():
    # a3-megagpu-8g in europe-west4: 8 x 700 W = 5.6 kW x PUE 1.09 = 6.104 kW x 208.81 g/kWh = 1.27457624 kg per hour
    assert node_hour_kg("gcp", "europe-west4", "a3-megagpu-8g") == pytest.approx(1.27457624)
    # 10 kWh measured at the GPUs in eu-north-1: x 1.15 x 8.8 g/kWh = 0.1012 kg
    assert co2e_kg(energy_kwh=10.0, cloud="aws", region="eu-north-1") == pytest.approx(0.1012)


def test_latency_estimate_by_hand():
    paris, london = carbon.region("gcp", "europe-west9"), carbon.region("gcp", "europe-west2")
    # Haversine between (48.86, 2.35) and (51.51, -0.13): 343.9 km (the well-known Paris-London distance is ~344
    # km); RTT = 2 x 343.9 x 1.5 / 200 = 5.16 ms.
    assert advisor.distance_km(paris, london) == pytest.approx(343.9, abs=1.0)
    assert advisor.rtt_ms(paris, london) == pytest.approx(2 * advisor.distance_km(paris, london) * 1.5 / 200)
    assert advisor.rtt_ms(paris, paris) == 0


def test_ranking_within_eu_for_a3_mega():
    ranking = advisor.rank("gcp", "a3-megagpu-8g", allow=carbon.allowed(["EU"]), home="europe-west3",
                           max_latency_ms=20)
    names = [row.region.name for row in ranking.rows]
    # EU regions that offer a3-megagpu-8g (availability.csv): europe-north1 (FI) 39.32, europe-west1 (BE) 103.37,
    # europe-west4 (NL) 208.81, europe-west3 (DE) 275.82. Hamina is ~1,500 km from Frankfurt: 2 x 1,500 x 1.5 /
    # 200 = ~23 ms, above 20 ms.
    assert names == ["europe-west1", "europe-west4", "europe-west3"]
    assert "above --max-latency-ms 20" in ranking.excluded["europe-north1"]
    assert ranking.excluded["europe-west9"] == "a3-megagpu-8g is not listed there (availability.csv)"
    assert ranking.excluded["us-central1"].startswith("not allowed (US")
    assert all(row.offered for row in ranking.rows)


def test_aws_ranking_keeps_only_the_listed_regions():
    ranking = advisor.rank("aws", "p5.48xlarge", allow=carbon.allowed(["EU"]))
    # p5.48xlarge's European regions in the catalog are eu-north-1 (SE) and eu-west-2 (GB, not in the EU).
    assert [(row.region.name, row.offered) for row in ranking.rows] == [("eu-north-1", True)]
    assert ranking.excluded["eu-west-3"] == "p5.48xlarge is not listed there (availability.csv)"
    assert ranking.excluded["eu-west-2"] == "not allowed (GB, London)"
    # eu-central-1 311 g/kWh vs eu-north-1 8.8: the greener region offering p5 is named, with no "unknown" caveat.
    assert advisor.greener_text("aws", "eu-central-1", "p5.48xlarge", allow=carbon.allowed(["EU"])) == \
        "greener regions for p5.48xlarge: eu-north-1 9 gCO2e/kWh"


def test_a_type_without_a_row_is_ranked_as_unknown(monkeypatch):
    table = {k: v for k, v in carbon._availability().items() if k != ("aws", "p5.48xlarge")}
    monkeypatch.setattr(carbon, "_availability", lambda: table)
    ranking = advisor.rank("aws", "p5.48xlarge", allow=carbon.allowed(["EU"]))
    assert [r.region.name for r in ranking.rows][:2] == ["eu-north-1", "eu-west-3"]  # 8.8, 51.1 g/kWh
    assert all(row.offered is None for row in ranking.rows)
    assert "(which of them offer p5.48xlarge is not in the shipped table)" in advisor.greener_text(
        "aws", "eu-central-1", "p5.48xlarge", allow=carbon.allowed(["EU"]))


def test_advisory_fires_above_twice_the_best_allowed_region():
    # us-east1 576 g/kWh vs us-west1 79 g/kWh (both in the US, both offer a3-megagpu-8g): 7.3x.
    line = advisor.advisory("gcp", "us-east1", ["a3-megagpu-8g"], allow=None)
    assert line is not None and "7.3x" in line and "us-west1" in line
    # In the EU (the default area of an EU region): europe-west1 103 g/kWh > 2 x europe-north1 39 g/kWh.
    assert advisor.advisory("gcp", "europe-west1", ["a3-megagpu-8g"], allow=None) is not None
    assert advisor.advisory("gcp", "europe-north1", ["a3-megagpu-8g"], allow=None) is None  # the best itself
    # Allowed regions that do not offer the type do not count: only Belgium allowed -> nothing to compare with.
    assert advisor.advisory("gcp", "europe-west1", ["a3-megagpu-8g"], allow=carbon.allowed(["BE"])) is None
    assert math.isclose(advisor.ADVISORY_RATIO, 2.0)


def test_submits_memory_and_carbon_lines_each_name_their_world_size():
    """nodes 1:2 on one-GPU nodes: the memory a GPU needs is largest at MIN (1 GPU), the run is estimated at MAX (2
    GPUs, the JobSet Kueue admits whole); each line says which, in the same words."""
    from gpu_train.sizing.job import memory_line

    job = read_job({"name": "gpt2", "team": "research", "pool": "l4", "preset": "gpt2-124m", "nodes": "1:2",
                    "steps": 1000, "globalBatchTokens": 524288})
    est = job_estimate(job, cloud="aws", region="us-east-1", instance_type="g6.2xlarge")  # 1 x L4, 72 W
    memory = memory_line(job, gpus=1, gpu_type="L4")
    assert est.gpus == 2 and "; 2 GPUs x 72 W TDP x " in est.line()
    assert est.line().endswith(", at world size 2 (MAX 2 nodes x 1 GPU), which Kueue admits whole)")
    assert memory.endswith(" at world size 1 (MIN 1 node x 1 GPU), where a GPU holds the most")
    assert "1 GPUs" not in memory + est.line()
