"""Every pod the plans install is admitted: tools/validation/admission.py over the four stacks and the fabric
variants, and broken copies that must fail naming the release or component, the workload, the field and the level.

Usage: .venv/bin/pytest -q tests/tools/validation/test_admission.py   (plans every stack and variant once)
"""

from __future__ import annotations

import copy

import pytest

from infra.k8s import monitoring
from tests.conftest import SERVING_VARIANTS
from tools.validation import admission, chart_pods, helm

ENFORCE = admission.ENFORCE


def with_level(plan: dict, namespace: str, level: str) -> dict:
    broken = copy.deepcopy(plan)
    found = [r for r in broken["resources"] if r["type"] == "kubernetes:core/v1:Namespace"
             and r["inputs"]["metadata"]["name"] == namespace]
    assert found, f"{plan['stack']} creates no namespace {namespace}"
    found[0]["inputs"]["metadata"]["labels"][ENFORCE] = level
    return broken


def release(plan: dict, name: str) -> dict:
    return next(r for r in plan["resources"] if r["type"] == helm.RELEASE_TYPE and r["inputs"]["name"] == name)


def test_every_stack_and_variant_is_admitted(all_plans):
    assert len(all_plans) == 10  # the four stacks, the four fabric variants, the two serving variants
    for stack, plan in all_plans.items():
        result = admission.check_plan(plan)
        assert result.problems == [], f"{stack}:\n" + "\n".join(result.problems)
        kinds = {(w.kind, w.name) for w in result.workloads}
        # Both sources are judged: the chart's DaemonSets and the program's own.
        assert ("DaemonSet", "kube-prometheus-stack-prometheus-node-exporter") in kinds, stack
        assert ("DaemonSet", "gpu-preflight") in kinds, stack
        releases = {r.name for r in helm.releases(plan)}
        origins = {w.origin.split(" (")[0].rsplit("/", 1)[-1] for w in result.workloads if w.origin.startswith("release")}
        assert origins == releases - {"karpenter-crd", "kserve-crd"}, stack  # the CRD charts install no workload
        if stack in SERVING_VARIANTS:  # and the InferenceService by the pod KServe makes of it
            assert ("InferenceService", "chat-v3") in kinds, stack


@pytest.mark.parametrize("stack", ["aws-dev", "gcp-prod"])
def test_the_node_agents_namespace_at_baseline_refuses_node_exporter_and_dcgm_exporter(all_plans, stack):
    problems = admission.check_plan(with_level(all_plans[stack], monitoring.AGENTS_NAMESPACE, "baseline")).problems
    text = "\n".join(problems)
    head = "release monitoring/kube-prometheus-stack (kube-prometheus-stack 88.5.3): DaemonSet " \
           "node-metrics/kube-prometheus-stack-prometheus-node-exporter (spec.template): namespace node-metrics " \
           "enforces Pod Security 'baseline', which refuses"
    assert f"{head} host namespaces [hostNamespaces]: spec.hostNetwork=true, spec.hostPID=true" in text
    assert f"{head} hostPath volumes [hostPathVolumes]: spec.volumes[proc].hostPath=/proc" in text
    assert f"{head} host ports [hostPorts]: spec.containers[node-exporter].ports[http-metrics].hostPort=9100" in text
    dcgm = "release node-metrics/dcgm-exporter (dcgm-exporter 4.8.2): DaemonSet node-metrics/dcgm-exporter"
    assert f"{dcgm} (spec.template): namespace node-metrics enforces Pod Security 'baseline', which refuses " \
           "capabilities beyond the default set [capabilities_baseline]: " \
           "spec.containers[exporter].securityContext.capabilities.add=['SYS_ADMIN']" in text
    assert "spec.volumes[pod-gpu-resources].hostPath=/var/lib/kubelet/pod-resources" in text
    assert ("securityContext.privileged=true" in text) == stack.startswith("gcp")  # GKE only


def test_dcgm_exporter_back_in_the_monitoring_namespace_is_refused(all_plans):
    plan = copy.deepcopy(all_plans["aws-prod"])
    release(plan, "dcgm-exporter")["inputs"]["namespace"] = "monitoring"
    problems = admission.check_plan(plan).problems
    assert problems and all(p.startswith("release monitoring/dcgm-exporter (dcgm-exporter 4.8.2): DaemonSet "
                                         "monitoring/dcgm-exporter (spec.template): namespace monitoring enforces "
                                         "Pod Security 'baseline'") for p in problems), problems


@pytest.mark.parametrize("stack", ["aws-prod", "gcp-dev"])
def test_the_alluxio_namespace_at_baseline_refuses_the_workers_page_store(all_plans, stack):
    problems = admission.check_plan(with_level(all_plans[stack], "alluxio", "baseline")).problems
    nvme = "/mnt/k8s-disks/0" if stack.startswith("aws") else "/mnt/stateful_partition/gpu-train/nvme-raid"
    assert problems == [
        f"release alluxio/alluxio (alluxio 0.6.54): DaemonSet alluxio/alluxio-worker (spec.template): namespace "
        f"alluxio enforces Pod Security 'baseline', which refuses hostPath volumes [hostPathVolumes]: "
        f"spec.volumes[ssd].hostPath={nvme}/alluxio"]


def test_the_programs_own_workloads_are_judged_from_the_plan(all_plans):
    problems = admission.check_plan(with_level(all_plans["gcp-prod"], "gpu-system", "restricted")).problems
    assert any(p.startswith("component nvme: DaemonSet gpu-system/nvme-raid0 (spec.template): namespace gpu-system "
                            "enforces Pod Security 'restricted', which refuses privileged containers [privileged]")
               for p in problems), problems
    assert any(p.startswith("component health: DaemonSet gpu-system/gpu-preflight") for p in problems), problems


def test_a_team_namespace_holds_the_jobs_to_the_admission_policies(all_plans):
    plan = copy.deepcopy(all_plans["aws-dev"])
    jobset = next(r for r in plan["resources"] if r["type"].endswith(":JobSet"))
    pod = jobset["inputs"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    problems = admission.check_plan(plan).problems
    name = jobset["inputs"]["metadata"]["name"]
    where = f"component job: JobSet team-research/{name}"
    # Pod Security admits it (team namespaces are privileged); the platform's policies do not.
    assert any(p.startswith(f"{where}: refused in namespace team-research by admission policy gpu-train-team-jobsets: ")
               and "host" in p for p in problems), problems
    assert any(p.startswith(f"{where} (spec.replicatedJobs[0].template.spec.template): its pods are refused in "
                            "namespace team-research by admission policy gpu-train-team-pods: ") for p in problems)
    assert not any("Pod Security" in p for p in problems)


def test_values_of_an_unrecorded_shape_fail_naming_the_keys(all_plans):
    plan = copy.deepcopy(all_plans["gcp-dev"])
    release(plan, "alluxio")["inputs"]["values"]["worker"]["hostNetwork"] = True
    problems = admission.check_plan(plan).problems
    assert len(problems) == 1 and problems[0].startswith(
        "release alluxio/alluxio (alluxio 0.6.54): the values' shape has no recorded render"), problems
    assert "'worker.hostNetwork: true'" in problems[0] and "'worker.hostNetwork: false'" in problems[0]
    assert problems[0].endswith("run make schemas")


def test_the_shape_keeps_switches_and_namespaces_and_drops_sizes():
    a = {"worker": {"hostNetwork": False, "resources": {"cpu": "1"}, "replicas": 1}, "namespaceOverride": "x",
         "levels": [{"type": "hostPath", "path": "/a"}, {"type": "hostPath", "path": "/b"}]}
    b = copy.deepcopy(a)
    b["worker"]["resources"]["cpu"] = "8"
    b["worker"]["replicas"] = 3
    b["levels"][1]["path"] = "/c"
    assert chart_pods.values_shape(a) == chart_pods.values_shape(b)
    for change in ({"worker": {**a["worker"], "hostNetwork": True}}, {"namespaceOverride": "y"},
                   {"levels": [{"type": "emptyDir", "path": "/a"}]}, {"extra": 1}):
        assert chart_pods.values_shape({**a, **change}) != chart_pods.values_shape(a), change


def test_a_namespace_the_plan_does_not_create_is_judged_at_the_clusters_default():
    ds = {"type": "kubernetes:apps/v1:DaemonSet", "name": "x", "inputs": {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent", "namespace": "elsewhere"},
        "spec": {"template": {"spec": {"hostPID": True, "containers": [{"name": "c"}]}}}}}
    ns = {"type": "kubernetes:core/v1:Namespace", "name": "ns", "inputs": {"metadata": {
        "name": "elsewhere", "labels": {ENFORCE: "baseline"}}}}
    unlabelled = admission.check_plan({"stack": "demo", "resources": [ds]})
    assert unlabelled.problems == [] and unlabelled.notes == [
        "namespace elsewhere is not created by the plan: its workloads are judged at the cluster's default Pod "
        "Security level, 'privileged'"]
    labelled = admission.check_plan({"stack": "demo", "resources": [ds, ns]})
    assert labelled.problems == [
        "component x: DaemonSet elsewhere/agent (spec.template): namespace elsewhere enforces Pod Security "
        "'baseline', which refuses host namespaces [hostNamespaces]: spec.hostPID=true"]
