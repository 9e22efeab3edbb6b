"""The clouds' side of GPU node health, in the planned stacks: Karpenter's node repair and disruption budget,
the EKS node monitoring agent add-on and the system node group's repair (AWS), GKE auto-repair on every pool;
the add-on's configuration against its schema at the pinned version.

Usage: .venv/bin/pytest tests/infra/k8s/test_health_clouds.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from gpu_train.spec.catalog import aws as catalog
from gpu_train.spec.settings import GpuPoolSettings, HealthSettings
from infra.aws import cluster, karpenter
from tests.conftest import ROOT
from tools.validation import crd

ADDON_SCHEMA = ROOT / "tests" / "schemas" / "addons" / f"{cluster.NODE_MONITORING_AGENT}-{cluster.NODE_MONITORING_AGENT_VERSION}.json"


def _of_type(plan: dict, typ: str) -> list[dict]:
    return [r for r in plan["resources"] if r["type"] == typ]


def _karpenter_values(plan: dict) -> dict:
    (rel,) = [r for r in _of_type(plan, "kubernetes:helm.sh/v3:Release") if r["inputs"]["name"] == "karpenter"]
    return rel["inputs"]["values"]


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod"])
def test_aws_turns_on_karpenter_node_repair_and_bounds_removals(plans, stack):
    plan = plans[stack]
    assert _karpenter_values(plan)["settings"]["featureGates"]["nodeRepair"] is True
    pools = {r["inputs"]["metadata"]["name"]: r["inputs"]["spec"] for r in plan["resources"]
             if r["type"] == "kubernetes:karpenter.sh/v1:NodePool"}
    assert pools
    for name, spec in pools.items():
        if "replicas" in spec:  # static NodePools are never consolidated
            assert "budgets" not in spec["disruption"], name
        else:
            assert spec["disruption"]["budgets"] == [{"nodes": str(HealthSettings().max_concurrent_repairs)}], name
        assert crd.validate({"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name},
                             "spec": spec}).problems == []


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod"])
def test_aws_installs_the_pinned_node_monitoring_agent_and_repairs_system_nodes(plans, stack):
    plan = plans[stack]
    addons = {r["inputs"]["addonName"]: r["inputs"] for r in _of_type(plan, "aws:eks/addon:Addon")}
    nma = addons[cluster.NODE_MONITORING_AGENT]
    assert nma["addonVersion"] == cluster.NODE_MONITORING_AGENT_VERSION
    config = json.loads(nma["configurationValues"])
    assert config == cluster.node_monitoring_agent_configuration()
    (group,) = _of_type(plan, "aws:eks/nodeGroup:NodeGroup")
    assert group["inputs"]["nodeRepairConfig"] == {"enabled": True, "maxParallelNodesRepairedCount": 1}


def test_the_agent_configuration_is_what_the_add_on_accepts():
    """Against the add-on's configuration schema at the pinned version (charts/configuration.schema.json of
    aws/eks-node-monitoring-agent v1.7.0, structure kept in tests/schemas/addons): the DCGM server's
    tolerations are a setting it takes; a key it does not know is refused, as EKS would refuse it."""
    snap = json.loads(ADDON_SCHEMA.read_text())
    assert snap["version"] == cluster.NODE_MONITORING_AGENT_VERSION and snap["source"]["ref"] == "v1.7.0"
    validator = jsonschema.Draft7Validator(snap["schema"])
    assert list(validator.iter_errors(cluster.node_monitoring_agent_configuration())) == []
    assert list(validator.iter_errors({"dcgmAgent": {"tolerations": [{"operator": "Exists"}], "hostNetwork": True}}))
    assert list(validator.iter_errors({"dcgmAgent": {"tolerations": {"operator": "Exists"}}}))


@pytest.mark.parametrize("stack", ["gcp-dev", "gcp-prod"])
def test_gke_auto_repairs_every_node_pool(plans, stack):
    pools = _of_type(plans[stack], "gcp:container/nodePool:NodePool")
    assert len(pools) >= 2
    assert {r["name"]: r["inputs"]["management"]["autoRepair"] for r in pools} == {r["name"]: True for r in pools}


def test_pure_parts_follow_the_settings():
    base = {"cluster_name": "c", "endpoint": "https://e", "queue_name": "q", "system_selector": {}}
    assert karpenter.helm_values(**base, static_capacity=False, node_repair=True)["settings"]["featureGates"][
        "nodeRepair"] is True
    assert "nodeRepair" not in karpenter.helm_values(**base, static_capacity=False)["settings"]["featureGates"]
    pool = GpuPoolSettings(name="p", instance_type="g6.xlarge", capacity="spot", max_nodes=4)
    spec = karpenter.node_pools(pool, catalog.instance_spec("g6.xlarge"), node_class="c", zones=["us-east-1a"],
                                max_disrupted=3)["p"]
    assert spec["disruption"]["budgets"] == [{"nodes": "3"}]
    with pytest.raises(ValueError, match="at least one node"):
        karpenter.node_pools(pool, catalog.instance_spec("g6.xlarge"), node_class="c", zones=["us-east-1a"],
                             max_disrupted=0)
    off = cluster.node_repair_config(HealthSettings(node_repair=False))
    assert off.enabled is False and off.max_parallel_nodes_repaired_count is None
    on = cluster.node_repair_config(HealthSettings(max_concurrent_repairs=2))
    assert (on.enabled, on.max_parallel_nodes_repaired_count) == (True, 2)


@pytest.mark.integration  # plans a stack
def test_gke_auto_repair_follows_the_setting(tmp_path):
    raw = yaml.safe_load((ROOT / "stacks" / "Pulumi.gcp-dev.yaml").read_text())
    raw["config"]["gpu-train:health"] = {"nodeRepair": False}
    stack_file = tmp_path / "Pulumi.gcp-norepair.yaml"
    stack_file.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack-file", str(stack_file), "--out",
                           str(tmp_path / "plan"), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(Path(proc.stdout.strip()).read_text())
    assert {r["inputs"]["management"]["autoRepair"] for r in _of_type(plan, "gcp:container/nodePool:NodePool")} == {
        False}
