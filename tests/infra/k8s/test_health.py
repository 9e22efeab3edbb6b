"""GPU node health in the Kubernetes layer (infra/k8s/health.py): the XID monitor, the quarantine and pre-flight
rules against node-readiness-controller's CRD, the charts' values against their snapshots, the gpu-preflight
DaemonSet against the policy pack, and the component in every stack's layer.

Usage: .venv/bin/pytest tests/infra/k8s/test_health.py -q
The check script and its results server run for real in tests/infra/k8s/test_health_preflight.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest

from gpu_train.spec import naming
from gpu_train.spec.contract import Fabric, GpuPool
from gpu_train.spec.settings import HealthSettings
from infra.aws import node_addons as aws_addons
from infra.gcp import node_addons as gcp_addons
from infra.k8s import common, health, monitoring
from infra.platform import FabricProbe
from policies import pods
from tests.infra.aws.conftest import stack_cfg as aws_stack
from tests.infra.gcp.conftest import fabric_pool
from tests.infra.gcp.conftest import stack_cfg as gcp_stack
from tests.infra.k8s.harness import STACKS, build_layer, load_stack, objects, of_kind, releases
from tools.validation import crd, helm


def _pool(name="h100", gpus=8, fabric=Fabric(kind="none")) -> GpuPool:
    return GpuPool(name=name, instance_type="p5.48xlarge", capacity="spot", gpu_type="H100", gpus_per_node=gpus,
                   min_nodes=0, max_nodes=2, zone="", node_selector={naming.POOL_LABEL: name},
                   tolerations=naming.gpu_tolerations(), fabric=fabric, provisioner="karpenter")


EFA = Fabric(kind="efa", resources={"vpc.amazonaws.com/efa": 32})
# Where GKE's driver installer puts the NVIDIA binaries and libraries on the host
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus#cuda).
GKE_DRIVER_DIR = "/home/kubernetes/bin/nvidia"


def _npd_matches(pattern: str, lines: list[str]) -> bool:
    """node-problem-detector's matching: the rule's pattern with `\\z` appended, searched in the buffered lines
    joined by newlines (pkg/systemlogmonitor/log_buffer.go, Match); `.` does not cross a newline in RE2 or here."""
    return re.search(pattern + r"\Z", "\n".join(lines)) is not None


# Kernel-log lines in the driver's format (https://docs.nvidia.com/deploy/xid-errors/): with and without the
# pid/name fields newer drivers add, and with a PCI function number.
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
XID_48 = "NVRM: Xid (PCI:0000:01:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0."
XID_79_OLD = "NVRM: Xid (PCI:0000:00:01.0): 79, GPU has fallen off the bus."
XID_94_BARE = "NVRM: Xid (PCI:0000:18:00): 94"


def test_xid_patterns_match_the_driver_line_of_their_code_only():
    assert _npd_matches(health.xid_pattern(79), ["kernel: something else", XID_79])
    assert _npd_matches(health.xid_pattern(79), [XID_79_OLD])
    assert _npd_matches(health.xid_pattern(48), [XID_48])
    assert _npd_matches(health.xid_pattern(94), [XID_94_BARE])
    assert not _npd_matches(health.xid_pattern(7), [XID_79])
    assert not _npd_matches(health.xid_pattern(9), [XID_79])
    assert not _npd_matches(health.xid_pattern(79), [XID_79.replace(": 79,", ": 790,")])
    assert not _npd_matches(health.xid_pattern(48), [XID_79])
    # Only the newest line counts (the buffer must end with the match): an old XID line followed by
    # another line is not matched again.
    assert not _npd_matches(health.xid_pattern(79), [XID_79, "kernel: eth0 link up"])
    with pytest.raises(ValueError, match="not a positive"):
        health.xid_pattern(0)


def test_xid_monitor_sets_one_permanent_condition_with_the_xid_as_reason():
    mon = health.xid_monitor([79, 48, 79])
    assert mon["plugin"] == "kmsg" and mon["logPath"] == "/dev/kmsg"
    assert mon["conditions"] == [{"type": "GpuXidFault", "reason": "NoGpuXidFault",
                                  "message": "no GPU fault XID in the kernel log since boot"}]
    assert [(r["type"], r["condition"], r["reason"]) for r in mon["rules"]] == [
        ("permanent", "GpuXidFault", "NvidiaXid48"), ("permanent", "GpuXidFault", "NvidiaXid79")]
    assert mon["lookback"] == health.XID_LOOKBACK
    with pytest.raises(ValueError, match="xidCodes is empty"):
        health.xid_monitor([])


def test_npd_runs_the_xid_monitor_on_gpu_nodes_even_when_quarantined():
    values = health.npd_values([_pool()], [79])
    custom = values["settings"]["custom_monitor_definitions"]
    assert set(custom) == {"gpu-xid-monitor.json"}
    assert json.loads(custom["gpu-xid-monitor.json"]) == health.xid_monitor([79])
    # The chart mounts custom_monitor_definitions at /custom-config (templates/daemonset.yaml).
    assert "/custom-config/gpu-xid-monitor.json" in values["settings"]["log_monitors"]
    assert values["tolerations"] == [{"operator": "Exists"}]
    terms = values["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0] == {"key": naming.POOL_LABEL, "operator": "In", "values": ["h100"]}


def test_chart_values_pass_the_chart_snapshots_and_a_misspelt_key_fails():
    npd = helm.Release(name=health.NPD_RELEASE, chart=health.NPD_CHART, version=health.NPD_VERSION, repo=None,
                       values=health.npd_values([_pool()], [48, 79]), namespace=health.NAMESPACE)
    nrc = helm.Release(name=health.NRC_RELEASE, chart=health.NRC_CHART, version=health.NRC_VERSION, repo=None,
                       values=health.nrc_values(system_selector={"a": "b"}, is_prod=True), namespace=health.NAMESPACE)
    for rel in (npd, nrc):
        result = helm.check_release(rel)
        assert result.problems == [] and not result.unverified, rel.label
    broken = dataclasses.replace(npd, values={**npd.values, "setting": npd.values["settings"]})
    assert any("setting" in p for p in helm.check_release(broken).problems)
    typed = dataclasses.replace(nrc, values={**nrc.values, "replicaCount": "two"})
    assert helm.check_release(typed).problems


def _valid(obj: dict) -> list[str]:
    return crd.validate(obj).problems


def test_fault_rule_quarantines_with_noexecute_and_defaults_to_healthy():
    rule = health.fault_rule([_pool("a"), _pool("b")], remediation=True)
    spec = rule["spec"]
    assert spec["taint"] == {"key": "readiness.k8s.io/gpu-train-gpu-fault", "value": "quarantined",
                             "effect": "NoExecute"}
    assert spec["enforcementMode"] == "continuous" and spec["dryRun"] is False
    # Absent conditions count as healthy: a node without a detector (or on GKE, without the EKS agent) stays.
    assert {c["type"]: (c["requiredStatus"], c["defaultStatus"]) for c in spec["conditions"]} == {
        "GpuXidFault": ("False", "False"), "AcceleratedHardwareReady": ("True", "True")}
    assert spec["nodeSelector"]["matchExpressions"][0]["values"] == ["a", "b"]
    assert health.fault_rule([_pool()], remediation=False)["spec"]["dryRun"] is True
    assert _valid(rule) == []


def test_preflight_rules_one_taint_per_check_fabric_only_on_fabric_pools():
    rules = health.preflight_rules([_pool("plain"), _pool("fab", fabric=EFA)])
    by_check = {r["spec"]["taint"]["key"].removeprefix(health.PREFLIGHT_TAINT_PREFIX): r for r in rules}
    assert set(by_check) == {"gpus", "ecc", "dcgm", "fabric"}
    assert by_check["fabric"]["spec"]["nodeSelector"]["matchExpressions"][0]["values"] == ["fab"]
    assert by_check["gpus"]["spec"]["nodeSelector"]["matchExpressions"][0]["values"] == ["fab", "plain"]
    for check, rule in by_check.items():
        spec = rule["spec"]
        assert spec["enforcementMode"] == "bootstrap-only" and spec["taint"]["effect"] == "NoSchedule"
        # bootstrap-only rules may not carry defaultStatus (the controller's webhook refuses it).
        assert spec["conditions"] == [{"type": health.preflight_condition(check), "requiredStatus": "True"}]
        assert _valid(rule) == []
    assert {r["spec"]["taint"]["key"] for r in health.preflight_rules([_pool()])} == {
        f"{health.PREFLIGHT_TAINT_PREFIX}{c}" for c in ("gpus", "ecc", "dcgm")}


def test_the_crd_refuses_broken_rules():
    """The CRD's own checks (cel-python evaluates these) catch a taint outside readiness.k8s.io/, a wrong
    effect and a missing node selector; distinct taint keys keep the rules from fighting over one taint."""
    rule = health.fault_rule([_pool()], remediation=True)
    bad_key = copy.deepcopy(rule)
    bad_key["spec"]["taint"]["key"] = "gpu-train.io/gpu-fault"
    assert any("readiness.k8s.io" in p for p in _valid(bad_key))
    bad_effect = copy.deepcopy(rule)
    bad_effect["spec"]["taint"]["effect"] = "Evict"
    assert _valid(bad_effect)
    no_selector = copy.deepcopy(rule)
    del no_selector["spec"]["nodeSelector"]
    assert _valid(no_selector)
    keys = [r["spec"]["taint"]["key"] for r in [rule, *health.preflight_rules([_pool(fabric=EFA)])]]
    assert len(keys) == len(set(keys))


def _probe(pool: dict, stack) -> FabricProbe:
    cfg = stack([pool])
    if cfg.cloud == "aws":
        return aws_addons.node_addons(aws_addons.gpu_pools(cfg)).fabric_probes[pool["name"]]
    return gcp_addons.node_addons(cfg, {}).fabric_probes[pool["name"]]


def test_fabric_expectations_come_from_the_cloud_layer():
    """What the pre-flight check counts on a healthy node, as each cloud layer describes its pools: EFA, the
    `vpc.amazonaws.com/efa` devices of a p5.48xlarge (32, one per network card); GPUDirect-TCPXO (A3 Mega), one
    gVNIC per fabric network (8) plus the node's primary; RDMA (A3 Ultra), one ConnectX NIC per RDMA network (8;
    its extra gVNIC network is not GPU traffic); no fabric, nothing."""
    p5 = {"name": "h100", "instanceType": "p5.48xlarge", "capacity": "on-demand", "maxNodes": 2}
    assert _probe({**p5, "fabric": True, "zone": "us-west-2a"}, aws_stack) == FabricProbe(probe="efa", devices=32)
    assert _probe(p5, aws_stack) == FabricProbe(probe="none", devices=0)
    assert _probe(fabric_pool("mega", "a3-megagpu-8g"), gcp_stack) == FabricProbe(probe="gvnic", devices=9)
    assert _probe(fabric_pool("ultra", "a3-ultragpu-8g", capacity="reservation"), gcp_stack) == FabricProbe(
        probe="mlx", devices=8)
    l4 = {"name": "l4", "instanceType": "g2-standard-8", "capacity": "spot", "maxNodes": 2}
    assert _probe(l4, gcp_stack) == FabricProbe(probe="none", devices=0)


def test_pool_expectations_hand_each_pool_its_probe():
    probes = {"x": FabricProbe(probe="efa", devices=32)}
    assert health.pool_expectations([_pool("x", gpus=4, fabric=EFA), _pool("y")], probes) == {
        "x": {"gpus": 4, "fabricProbe": "efa", "fabricDevices": 32},
        "y": {"gpus": 8, "fabricProbe": "none", "fabricDevices": 0}}
    # A fabric probe that expects no devices would pass every node: refused.
    with pytest.raises(ValueError, match="pool 'x'"):
        health.pool_expectations([_pool("x", fabric=EFA)], {"x": FabricProbe(probe="efa", devices=0)})


def _daemonset(pools, driver_host_path: str = "") -> dict:
    manifest = health.preflight_daemonset(pools, common.GPU_NAMESPACE, diag_level=1,
                                          driver_host_path=driver_host_path)
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", **manifest}


def test_preflight_daemonset_reports_every_checked_condition_from_its_server():
    ds = _daemonset([_pool()])
    spec = ds["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    assert names == ["check", "results", *(f"report-{c}" for c in health.PREFLIGHT_CHECKS)]
    conditions = {r["spec"]["conditions"][0]["type"] for r in health.preflight_rules([_pool(fabric=EFA)])}
    reported = set()
    for c in spec["containers"][2:]:
        env = {e["name"]: e.get("value") for e in c["env"]}
        check = c["name"].removeprefix("report-")
        assert env["CHECK_ENDPOINT"] == f"http://127.0.0.1:{health.PREFLIGHT_SERVER_PORT}/{check}"
        reported.add(env["CONDITION_TYPE"])
        assert c["securityContext"]["runAsNonRoot"] is True and not c["securityContext"].get("privileged")
    assert reported == conditions
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert [c["name"] for c in spec["containers"] if c["securityContext"].get("privileged")] == ["check"]
    with pytest.raises(ValueError, match="level 3"):
        health.preflight_daemonset([_pool()], common.GPU_NAMESPACE, diag_level=3)


def test_gke_nodes_get_the_driver_tools_read_only():
    # The driver's host directory is the cloud layer's knowledge: GKE's, and none on EKS (the container runtime
    # injects the driver there).
    assert gcp_addons.node_addons(gcp_stack([fabric_pool("mega", "a3-megagpu-8g")]), {}).driver_host_path == \
        GKE_DRIVER_DIR
    assert aws_addons.node_addons([_pool()]).driver_host_path == ""
    ds = _daemonset([_pool()], driver_host_path=GKE_DRIVER_DIR)
    spec = ds["spec"]["template"]["spec"]
    assert {"name": "nvidia", "hostPath": {"path": GKE_DRIVER_DIR, "type": "Directory"}} in spec["volumes"]
    check = spec["containers"][0]
    assert {"name": "nvidia", "mountPath": "/usr/local/nvidia", "readOnly": True} in check["volumeMounts"]
    env = {e["name"]: e["value"] for e in check["env"]}
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64" and env["PATH"].startswith("/usr/local/nvidia/bin:")
    assert not any(v.get("hostPath") for v in _daemonset([_pool()])["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize("driver_host_path", ["", GKE_DRIVER_DIR])
def test_the_policy_pack_exempts_exactly_this_daemonset(driver_host_path):
    ds = _daemonset([_pool()], driver_host_path)
    assert pods.host_isolation_problems(ds) == [] and pods.non_root_problems(ds) == []
    renamed = copy.deepcopy(ds)
    renamed["metadata"]["name"] = "other-agent"
    assert any("privileged" in p for p in pods.host_isolation_problems(renamed))
    moved = copy.deepcopy(ds)
    moved["metadata"]["namespace"] = "default"
    assert pods.non_root_problems(moved)
    swapped = copy.deepcopy(ds)
    swapped["spec"]["template"]["spec"]["containers"][0]["image"] = "docker.io/library/ubuntu:24.04"
    assert any("privileged" in p for p in pods.host_isolation_problems(swapped))
    # The grant is for the check container only: a privileged reporter is refused.
    escalated = copy.deepcopy(ds)
    escalated["spec"]["template"]["spec"]["containers"][2]["securityContext"] = {"privileged": True}
    assert any("report-gpus" in p for p in pods.host_isolation_problems(escalated))


def test_node_agents_tolerate_the_health_taints():
    tolerations = health.node_agent_tolerations([_pool()])
    keys = {t["key"] for t in tolerations}
    assert health.FAULT_TAINT["key"] in keys and naming.GPU_TAINT["key"] in keys
    assert {health.preflight_taint(c)["key"] for c in health.PREFLIGHT_CHECKS} <= keys
    assert monitoring.dcgm_values([_pool()])["tolerations"] == tolerations


@pytest.mark.parametrize("stack", STACKS)
def test_every_stack_gets_the_health_components(layers, stack):
    records, _ = layers[stack]
    cfg = load_stack(stack)
    rel = releases(records)
    assert (rel[health.NPD_RELEASE]["chart"], rel[health.NPD_RELEASE]["version"]) == (health.NPD_CHART,
                                                                                     health.NPD_VERSION)
    assert (rel[health.NRC_RELEASE]["chart"], rel[health.NRC_RELEASE]["version"]) == (health.NRC_CHART,
                                                                                     health.NRC_VERSION)
    xid = json.loads(rel[health.NPD_RELEASE]["values"]["settings"]["custom_monitor_definitions"]["gpu-xid-monitor.json"])
    assert [r["reason"] for r in xid["rules"]] == [f"NvidiaXid{c}" for c in sorted(cfg.health.xid_codes)]
    rules = {o["metadata"]["name"]: o for o in of_kind(records, "NodeReadinessRule")}
    fabric = any(p.fabric for p in cfg.gpu_pools)
    assert set(rules) == {health.FAULT_RULE, "gpu-train-preflight-gpus", "gpu-train-preflight-ecc",
                          "gpu-train-preflight-dcgm"} | ({"gpu-train-preflight-fabric"} if fabric else set())
    pool_names = sorted(p.name for p in cfg.gpu_pools)
    assert rules[health.FAULT_RULE]["spec"]["nodeSelector"]["matchExpressions"][0]["values"] == pool_names
    assert [r for o in rules.values() for r in crd.validate(o).problems] == []
    (ds,) = [o for o in of_kind(records, "DaemonSet") if o["metadata"]["name"] == health.PREFLIGHT_NAME]
    assert ds["metadata"]["namespace"] == common.GPU_NAMESPACE
    (cm,) = [o for o in of_kind(records, "ConfigMap") if o["metadata"]["name"] == health.PREFLIGHT_NAME]
    expected = json.loads(cm["data"]["pools.json"])
    assert set(expected) == set(pool_names)
    assert cm["data"]["gpu-preflight.sh"] == health.PREFLIGHT_SCRIPT.read_text()
    for pool in cfg.gpu_pools:
        assert (expected[pool.name]["fabricProbe"] != "none") == pool.fabric
    monitors = {o["metadata"]["name"] for o in objects(records) if o["kind"] in ("PodMonitor", "ServiceMonitor")
                and o["metadata"]["namespace"] == health.NAMESPACE}
    assert monitors == {health.NPD_RELEASE, health.NRC_RELEASE}


def test_settings_reach_the_layer_and_off_means_nothing():
    def off(cfg, health):
        return cfg.model_copy(update={"health": health})

    records, _ = build_layer("aws-dev", lambda cfg: off(cfg, health=HealthSettings(
        remediation=False, preflight=False, xid_codes=(79,))))
    rules = of_kind(records, "NodeReadinessRule")
    assert [r["metadata"]["name"] for r in rules] == [health.FAULT_RULE]
    assert rules[0]["spec"]["dryRun"] is True
    assert not [o for o in of_kind(records, "DaemonSet") if o["metadata"]["name"] == health.PREFLIGHT_NAME]
    records, _ = build_layer("gcp-dev", lambda cfg: off(cfg, health=HealthSettings(enabled=False)))
    assert not of_kind(records, "NodeReadinessRule")
    assert health.NPD_RELEASE not in releases(records) and health.NRC_RELEASE not in releases(records)
    assert health.NAMESPACE not in {o["metadata"]["name"] for o in of_kind(records, "Namespace")}
