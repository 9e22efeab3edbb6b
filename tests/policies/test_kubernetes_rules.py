"""Kubernetes rules on realistic hand-built objects: each passes intact and fails with one field broken.

Usage: `.venv/bin/pytest tests/policies/test_kubernetes_rules.py -q` (no mocks; the GPUDirect exemption
tests use the real gcp-prod plan from the session `plans` fixture).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from policies.core import Context, Resource
from policies.registry import RULES
from tests.policies.helpers import broken, details, first

CTX = Context(stack="aws-dev", environment="dev")
DIGEST = "sha256:" + "ab" * 32
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-dev-trainer@{DIGEST}"
SAFE = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _container(name: str, image: str = IMAGE) -> dict:
    return {"name": name, "image": image, "securityContext": {"allowPrivilegeEscalation": False},
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"nvidia.com/gpu": 1}}}


def jobset() -> Resource:
    pod = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
           "initContainers": [_container("prefetch")], "containers": [_container("trainer")]}
    props = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
             "metadata": {"name": "gpt2-smoke", "namespace": "team-research"},
             "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1,
                                          "template": {"spec": {"template": {"spec": pod}}}}]}}
    return Resource(type="kubernetes:jobset.x-k8s.io/v1alpha2:JobSet", name="job",
                    urn="urn:pulumi:aws-dev::gpu-train::kubernetes:jobset.x-k8s.io/v1alpha2:JobSet::job", props=props)


def deployment(namespace: str, image: str = "ghcr.io/mlflow/mlflow:v3.17.2@" + DIGEST) -> Resource:
    pod = {"securityContext": {"runAsNonRoot": True}, "containers": [_container("server", image)]}
    props = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "app", "namespace": namespace},
             "spec": {"template": {"spec": pod}}}
    return Resource(type="kubernetes:apps/v1:Deployment", name=f"{namespace}-app",
                    urn=f"urn:pulumi:aws-dev::gpu-train::kubernetes:apps/v1:Deployment::{namespace}-app", props=props)


def _pod(props, i=0):
    return props["spec"]["replicatedJobs"][i]["template"]["spec"]["template"]["spec"]


JOBSET_CASES = [
    ("training-pod-security", lambda p: _pod(p)["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
    ("training-pod-security", lambda p: _pod(p)["containers"][0]["securityContext"].update(runAsNonRoot=False),
     "runAsNonRoot"),
    ("training-pod-security", lambda p: _pod(p)["initContainers"][0]["securityContext"].pop(
        "allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    ("training-pod-security", lambda p: _pod(p)["containers"][0]["securityContext"].update(privileged=True),
     "privileged"),
    ("training-image-digest", lambda p: _pod(p)["containers"][0].update(image="ghcr.io/acme/trainer:latest"),
     "not pinned"),
    ("container-requests", lambda p: _pod(p)["containers"][0]["resources"].pop("requests"), "cpu, memory"),
    ("container-requests", lambda p: _pod(p)["initContainers"][0]["resources"]["requests"].pop("memory"),
     "memory"),
]


@pytest.mark.parametrize(("rule_id", "mutate", "word"), JOBSET_CASES)
def test_jobset_rules(rule_id, mutate, word):
    intact = jobset()
    assert details(rule_id, [intact], CTX) == []
    found = details(rule_id, [broken(intact, mutate)], CTX)
    assert found and any(word in d for d in found), found


def test_team_namespace_workloads_are_training_pods_and_others_are_advisory_only():
    team, other = deployment("team-research"), deployment("mlflow")
    root = lambda p: p["spec"]["template"]["spec"]["securityContext"].update(runAsNonRoot=False)  # noqa: E731
    assert details("training-pod-security", [broken(team, root)], CTX)
    assert details("training-pod-security", [broken(other, root)], CTX) == []
    tag = lambda p: p["spec"]["template"]["spec"]["containers"][0].update(image="mlflow:latest")  # noqa: E731
    assert details("training-image-digest", [broken(team, tag)], CTX)
    assert details("image-digest", [broken(team, tag)], CTX) == []  # the mandatory rule covers it
    assert details("training-image-digest", [broken(other, tag)], CTX) == []
    assert details("image-digest", [broken(other, tag)], CTX)
    assert details("image-digest", [other], CTX) == []


def _namespace(name: str) -> Resource:
    return Resource(type="kubernetes:core/v1:Namespace", name=name,
                    urn=f"urn:pulumi:aws-dev::gpu-train::kubernetes:core/v1:Namespace::{name}",
                    props={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def _deny(namespace: str, **spec) -> Resource:
    body = {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], **spec}
    return Resource(type="kubernetes:networking.k8s.io/v1:NetworkPolicy", name=f"{namespace}-default-deny",
                    urn=f"urn:pulumi:aws-dev::gpu-train::kubernetes:networking.k8s.io/v1:NetworkPolicy::{namespace}",
                    props={"metadata": {"name": "default-deny", "namespace": namespace}, "spec": body})


@pytest.mark.parametrize(("policy", "why"), [
    (None, "no policy"),
    (_deny("team-research", policyTypes=["Ingress"]), "ingress only"),
    (_deny("team-research", podSelector={"matchLabels": {"app": "x"}}), "selects some pods"),
    (_deny("team-research", ingress=[{"from": [{"podSelector": {}}]}]), "allows traffic"),
    (_deny("mlflow"), "other namespace"),
])
def test_namespace_default_deny_fails(policy, why):
    resources = [_namespace("team-research")] + ([policy] if policy else [])
    found = details("namespace-default-deny", resources, CTX)
    assert len(found) == 1 and "team-research" in found[0], why


def test_namespace_default_deny_passes():
    resources = [_namespace("team-research"), _deny("team-research"), _namespace("mlflow"), _deny("mlflow")]
    assert details("namespace-default-deny", resources, CTX) == []


def test_storage_class_encryption():
    sc = Resource(type="kubernetes:storage.k8s.io/v1:StorageClass", name="encrypted-gp3", urn="urn:sc",
                  props={"provisioner": "ebs.csi.aws.com",
                         "parameters": {"type": "gp3", "encrypted": "true", "kmsKeyId": "arn:aws:kms:k"}})
    assert details("disk-encryption-cmk", [sc], CTX) == []
    bad = copy.deepcopy(dict(sc.props))
    del bad["parameters"]["kmsKeyId"]
    assert details("disk-encryption-cmk", [broken(sc, lambda p: p.update(bad))], CTX)


# --------------------------------------------------------------- the GPUDirect receive-datapath exemption

JOBSET_TYPE = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
GPROD = Context(stack="gcp-prod", environment="prod")
RXDM_RULES = ("training-pod-security", "training-image-digest", "container-requests")


def _rxdm(props):
    """The tcpxo-daemon sidecar of a real gcp-prod JobSet's pod."""
    return next(c for c in _pod(props)["initContainers"] if c["name"] == "tcpxo-daemon")


def test_real_gcp_prod_jobset_with_its_privileged_gpudirect_sidecar_passes(plans):
    real = first(plans, "gcp-prod", JOBSET_TYPE)
    sidecar = _rxdm(real.props)
    assert sidecar["securityContext"]["privileged"] is True  # the case the exemption is for
    assert not sidecar["image"].count("@sha256:")
    for rule_id in RXDM_RULES:
        assert details(rule_id, [real], GPROD) == [], rule_id


@pytest.mark.parametrize(("mutate", "rules"), [
    # Same privileged root container under another name: every check applies again.
    (lambda c: c.update(name="helper"), {"training-pod-security", "training-image-digest"}),
    # Same name, another image (or a look-alike repository): not Google's manager.
    (lambda c: c.update(image="ghcr.io/acme/tcpgpudmarxd-dev:v1.0.18"),
     {"training-pod-security", "training-image-digest"}),
    (lambda c: c.update(image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo-evil/tcpgpudmarxd-dev:v1"),
     {"training-pod-security", "training-image-digest"}),
    (lambda c: c.update(image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"),
     {"training-pod-security", "training-image-digest"}),  # TCPX's manager under TCPXO's name
    # The exemption never covers resource requests.
    (lambda c: c.pop("resources"), {"container-requests"}),
])
def test_gpudirect_exemption_needs_both_the_name_and_googles_repository(plans, mutate, rules):
    real = first(plans, "gcp-prod", JOBSET_TYPE)
    bad = broken(real, lambda p: mutate(_rxdm(p)))
    for rule_id in RXDM_RULES:
        found = details(rule_id, [bad], GPROD)
        assert bool(found) == (rule_id in rules), (rule_id, found)
    if "training-pod-security" in rules:
        found = " ".join(details("training-pod-security", [bad], GPROD))
        assert "privileged" in found and "allowPrivilegeEscalation" in found


def test_every_rule_is_listed_in_the_docs():
    text = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()
    missing = [r.id for r in RULES if f"| `{r.id}` | {r.level} |" not in text]
    assert missing == []
