"""Stack settings: the four stacks load, and every kind of bad value fails with its full key, whether the core's
checks (gpu_train.spec.settings) or the cloud layer's (infra/aws, infra/gcp settings_checks) find it; both run before
any resource, as infra/__main__.py runs them.

Usage: .venv/bin/pytest tests/gpu_train/spec/test_settings.py -q
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from gpu_train.spec import placement, settings_checks
from gpu_train.spec import settings as config
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.job import JobSpec, job_problems, read_job
from infra import clouds
from infra.aws import settings_checks as aws_checks
from infra.gcp import settings_checks as gcp_checks

ROOT = Path(__file__).resolve().parents[3]


def raw_stack(name: str) -> dict:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{name}.yaml").read_text())["config"]


def check(raw: dict, stack: str) -> config.StackSettings:
    """Every check a stack's settings get before the program creates anything."""
    settings = config.read(raw).model_copy(update={"stack": stack})
    clouds.require_valid(settings)
    return settings


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod", "gcp-dev", "gcp-prod"])
def test_every_stack_file_loads(stack):
    cfg = check(raw_stack(stack), stack)
    assert cfg.stack == stack
    assert cfg.cloud == stack.split("-")[0]
    assert cfg.environment == stack.split("-")[1]
    assert cfg.job is not None and cfg.job.pool in {p.name for p in cfg.gpu_pools}
    assert cfg.deploy is False  # the shipped stacks are examples


def test_dev_stacks_are_small_spot_and_scale_to_zero():
    for stack in ("aws-dev", "gcp-dev"):
        cfg = check(raw_stack(stack), stack)
        for pool in cfg.gpu_pools:
            assert pool.capacity == "spot" and pool.min_nodes == 0 and not pool.fabric
            assert any(g in pool.instance_type for g in ("g6", "g2")), pool.instance_type


def test_prod_stacks_use_fabric_h100_with_reserved_and_spot_pools():
    expected = {"aws-prod": "p5.48xlarge", "gcp-prod": "a3-megagpu-8g"}
    for stack, machine in expected.items():
        cfg = check(raw_stack(stack), stack)
        assert {p.instance_type for p in cfg.gpu_pools} == {machine}
        assert all(p.fabric and p.zone for p in cfg.gpu_pools)
        assert {p.capacity for p in cfg.gpu_pools} >= {"spot"}
        assert {p.capacity for p in cfg.gpu_pools} & {"reservation", "capacity-block", "on-demand"}


def test_prod_jobs_have_their_whole_max_on_nominal_quota():
    # Hand-computed: nodes "2:4" on 8-GPU machines needs 32 GPUs admitted at once; the research team's
    # nominal quota on h100-reserved is 32 in both prod stacks.
    for stack in ("aws-prod", "gcp-prod"):
        cfg = check(raw_stack(stack), stack)
        research = cfg.team("research")
        assert cfg.team_quota(research) == {"h100-reserved": 32, "h100-spot": 16}
        assert cfg.team_quota(cfg.team("applied")) == {"h100-reserved": 0, "h100-spot": 16}


def test_structured_values_as_json_strings_like_the_engine_passes_them():
    raw = raw_stack("aws-dev") | {"gpu-train:deploy": True, "gpu-train:deployRunner": RUNNER}
    engine_style = {k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}
    assert isinstance(engine_style["gpu-train:gpuPools"], str) and engine_style["gpu-train:deploy"] == "true"
    cfg = check(engine_style, "aws-dev")
    assert cfg.gpu_pools[0].name == "l4-spot"
    assert cfg.gpu_pools[1].instance_type == "g6e.2xlarge"
    assert cfg.deploy is True


def test_top_level_text_values_are_read_by_the_shared_value_rules():
    # The engine hands a top-level boolean over as text: `true`/`false` in any case is one, `yes` is not
    # (gpu_train/spec/values.py), and the refusal names the setting.
    raw = raw_stack("aws-dev") | {"gpu-train:deployRunner": RUNNER}
    assert check(raw | {"gpu-train:deploy": "True"}, "aws-dev").deploy is True
    assert check(raw | {"gpu-train:deploy": "FALSE"}, "aws-dev").deploy is False
    with pytest.raises(SettingsError) as caught:
        check(raw | {"gpu-train:deploy": "yes"}, "aws-dev")
    assert "deploy" in str(caught.value)


def test_settings_of_other_namespaces_are_ignored():
    raw = raw_stack("aws-dev") | {"aws:region": "eu-west-1", "pulumi:template": "x"}
    assert check(raw, "aws-dev").region == "us-east-1"


def test_gpu_quota_is_one_number_for_every_pool_or_a_mapping():
    raw = copy.deepcopy(raw_stack("aws-dev"))  # pools: l4-spot 4 x 1 GPU, l40s-spot 2 x 1 GPU
    raw["gpu-train:teams"][0]["gpuQuota"] = 2
    cfg = check(raw, "aws-dev")
    # One number: that many on every pool.
    assert cfg.team_quota(cfg.teams[0]) == {"l4-spot": 2, "l40s-spot": 2}
    raw["gpu-train:teams"][0]["gpuQuota"] = {"l40s-spot": 1, "l4-spot": 2}
    cfg = check(raw, "aws-dev")
    assert cfg.team_quota(cfg.teams[0]) == {"l4-spot": 2, "l40s-spot": 1}
    assert cfg.team_quota(cfg.teams[1]) == {"l4-spot": 0, "l40s-spot": 2}


@pytest.mark.parametrize("quota", [100, {"l4-spot": 100}, 3, {"l40s-spot": 3}])
def test_a_quota_above_a_pools_capacity_is_refused_in_either_form(quota):
    raw = copy.deepcopy(raw_stack("aws-dev"))  # pools: l4-spot 4 x 1 GPU, l40s-spot 2 x 1 GPU
    raw["gpu-train:teams"][0]["gpuQuota"] = quota
    pools = {p["name"]: p["maxNodes"] for p in raw["gpu-train:gpuPools"]}  # one GPU per node in both types
    gpus = quota if isinstance(quota, int) else next(iter(quota.values()))
    over = [name for name, capacity in pools.items() if gpus > capacity and (isinstance(quota, int) or name in quota)]
    key = "gpu-train:teams[0].gpuQuota" if isinstance(quota, int) else f"gpu-train:teams[0].gpuQuota.{over[0]}"
    with pytest.raises(SettingsError) as err:
        check(raw, "aws-dev")
    named = [p for p in err.value.problems if "can ever hold" in p]
    assert [p.split(" is more than pool ")[1].split("'")[1] for p in named] == over
    assert all(p.startswith(f"{key} {gpus} is more than pool ") for p in named), named


def _set(path: str, value):
    """A mutation: set a value at `top.key[0].sub` in the raw settings (None deletes it)."""

    def mutate(raw: dict) -> None:
        top, *rest = path.split(".", 1)
        rest = rest[0].split(".") if rest else []
        # Override keys contain a dot themselves: `job.overrides.train.lr` addresses key "train.lr".
        if len(rest) > 2 and rest[0] == "overrides":
            rest = [rest[0], ".".join(rest[1:])]
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


def _both(*mutations):
    def mutate(raw: dict) -> None:
        for m in mutations:
            m(raw)

    return mutate


RUNNER = {"kind": "codebuild", "repository": "corp/gpu-train",
          "connectionArn": "arn:aws:codeconnections:us-east-1:731204958136:connection/7c1e4f52-98a1-4b0c-a7d2-5e6f3b9c0d18"}

# (stack, mutation, text that must appear in the error: always the full key)
BAD = [
    ("aws-dev", _set("cloud", "azure"), "gpu-train:cloud must be one of 'aws' | 'gcp' (got 'azure')"),
    ("aws-dev", _set("region", None), "gpu-train:region is required"),
    ("aws-dev", _set("region", "us-east-9"), "gpu-train:region 'us-east-9' is not an AWS region"),
    ("gcp-dev", _set("region", "us-central9"), "gpu-train:region 'us-central9' is not a GCP region"),
    ("aws-dev", _set("gpuPools[0].maxNode", 3), "gpu-train:gpuPools[0].maxNode is not a known setting"),
    ("aws-dev", _set("gpuPools[0].maxNodes", "four"), "gpu-train:gpuPools[0].maxNodes must be a whole number"),
    ("aws-dev", _set("gpuPools[0].maxNodes", 2**40), "gpu-train:gpuPools[0].maxNodes must be at most 2147483647"),
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
    ("aws-dev", _set("network.serviceCidr", "8.8.0.0/16"),
     "gpu-train:network.serviceCidr 8.8.0.0/16 is not private address space: it must lie in one of 10.0.0.0/8, "
     "100.64.0.0/10, 172.16.0.0/12, 192.168.0.0/16"),
    ("aws-dev", _set("network.vpcCidr", "172.32.0.0/16"), "gpu-train:network.vpcCidr 172.32.0.0/16 is not private"),
    ("aws-dev", _set("gpuPools[0].labels", {"team": "ml research"}),
     "gpu-train:gpuPools[0].labels.team is not a Kubernetes label: label value 'ml research'"),
    ("aws-dev", _set("gpuPools[0].labels", {"team": "x" * 64}), "gpu-train:gpuPools[0].labels.team is not a "
                                                                "Kubernetes label: label value"),
    ("aws-dev", _set("gpuPools[0].labels", {"Team_Name/x": "a"}),
     "gpu-train:gpuPools[0].labels.Team_Name/x is not a Kubernetes label: label key 'Team_Name/x': its prefix"),
    ("aws-prod", _set("network.nat", "single"), "gpu-train:network.nat must be 'per-zone' in a prod stack"),
    ("aws-dev", _set("cluster.kubernetesVersion", "1.19"),
     "gpu-train:cluster.kubernetesVersion '1.19' is not a Kubernetes minor EKS offers"),
    ("aws-dev", _set("cluster.kubernetesVersion", "1.40"),
     "gpu-train:cluster.kubernetesVersion '1.40' is not a Kubernetes minor EKS offers"),
    # EKS still offers 1.30, but the job's Job successPolicy needs 1.31.
    ("aws-dev", _set("cluster.kubernetesVersion", "1.30"),
     "gpu-train:cluster.kubernetesVersion '1.30' is older than this platform supports"),
    # GKE's Stable channel does not offer 1.35 yet.
    ("gcp-prod", _set("cluster.kubernetesVersion", "1.35"),
     "gpu-train:cluster.kubernetesVersion '1.35' is not a Kubernetes minor GKE's STABLE channel offers"),
    ("aws-dev", _set("cluster.endpointPublicAccess", True), "gpu-train:cluster.publicAccessCidrs must list"),
    ("aws-prod", _set("cluster.publicAccessCidrs", ["0.0.0.0/0"]), "open the API endpoint to the whole internet"),
    # The whole internet written as two halves.
    ("aws-prod", _set("cluster.publicAccessCidrs", ["0.0.0.0/1", "128.0.0.0/1"]),
     "gpu-train:cluster.publicAccessCidrs ['0.0.0.0/1', '128.0.0.0/1'] together open the API endpoint"),
    ("gcp-prod", _set("cluster.publicAccessCidrs", ["128.0.0.0/1", "0.0.0.0/2", "64.0.0.0/2"]),
     "together open the API endpoint to the whole internet"),
    ("aws-dev", _set("zones", ["eu-west-1a", "us-east-1b"]),
     "gpu-train:zones[0] 'eu-west-1a' is not a zone of region 'us-east-1'"),
    ("aws-prod", _set("zones", ["us-east-1a"]), "gpu-train:zones must list at least two zones on AWS"),
    ("gcp-dev", _set("project", None), "gpu-train:project is required when cloud is gcp"),
    ("gcp-dev", _set("project", "ML"), "gpu-train:project 'ML' is not a GCP project id"),
    ("aws-dev", _set("cluster.systemNodeType", "large"), "gpu-train:cluster.systemNodeType 'large' is not an EC2 instance type name"),
    ("aws-prod", _set("gpuPools[0].reservationId", "my reservation"),
     "gpu-train:gpuPools[0].reservationId 'my reservation' is not an EC2 capacity reservation id"),
    ("aws-dev", _set("teams[0].submitters", [" "]), "gpu-train:teams[0].submitters[0] must name a group"),
    ("gcp-dev", _set("gpuPools[0].capacity", "capacity-block"), "gpu-train:gpuPools[0].capacity 'capacity-block'"),
    ("gcp-prod", _set("cluster.masterCidr", "172.16.0.0/24"), "gpu-train:cluster.masterCidr must be a /28"),
    # gcp-prod's VPC is 10.40.0.0/20: a control plane inside it.
    ("gcp-prod", _set("cluster.masterCidr", "10.40.0.16/28"),
     "gpu-train:cluster.masterCidr 10.40.0.16/28 overlaps gpu-train:network.vpcCidr 10.40.0.0/20"),
    # gcp-prod's TCPXO pools need 8 fabric /24s in 192.168.0.0/16; a VPC over all of it leaves none.
    ("gcp-prod", _set("network.vpcCidr", "192.168.0.0/16"),
     "gpu-train:network ranges leave no room for the GPU fabric subnets"),
    ("gcp-dev", _set("tags.owner", "ML Team"), "gpu-train:tags.owner value 'ML Team' is not a valid GCP label value"),
    ("aws-dev", _set("monitoring.checkpointMaxAgeMinutes", -5),
     "gpu-train:monitoring.checkpointMaxAgeMinutes must be >= 1 (got -5)"),
    ("aws-dev", _set("monitoring.lowUtilizationPercent", -1),
     "gpu-train:monitoring.lowUtilizationPercent must be >= 1 (got -1)"),
    ("aws-dev", _set("health.xidCodes", [79, 31]),
     "gpu-train:health.xidCodes[1] XID 31 is raised by an application fault, not a GPU fault"),
    ("gcp-dev", _set("health.xidCodes", [48, 48]), "gpu-train:health.xidCodes[1] XID 48 is listed twice"),
    ("aws-dev", _set("health.xidCodes", [0]), "gpu-train:health.xidCodes[0] must be >= 1 (got 0)"),
    ("aws-dev", _set("health.xidCodes", ["79"]), "gpu-train:health.xidCodes[0] must be a whole number"),
    ("aws-dev", _set("health.xidCodes", 79), "gpu-train:health.xidCodes must be a list"),
    ("gcp-prod", _set("health.maxConcurrentRepairs", 0), "gpu-train:health.maxConcurrentRepairs must be >= 1 (got 0)"),
    ("aws-prod", _set("health.dcgmDiagLevel", 3), "gpu-train:health.dcgmDiagLevel must be <= 2 (got 3)"),
    ("aws-dev", _set("health.remediaton", False), "gpu-train:health.remediaton is not a known setting (did you mean "
                                                  "'remediation'?)"),
    ("aws-dev", _set("health.nodeRepair", "yes"), "gpu-train:health.nodeRepair must be true or false"),
    ("aws-dev", _set("teams[0].gpuQuota", -1), "gpu-train:teams[0].gpuQuota must be >= 0"),
    ("aws-dev", _set("teams[0].gpuQuota", [4]), "gpu-train:teams[0].gpuQuota must be a whole number or a mapping"),
    ("aws-dev", _set("teams[0].gpuQuota", {"l4-spot": "four"}),
     "gpu-train:teams[0].gpuQuota.l4-spot must be a whole number"),
    ("aws-dev", _set("teams[0].gpuQuota", {"l4-sopt": 4}),
     "gpu-train:teams[0].gpuQuota.l4-sopt is not one of gpuPools[].name"),
    ("aws-dev", _set("teams[0].gpuQuota", {"l4-spot": -2}), "gpu-train:teams[0].gpuQuota.l4-spot must be >= 0"),
    # l4-spot holds 4 nodes x 1 GPU.
    ("aws-dev", _set("teams[0].gpuQuota", {"l4-spot": 5}),
     "gpu-train:teams[0].gpuQuota.l4-spot 5 is more than pool 'l4-spot' can ever hold (4 GPUs"),
    ("aws-dev", _set("teams[1].gpuQuota", 0), "gpu-train:teams[1].gpuQuota gives team 'platform' no GPUs on any pool"),
    ("aws-dev", _set("teams[0].prepareQuota", {"cpus": -1, "memoryGi": 8}),
     "gpu-train:teams[0].prepareQuota.cpus must be >= 0 (got -1)"),
    ("gcp-dev", _set("teams[0].prepareQuota", {"cpus": 4096}),
     "gpu-train:teams[0].prepareQuota.cpus must be <= 1024 (got 4096)"),
    ("aws-dev", _set("teams[1].prepareQuota", {"memoryGi": "lots"}),
     "gpu-train:teams[1].prepareQuota.memoryGi must be a whole number"),
    ("aws-dev", _set("teams[0].prepareQuota", {"cpu": 4}),
     "gpu-train:teams[0].prepareQuota.cpu is not a known setting (did you mean 'cpus'?)"),
    ("gcp-dev", _set("teams[0].prepareQuota", {"cpus": 0}),
     "gpu-train:teams[0].prepareQuota.memoryGi must be 0 exactly when cpus is (got cpus 0, memoryGi 32)"),
    ("aws-dev", _set("gpuPools[1].name", "cpu"),
     "gpu-train:gpuPools[1].name 'cpu' is the name of Kueue's flavor for the CPU (system) nodes"),
    # The job's team needs MIN 2 nodes x 8 GPUs = 16 on h100-reserved.
    ("aws-prod", _set("teams[0].gpuQuota", {"h100-reserved": 8, "h100-spot": 32}),
     "gpu-train:teams[0].gpuQuota gives team 'research' 8 GPUs of nominal quota on pool 'h100-reserved', "
     "below the 16 that gpu-train:job.nodes MIN 2 x 8 GPUs need"),
    ("aws-dev", _set("job.team", "nobody"), "gpu-train:job.team 'nobody' is not one of teams[].name"),
    ("aws-dev", _set("job.pool", "h100"), "gpu-train:job.pool 'h100' is not one of gpuPools[].name"),
    ("aws-dev", _set("job.nodes", "4"), "gpu-train:job.nodes must be MIN:MAX"),
    ("aws-dev", _set("job.nodes", "3:2"), "gpu-train:job.nodes must be MIN:MAX with 1 <= MIN <= MAX"),
    ("aws-dev", _set("job.nodes", "1:9"), "gpu-train:job.nodes MAX 9 is more than pool 'l4-spot' maxNodes 4"),
    ("aws-dev", _set("job.gpusPerNode", 8), "gpu-train:job.gpusPerNode 8 is more than g6.2xlarge has (1)"),
    ("aws-dev", _set("job.datasetUri", "gs://bucket/x"), "gpu-train:job.datasetUri must be s3://<bucket>/<path>"),
    ("aws-dev", _set("job.checkpointUri", "s3://"), "gpu-train:job.checkpointUri must be s3://<bucket>/<path>"),
    ("aws-dev", _set("job.suspend", "yes"), "gpu-train:job.suspend must be true or false"),
    ("aws-dev", _set("job.dataWaitMinutes", -1), "gpu-train:job.dataWaitMinutes must be >= 0 (got -1)"),
    ("aws-dev", _set("job.rendezvousTimeoutMinutes", 10),
     "gpu-train:job.rendezvousTimeoutMinutes is 10 minutes, shorter than Kueue's waitForPodsReady timeout (30"),
    ("aws-dev", _set("job.preset", "gpt5"), "gpu-train:job.preset 'gpt5': unknown preset 'gpt5'"),
    ("aws-dev", _set("job.overrides.train.micro_batchsize", 8),
     "gpu-train:job.overrides.train.micro_batchsize: the trainer refuses it: train.micro_batchsize: unknown key"),
    ("aws-dev", _set("job.overrides.train.lr", "fast"),
     "gpu-train:job.overrides.train.lr: the trainer refuses it: train.lr: expected a number"),
    ("aws-dev", _set("job.overrides.trian.lr", 0.1), "gpu-train:job.overrides.trian.lr: the trainer refuses it"),
    ("aws-dev", _set("job.overrides.train.lr", float("nan")), "gpu-train:job.overrides.train.lr must be a finite number"),
    ("aws-dev", _set("job.overrides", {"train.lr": None}), "gpu-train:job.overrides.train.lr must be a number, string"),
    ("aws-dev", _set("job.overrides.train.steps", 5),
     "gpu-train:job.overrides.train.steps is set by gpu-train:job.steps; set that instead"),
    ("aws-dev", _set("job.overrides.data.uri", "s3://b/m.json"),
     "gpu-train:job.overrides.data.uri is set by gpu-train:job.datasetUri"),
    ("aws-dev", _set("job.overrides.Train-LR", 1), "gpu-train:job.overrides.Train-LR must be a dotted trainer key"),
    # 65537 tokens is not a whole number of 1024-token sequences.
    ("aws-dev", _set("job.globalBatchTokens", 65537),
     "gpu-train:job.globalBatchTokens: the trainer refuses it: train.global_batch_tokens (65537) must be a multiple"),
    # 1048576 / 1024 = 1024 sequences; 3 nodes x 8 GPUs x micro batch 16 = 384 does not divide 1024;
    # lcm(16, 24, 32) x 16 x 1024 = 1572864 does.
    ("aws-prod", _both(_set("job.globalBatchTokens", 1048576), _set("job.overrides.train.micro_batch_size", 16)),
     "gpu-train:job.globalBatchTokens 1048576 does not divide at world size 24 (3 nodes x 8 GPUs"),
    ("aws-prod", _both(_set("job.globalBatchTokens", 1048576), _set("job.overrides.train.micro_batch_size", 16)),
     "A multiple of 1572864 tokens works at every world size from 16 to 32"),
    # lcm(8, 16, ..., 512) x 8 x 1024 is far past any batch anyone would train with: no multiple is offered.
    ("aws-prod", _set("job.nodes", "1:64"),
     "No global batch of practical size divides every world size from 8 to 512; narrow gpu-train:job.nodes"),
    # gpt2-124m: 65536 / 1024 = 64 sequences; 2 nodes x 1 GPU x micro batch 64 = 128 does not divide 64.
    ("aws-dev", _set("job.overrides.train.micro_batch_size", 64),
     "gpu-train:job.globalBatchTokens 65536 does not divide at world size 2 (2 nodes x 1 GPU,"),
    ("aws-dev", _set("image.prebuilt", "trainer:latest"), "gpu-train:image.prebuilt must be pinned by digest"),
    ("aws-dev", _set("image.allowedRegistries", ["ghcr.io/acme"]),
     "gpu-train:image.allowedRegistries[0] must be a registry host and optional path ending in '/', like "
     "'ghcr.io/acme/' (got 'ghcr.io/acme')"),
    ("aws-dev", _set("image.allowedRegistries", ["ghcr.io/acme/", "acme/"]),
     "gpu-train:image.allowedRegistries[1] must be a registry host"),
    # The stack's own job: its command, and its image's digest (the registry is checked once it exists).
    ("aws-dev", _set("job.command", []), "gpu-train:job.command is empty"),
    ("aws-dev", _both(_set("job.command", ["python", "train.py"]), _set("job.overrides", {})),
     "gpu-train:job.preset is a setting of the bundled trainer, and gpu-train:job.command runs your own code"),
    ("aws-dev", _set("job.image", "ghcr.io/acme/own:v1"), "gpu-train:job.image 'ghcr.io/acme/own:v1' must be pinned "
                                                          "by digest"),
    ("aws-dev", _set("monitoring.retention", "two weeks"), "gpu-train:monitoring.retention must be a Prometheus"),
    ("aws-prod", _set("cache.masters", 1), "gpu-train:cache.masters must be 3 or 5 in a prod stack"),
    ("aws-dev", _set("cache.masters", 2), "gpu-train:cache.masters must be 1, 3 or 5"),
    ("aws-dev", _set("limits.maxGpus", 2), "over gpu-train:limits.maxGpus = 2"),
    ("aws-dev", _set("gpuPools[0].labels", {"gpu-train.io/pool": "x"}),
     "gpu-train:gpuPools[0].labels.gpu-train.io/pool uses a reserved prefix"),
    ("aws-dev", _set("deploy", "yes"), "gpu-train:deploy must be true or false"),
    # Placeholders are refused only in a stack marked for deployment.
    ("aws-prod", _set("deploy", True), "gpu-train:cluster.publicAccessCidrs[0] '203.0.113.0/24' is a placeholder"),
    ("aws-prod", _set("deploy", True), "gpu-train:gpuPools[0].reservationId 'cr-0a1b2c3d4e5f67890' is a placeholder"),
    ("gcp-dev", _set("deploy", True), "gpu-train:project 'acme-ml-dev' is a placeholder"),
    ("gcp-dev", _set("deploy", True), "gpu-train:teams[0].submitters[0] 'ml-research@acme.example' is a placeholder"),
    ("aws-dev", _both(_set("deploy", True), _set("cluster.endpointPublicAccess", True),
                      _set("cluster.publicAccessCidrs", ["198.51.100.7/32"])),
     "gpu-train:cluster.publicAccessCidrs[0] '198.51.100.7/32' is a placeholder"),
    ("aws-dev", _both(_set("deploy", True),
                      _set("image.prebuilt", "123456789012.dkr.ecr.us-east-1.amazonaws.com/t@sha256:" + "a" * 64)),
     "gpu-train:image.prebuilt '123456789012.dkr.ecr"),
    ("aws-dev", _both(_set("deploy", True), _set("tags.owner", "ml@example.com")),
     "gpu-train:tags.owner 'ml@example.com' is a placeholder"),
    ("aws-dev", _set("deploy", True), "gpu-train:deployRunner.kind must be 'codebuild' in an AWS stack marked"),
    ("aws-dev", _set("deployRunner", {"kind": "codebuild", "repository": "gpu-train",
                                      "connectionArn": RUNNER["connectionArn"]}),
     "gpu-train:deployRunner.repository must be a GitHub <owner>/<name>"),
    ("aws-dev", _set("deployRunner", {"kind": "codebuild", "repository": "corp/gpu-train", "connectionArn": "x"}),
     "gpu-train:deployRunner.connectionArn must be a CodeConnections connection ARN"),
    ("gcp-dev", _set("deployRunner", {"kind": "codebuild"}), "gpu-train:deployRunner.kind 'codebuild' is an AWS"),
    ("aws-dev", _set("deployRunner", {"repository": "corp/gpu-train"}),
     "gpu-train:deployRunner.repository and connectionArn only apply with kind 'codebuild'"),
    # The runner's own settings are checked for placeholders too.
    ("aws-dev", _both(_set("deploy", True), _set("deployRunner", {
        "kind": "codebuild", "repository": "acme/gpu-train",
        "connectionArn": "arn:aws:codeconnections:us-east-1:111122223333:connection/0a1b"})),
     "gpu-train:deployRunner.connectionArn 'arn:aws:codeconnections:us-east-1:111122223333:connection/0a1b' is a "
     "placeholder"),
    # Team members (EKS access entries) and logs.
    ("aws-prod", _set("teams[0].members[0].principal", "arn:aws:sts::123456789012:assumed-role/dev/alice"),
     "gpu-train:teams[0].members[0].principal 'arn:aws:sts::123456789012:assumed-role/dev/alice' is not an IAM "
     "role or user ARN"),
    ("aws-prod", _set("teams[0].members[0].role", "admin"),
     "gpu-train:teams[0].members[0].role must be one of 'submitter' | 'viewer' (got 'admin')"),
    ("aws-dev", _set("teams[1].members", [{"principal": "arn:aws:iam::123456789012:role/x", "role": "viewer"}]),
     "gpu-train:teams[1].members[0].role 'viewer' needs gpu-train:teams[1].viewers to name at least one group"),
    ("aws-dev", _set("teams[1].members", [{"principal": "arn:aws:iam::123456789012:role/x"},
                                          {"principal": "arn:aws:iam::123456789012:role/x", "role": "viewer"}]),
     "gpu-train:teams[1].members[1].principal 'arn:aws:iam::123456789012:role/x' is listed twice in team 'platform'"),
    ("gcp-dev", _set("teams[0].members", [{"principal": "alice@acme.example"}]),
     "gpu-train:teams[0].members[0] is an AWS setting (EKS access entries); on GKE add people to the Google groups"),
    ("aws-dev", _set("teams[0].submitters", ["system:masters"]),
     "gpu-train:teams[0].submitters[0] 'system:masters' uses the system: prefix Kubernetes reserves"),
    ("aws-dev", _set("logs.retentionDays", 45), "gpu-train:logs.retentionDays 45 is not a retention CloudWatch Logs "
                                                "offers (1, 3, 5, 7, 14, 30, 60, 90,"),
    ("aws-dev", _set("logs.retentionDays", "30"), "gpu-train:logs.retentionDays must be a whole number"),
    ("gcp-dev", _set("logs.retentionDays", 30), "gpu-train:logs.retentionDays applies to CloudWatch Logs on AWS"),
    ("aws-dev", _set("logs.retention", 30), "gpu-train:logs.retention is not a known setting (did you mean "
                                            "'retentionDays'?)"),
    # A member's principal is checked for placeholders like every other value.
    ("aws-prod", _set("deploy", True),
     "gpu-train:teams[0].members[0].principal 'arn:aws:iam::123456789012:role/ml-research-engineers' is a placeholder"),
]


@pytest.mark.parametrize(("stack", "mutate", "message"), BAD, ids=[m[:70] for _, _, m in BAD])
def test_bad_settings_fail_with_the_full_key(stack, mutate, message):
    raw = copy.deepcopy(raw_stack(stack))
    mutate(raw)
    with pytest.raises(SettingsError) as err:
        check(raw, stack)
    assert message in str(err.value), str(err.value)
    for problem in err.value.problems:
        assert "\n" not in problem and problem.startswith(("gpu-train:", "stack name")), problem


def test_every_problem_is_reported_at_once():
    raw = copy.deepcopy(raw_stack("aws-dev"))
    raw["gpu-train:gpuPools"][0]["maxNodes"] = "x"
    raw["gpu-train:network"]["natt"] = "single"
    with pytest.raises(SettingsError) as err:
        check(raw, "aws-dev")
    assert len(err.value.problems) == 2
    assert "did you mean 'nat'" in str(err.value)


def test_malformed_json_names_the_key():
    raw = raw_stack("aws-dev") | {"gpu-train:network": '{"vpcCidr": '}
    with pytest.raises(SettingsError, match="gpu-train:network is not valid JSON"):
        check(raw, "aws-dev")


def test_settings_are_frozen():
    cfg = check(raw_stack("aws-dev"), "aws-dev")
    with pytest.raises(ValidationError, match="frozen"):
        cfg.region = "eu-west-1"  # type: ignore[misc]


@pytest.mark.parametrize(("cloud", "region"), [("aws", "eu-west-1"), ("aws", "ap-southeast-5"),
                                               ("aws", "us-gov-west-1"), ("aws", "cn-north-1"),
                                               ("gcp", "europe-west4"), ("gcp", "northamerica-south1")])
def test_real_regions_pass(cloud, region):
    """Every real region passes the cloud's own rules; one outside the policy pack's allowed regions is refused by
    that rule alone, at plan time, as the pack would refuse the stack's resources."""
    base = "aws-dev" if cloud == "aws" else "gcp-dev"
    raw = copy.deepcopy(raw_stack(base))
    raw["gpu-train:region"] = region
    raw["gpu-train:zones"] = [f"{region}a", f"{region}b"] if cloud == "aws" else [f"{region}-a"]
    if region in placement.ALLOWED_REGIONS:
        assert check(raw, base).region == region
        return
    with pytest.raises(SettingsError) as err:
        check(raw, base)
    assert err.value.problems == [f"gpu-train:region {region!r} is not one of the policy pack's allowed regions "
                                  f"({', '.join(placement.ALLOWED_REGIONS)}): its allowed-regions rule would refuse "
                                  "the stack's resources"]


@pytest.mark.parametrize(("cloud", "region"), [("aws", "us-east-1"), ("gcp", "us-central1"), ("aws", "eu-west-1"),
                                               ("aws", "ap-southeast-5"), ("gcp", "europe-west3")])
def test_the_plan_refuses_the_regions_the_policy_pack_refuses(cloud, region):
    from policies.core import Context, Resource
    from policies.tagging import allowed_regions

    base = "gcp-dev" if cloud == "gcp" else "aws-dev"
    raw = copy.deepcopy(raw_stack(base))
    raw["gpu-train:region"] = region
    raw["gpu-train:zones"] = [f"{region}a", f"{region}b"] if cloud == "aws" else [f"{region}-a"]
    plan = settings_checks.problems(config.read(raw).model_copy(update={"stack": base}))
    network = Resource(type="gcp:compute/subnetwork:Subnetwork", name="n", urn="urn:n", props={"region": region})
    pack = list(allowed_regions(network, Context(stack=base)))
    assert any(p.startswith(f"gpu-train:region {region!r} is not one of") for p in plan) == bool(pack)


@pytest.mark.parametrize(("stack", "channel", "version"), [
    ("aws-dev", None, "1.31"), ("aws-dev", None, "1.35"), ("gcp-dev", "RAPID", "1.35"),
    ("gcp-dev", "REGULAR", "1.34"), ("gcp-dev", "STABLE", "1.32")])
def test_offered_kubernetes_versions_pass(stack, channel, version):
    raw = copy.deepcopy(raw_stack(stack))
    raw["gpu-train:cluster"]["kubernetesVersion"] = version
    if channel:
        raw["gpu-train:cluster"]["releaseChannel"] = channel
    assert check(raw, stack).cluster.kubernetes_version == version


@pytest.mark.parametrize("value", [
    "203.0.113.0/24", "192.0.2.10", "2001:db8::/48", "ml@example.com", "https://example.org/x", "team@corp.example",
    "acme-ml-prod", "Acme_Corp", "arn:aws:iam::123456789012:role/x", "111122223333", "cr-1234567890abcdef0",
    "cr-00000000000000000", "my-sample-reservation", "replace-me", "CHANGEME",
])
def test_placeholder_values_are_recognised(value):
    key = "gpu-train:gpuPools[0].reservationId" if value.startswith(("cr-", "my-")) else "gpu-train:tags.x"
    assert settings_checks.placeholder(key, value), value


@pytest.mark.parametrize("value", [
    "10.0.0.0/16", "52.94.76.0/22", "ml-research", "research@corp.io", "s3://corp-datasets/gpt",
    "cr-0f3c9e1d27a8b4c65", "a3mega-reservation-1", "cost-center", "macme", "acmenet", "arn:aws:iam::731204958136:role/x",
])
def test_real_looking_values_are_not_placeholders(value):
    assert settings_checks.placeholder("gpu-train:gpuPools[0].reservationId", value) is None, value


def test_trainer_overrides_are_not_names_to_police():
    assert settings_checks.placeholder("gpu-train:job.overrides.tracking.experiment", "sample-efficiency") is None
    assert settings_checks.placeholder("gpu-train:tags.owner", "sample-efficiency")


def test_a_real_deploy_runner_passes():
    raw = copy.deepcopy(raw_stack("aws-dev")) | {"gpu-train:deploy": True, "gpu-train:deployRunner": RUNNER}
    cfg = check(raw, "aws-dev")
    assert cfg.deploy_runner.kind == "codebuild" and cfg.deploy_runner.repository == "corp/gpu-train"


def test_every_setting_is_documented():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    classes = [config.StackSettings, config.NetworkSettings, config.ClusterSettings, config.GpuPoolSettings,
               config.CacheSettings, config.MonitoringSettings, config.HealthSettings, config.TeamSettings,
               JobSpec, config.ImageSettings, config.MlflowSettings, config.LimitsSettings,
               config.DeployRunnerSettings, config.TeamMemberSettings, config.LogsSettings]
    for cls in classes:
        for name, field in cls.model_fields.items():
            if not field.exclude:
                assert f"| `{field.alias}` |" in doc, f"{cls.__name__}.{name} missing from docs"


def test_kubernetes_versions_and_regions_are_documented_with_their_source():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert all(v in doc for v in aws_checks.KUBERNETES_VERSIONS)
    for versions in gcp_checks.KUBERNETES_VERSIONS.values():
        assert all(v in doc for v in versions)
    assert "docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html" in doc


def test_health_settings_default_to_the_listed_xids_and_read_from_a_stack():
    """The default XIDs are the GPU faults the platform quarantines on (docs/operations.md); none is an
    application XID, so the defaults pass the check that refuses those."""
    assert config.HealthSettings().xid_codes == (48, 63, 64, 74, 79, 94, 95)
    assert not set(config.HealthSettings().xid_codes) & settings_checks.APPLICATION_XIDS
    raw = copy.deepcopy(raw_stack("gcp-prod"))
    raw["gpu-train:health"] = {"remediation": False, "xidCodes": [79, 48], "maxConcurrentRepairs": 2}
    cfg = check(raw, "gcp-prod")
    assert (cfg.health.remediation, cfg.health.xid_codes, cfg.health.max_concurrent_repairs) == (False, (79, 48), 2)
    assert cfg.health.enabled and cfg.health.preflight and cfg.health.node_repair


def test_members_become_access_entries_with_their_teams_groups():
    cfg = check(raw_stack("aws-prod"), "aws-prod")
    assert aws_checks.team_access_entries(cfg.teams) == {
        "arn:aws:iam::123456789012:role/ml-applied-engineers": ("ml-applied",),
        "arn:aws:iam::123456789012:role/ml-platform-engineers": ("ml-platform",),
        "arn:aws:iam::123456789012:role/ml-research-engineers": ("ml-research",)}
    assert aws_checks.log_retention_days(cfg) == 30  # unset: 30 days
    raw = copy.deepcopy(raw_stack("aws-dev"))
    raw["gpu-train:logs"] = {"retentionDays": 365}
    assert aws_checks.log_retention_days(check(raw, "aws-dev")) == 365


def test_a_job_spec_is_the_stacks_job_under_another_key():
    """A job spec file (gpu-train submit) is read by the same model and checked by the same checks as the stack's
    job, against the platform's pools and teams."""
    cfg = check(raw_stack("aws-dev"), "aws-dev")
    raw = raw_stack("aws-dev")["gpu-train:job"]
    assert read_job(raw, key="job") == cfg.job
    with pytest.raises(SettingsError) as err:
        read_job({**raw, "steps": 0, "pool": "h100", "stepz": 1}, key="job")
    assert err.value.problems == ["job.steps must be >= 1 (got 0)",
                                  "job.stepz is not a known setting (did you mean 'steps'?)"]
    problems = job_problems(read_job({**raw, "pool": "h100"}, key="job"),
                            pools=settings_checks.pool_facts(cfg), teams=settings_checks.team_facts(cfg),
                            scheme="s3://", key="job")
    assert "job.pool 'h100' is not one of gpuPools[].name (l4-spot, l40s-spot)" in problems
    assert all(p.startswith("job.") for p in problems)


@pytest.mark.parametrize(("key", "message"), [
    ("gpu_train:job", "gpu_train:job is in namespace 'gpu_train', which nothing reads (did you mean 'gpu-train:job'?)"),
    ("job", "job has no namespace (did you mean 'gpu-train:job'?)"),
    ("gpu-trian:teams", "gpu-trian:teams is in namespace 'gpu-trian', which nothing reads (did you mean "
                        "'gpu-train:teams'?)"),
    ("acme:thing", "acme:thing is in namespace 'acme', which nothing reads (namespaces: gpu-train, pulumi, aws, gcp, "
                   "kubernetes, docker-build)"),
])
def test_a_setting_in_no_ones_namespace_is_refused_naming_it(key, message):
    """A job under a misspelt namespace would plan with no job at all and exit 0: it is refused instead."""
    raw = copy.deepcopy(raw_stack("aws-dev")) | {key: {"name": "x"}}
    with pytest.raises(SettingsError) as err:
        settings_checks.parse(raw, "aws-dev")
    assert err.value.problems == [message]
