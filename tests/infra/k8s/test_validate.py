"""Schema and policy validation of every object the Kubernetes layer makes, for all four stacks'
settings (layer built under mocks): kubernetes-validate in strict mode for the stack's Kubernetes
version, required fields of custom resources, and checkov's Kubernetes checks with only the skips
documented in infra/k8s/checkov-skips.yaml.

Usage: .venv/bin/pytest tests/infra/k8s/test_validate.py -q
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from tests.infra.k8s.checks import cr_problems, run_checkov, validate_strict
from tests.infra.k8s.harness import STACKS, load_stack, objects


@pytest.mark.parametrize("stack", STACKS)
def test_objects_pass_strict_schema_validation(layers, stack):
    records, _ = layers[stack]
    errors, custom = validate_strict(objects(records), load_stack(stack).cluster.kubernetes_version)
    assert errors == []
    assert {o["kind"] for o in custom} >= {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ResourceFlavor",
                                           "ClusterQueue", "LocalQueue"}
    assert [p for o in custom for p in cr_problems(o)] == []


def test_strict_validation_catches_a_misspelled_field(layers):
    records, _ = layers["aws-dev"]
    policy = copy.deepcopy(next(o for o in objects(records) if o["kind"] == "NetworkPolicy"))
    policy["spec"]["podSelectr"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, "1.33", strict=True)


def test_cr_checks_catch_a_monitor_prometheus_would_ignore(layers):
    records, _ = layers["aws-dev"]
    monitor = copy.deepcopy(next(o for o in objects(records) if o["kind"] == "ServiceMonitor"))
    monitor["metadata"]["labels"] = {"app": "dcgm"}
    assert any("kube-prometheus-stack" in p for p in cr_problems(monitor))
    queue = copy.deepcopy(next(o for o in objects(records) if o["kind"] == "ClusterQueue"))
    queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop()
    assert cr_problems(queue)


@pytest.mark.integration  # runs checkov
def test_checkov_passes_with_only_the_documented_skips(layer_manifests, tmp_path):
    # A control in the same run: the NVMe DaemonSet without its skip annotations must fail, which
    # shows checkov really ran on these files and that the skips come from the annotations.
    control = tmp_path / "control"
    control.mkdir()
    source = next(layer_manifests["gcp-dev"].glob("*daemonset--nvme-raid0.yaml"))
    manifest = yaml.safe_load(source.read_text())
    del manifest["metadata"]["annotations"]
    (control / source.name).write_text(yaml.safe_dump(manifest))
    failures = run_checkov({**layer_manifests, "control": control}, tmp_path)
    assert failures and all("control--" in f for f in failures), failures
    assert any("CKV_K8S_16" in f for f in failures)
