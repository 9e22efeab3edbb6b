"""Stack settings: the four stacks load, and every kind of bad value fails with its full key."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from infra import config

ROOT = Path(__file__).resolve().parents[2]


def raw_stack(name: str) -> dict:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{name}.yaml").read_text())["config"]


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod", "gcp-dev", "gcp-prod"])
def test_every_stack_file_loads(stack):
    cfg = config.parse(raw_stack(stack), stack)
    assert cfg.stack == stack
    assert cfg.cloud == stack.split("-")[0]
    assert cfg.environment == stack.split("-")[1]
    assert cfg.job is not None and cfg.job.pool in {p.name for p in cfg.gpu_pools}


def test_dev_stacks_are_small_spot_and_scale_to_zero():
    for stack in ("aws-dev", "gcp-dev"):
        cfg = config.parse(raw_stack(stack), stack)
        for pool in cfg.gpu_pools:
            assert pool.capacity == "spot" and pool.min_nodes == 0 and not pool.fabric
            assert any(g in pool.instance_type for g in ("g6", "g2")), pool.instance_type


def test_prod_stacks_use_fabric_h100_with_reserved_and_spot_pools():
    expected = {"aws-prod": "p5.48xlarge", "gcp-prod": "a3-megagpu-8g"}
    for stack, machine in expected.items():
        cfg = config.parse(raw_stack(stack), stack)
        assert {p.instance_type for p in cfg.gpu_pools} == {machine}
        assert all(p.fabric and p.zone for p in cfg.gpu_pools)
        assert {p.capacity for p in cfg.gpu_pools} >= {"spot"}
        assert {p.capacity for p in cfg.gpu_pools} & {"reservation", "capacity-block", "on-demand"}


def test_structured_values_as_json_strings_like_the_engine_passes_them():
    raw = raw_stack("aws-dev")
    engine_style = {k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}
    assert isinstance(engine_style["gpu-train:gpuPools"], str)
    cfg = config.parse(engine_style, "aws-dev")
    assert cfg.gpu_pools[0].name == "l4-spot"
    assert cfg.gpu_pools[1].instance_type == "g6e.xlarge"


def test_settings_of_other_namespaces_are_ignored():
    raw = raw_stack("aws-dev") | {"aws:region": "eu-west-1", "pulumi:template": "x"}
    assert config.parse(raw, "aws-dev").region == "us-east-1"


def _set(path: str, value):
    """A mutation: set a value at `top.key[0].sub` in the raw settings (None deletes it)."""

    def mutate(raw: dict) -> None:
        top, *rest = path.split(".")
        node, key = raw, f"gpu-train:{top}"
        tokens: list = [key]
        for part in rest:
            if "[" in part:
                name, idx = part[:-1].split("[")
                if name:
                    tokens.append(name)
                tokens.append(int(idx))
            else:
                tokens.append(part)
        if "[" in top:
            name, idx = top[:-1].split("[")
            tokens = [f"gpu-train:{name}", int(idx), *tokens[1:]]
        for t, nxt in zip(tokens[:-1], tokens[1:], strict=True):
            if isinstance(node, dict) and t not in node:
                node[t] = [] if isinstance(nxt, int) else {}
            node = node[t]
        if value is None:
            del node[tokens[-1]]
        else:
            node[tokens[-1]] = value

    return mutate


# (stack, mutation, text that must appear in the error: always the full key)
BAD = [
    ("aws-dev", _set("cloud", "azure"), "gpu-train:cloud must be one of 'aws' | 'gcp' (got 'azure')"),
    ("aws-dev", _set("region", None), "gpu-train:region is required"),
    ("aws-dev", _set("gpuPools[0].maxNode", 3), "gpu-train:gpuPools[0].maxNode is not a known setting"),
    ("aws-dev", _set("gpuPools[0].maxNodes", "four"), "gpu-train:gpuPools[0].maxNodes must be a whole number"),
    ("aws-prod", _set("gpuPools[1].minNodes", 5), "gpu-train:gpuPools[1].maxNodes must be >= minNodes (got 4 < 5)"),
    ("aws-dev", _set("gpuPools[0].minNodes", 1), "gpu-train:gpuPools[0].minNodes must be 0 in a dev stack"),
    ("aws-dev", _set("gpuPools[0].instanceType", "p9.mega"), "gpu-train:gpuPools[0].instanceType 'p9.mega'"),
    ("aws-dev", _set("gpuPools[0].capacity", "preemptible"), "gpu-train:gpuPools[0].capacity must be one of"),
    ("aws-prod", _set("gpuPools[0].reservationId", None), "gpu-train:gpuPools[0].reservationId is required"),
    ("aws-prod", _set("gpuPools[0].zone", None), "gpu-train:gpuPools[0].zone is required when fabric is true"),
    ("aws-dev", _set("gpuPools[0].fabric", True), "gpu-train:gpuPools[0].zone is required"),
    ("aws-dev", _set("gpuPools[1].name", "l4-spot"), "gpu-train:gpuPools[1].name 'l4-spot' is used by another pool"),
    ("aws-dev", _set("gpuPools[0].name", "L4_Spot"), "gpu-train:gpuPools[0].name 'L4_Spot' must be a lowercase"),
    ("aws-dev", _set("network.vpcCidr", "10.0.0.0/33"), "gpu-train:network.vpcCidr must be an IPv4 CIDR block"),
    ("aws-dev", _set("network.podCidr", "10.10.0.0/16"), "gpu-train:network.podCidr 10.10.0.0/16 overlaps"),
    ("aws-prod", _set("network.nat", "single"), "gpu-train:network.nat must be 'per-zone' in a prod stack"),
    ("aws-dev", _set("cluster.kubernetesVersion", "1.19"), "gpu-train:cluster.kubernetesVersion must be"),
    ("aws-dev", _set("cluster.endpointPublicAccess", True), "gpu-train:cluster.publicAccessCidrs must list"),
    ("aws-prod", _set("cluster.publicAccessCidrs", ["0.0.0.0/0"]),
     "gpu-train:cluster.publicAccessCidrs[0] must not be 0.0.0.0/0"),
    ("aws-dev", _set("zones", ["eu-west-1a"]), "gpu-train:zones[0] 'eu-west-1a' is not in region 'us-east-1'"),
    ("gcp-dev", _set("project", None), "gpu-train:project is required when cloud is gcp"),
    ("gcp-dev", _set("gpuPools[0].capacity", "capacity-block"), "gpu-train:gpuPools[0].capacity 'capacity-block'"),
    ("gcp-prod", _set("cluster.masterCidr", "172.16.0.0/24"), "gpu-train:cluster.masterCidr must be a /28"),
    ("aws-dev", _set("teams[0].gpuQuota", -1), "gpu-train:teams[0].gpuQuota must be >= 0"),
    ("aws-dev", _set("job.team", "nobody"), "gpu-train:job.team 'nobody' is not one of teams[].name"),
    ("aws-dev", _set("job.pool", "h100"), "gpu-train:job.pool 'h100' is not one of gpuPools[].name"),
    ("aws-dev", _set("job.nodes", "4"), "gpu-train:job.nodes must be MIN:MAX"),
    ("aws-dev", _set("job.nodes", "1:9"), "gpu-train:job.nodes MAX 9 is more than pool 'l4-spot' maxNodes 4"),
    ("aws-dev", _set("job.gpusPerNode", 8), "gpu-train:job.gpusPerNode 8 is more than g6.xlarge has (1)"),
    ("aws-dev", _set("job.datasetUri", "gs://bucket/x"), "gpu-train:job.datasetUri must start with s3://"),
    ("aws-dev", _set("job.suspend", "yes"), "gpu-train:job.suspend must be true or false"),
    ("aws-dev", _set("image.prebuilt", "trainer:latest"), "gpu-train:image.prebuilt must be pinned by digest"),
    ("aws-dev", _set("monitoring.retention", "two weeks"), "gpu-train:monitoring.retention must be a Prometheus"),
    ("aws-prod", _set("cache.masters", 1), "gpu-train:cache.masters must be 3 or 5 in a prod stack"),
    ("aws-dev", _set("cache.masters", 2), "gpu-train:cache.masters must be 1, 3 or 5"),
    ("aws-dev", _set("limits.maxGpus", 2), "over gpu-train:limits.maxGpus = 2"),
    ("aws-dev", _set("gpuPools[0].labels", {"gpu-train.io/pool": "x"}),
     "gpu-train:gpuPools[0].labels.gpu-train.io/pool uses a reserved prefix"),
]


@pytest.mark.parametrize(("stack", "mutate", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_settings_fail_with_the_full_key(stack, mutate, message):
    raw = copy.deepcopy(raw_stack(stack))
    mutate(raw)
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, stack)
    assert message in str(err.value), str(err.value)


def test_every_problem_is_reported_at_once():
    raw = copy.deepcopy(raw_stack("aws-dev"))
    raw["gpu-train:gpuPools"][0]["maxNodes"] = "x"
    raw["gpu-train:network"]["natt"] = "single"
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, "aws-dev")
    assert len(err.value.problems) == 2
    assert "did you mean 'nat'" in str(err.value)


def test_malformed_json_names_the_key():
    raw = raw_stack("aws-dev") | {"gpu-train:network": '{"vpcCidr": '}
    with pytest.raises(config.ConfigError, match="gpu-train:network is not valid JSON"):
        config.parse(raw, "aws-dev")


def test_settings_are_frozen():
    cfg = config.parse(raw_stack("aws-dev"), "aws-dev")
    with pytest.raises(AttributeError):
        cfg.region = "eu-west-1"  # type: ignore[misc]


def test_every_setting_is_documented():
    import dataclasses

    doc = (ROOT / "docs" / "configuration.md").read_text()
    classes = [config.StackConfig, config.NetworkConfig, config.ClusterConfig, config.GpuPoolConfig,
               config.CacheConfig, config.MonitoringConfig, config.TeamConfig, config.JobConfig,
               config.ImageConfig, config.MlflowConfig, config.LimitsConfig]
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name != "stack":
                assert f"| `{config._camel(f.name)}` |" in doc, f"{cls.__name__}.{f.name} missing from docs"
