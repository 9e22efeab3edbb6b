"""The plan-time checks that re-implement a Kubernetes rule, held to the real API server's verdicts:
- the team namespaces' ValidatingAdmissionPolicies as tests/infra/k8s/vap.py evaluates them (cel-python) against
  the real API server's CEL, on every case of tests/infra/k8s/test_pod_admission.py in every form (Pod, Job,
  JobSet), and the rule that denies;
- Pod Security admission as tools/validation/pod_security.py decides it, on every pod the pinned charts render
  (their snapshots) at each level, against the API server's own Pod Security admission.

Run: .venv/bin/pytest tests/cluster/test_admission_differential.py -q

These need only the API server (and etcd): a plane without controllers of its own, started for this module.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from kubernetes.dynamic.exceptions import ApiException

from infra.k8s import pod_admission
from tests.cluster.conftest import wait_for
from tests.infra.k8s import test_pod_admission as cases
from tools.cluster.controllers import jobset_crds
from tools.cluster.plane import Plane
from tools.validation import pod_security

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ("privileged", "baseline", "restricted")


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    plane = Plane.start(ROOT / "build" / "cluster" / f"bare-{tmp_path_factory.getbasetemp().name}",
                        controllers=False)
    plane.apply(jobset_crds())
    yield plane
    plane.stop()


def _namespace(plane: Plane, name: str, labels: dict[str, str]) -> None:
    """A namespace and its `default` service account (a plane without a controller manager makes none)."""
    plane.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}},
                 {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}}])


def real_denials(plane: Plane, obj: dict) -> str:
    """'' when the API server stores `obj` (server-side dry run), else its message: a refusal by admission
    (403 Forbidden) or by the API's own validation (422 Invalid, which comes first: a hostPath with `..` never
    reaches the policies)."""
    try:
        plane.apply([obj], dry_run=True)
        return ""
    except ApiException as e:
        if e.status not in (403, 422):
            raise
        return f"{e.status} " + json.loads(e.body).get("message", str(e))


@pytest.fixture(scope="module")
def policies_by_fabric(bare):
    """The team namespace `team-research` (team label, Pod Security privileged so that only the policies decide),
    and a function that installs the policies one fabric's cases are written against."""
    _namespace(bare, cases.NS, {"gpu-train.io/team": "research", "pod-security.kubernetes.io/enforce": "privileged"})
    bare.apply([{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer", "namespace": cases.NS}}])
    installed = {}

    def install(kind: str) -> None:
        if installed.get("kind") == kind:
            return
        root, registries = (cases.AWS_ROOT, [cases.ECR]) if kind == "efa" else (cases.GCP_ROOT, [cases.AR])
        bare.apply(pod_admission.admission_policies(nvme_host_path=root, registries=registries))
        installed["kind"] = kind
        # The API server takes a changed policy up through its informers: wait until the fabric's own job, as
        # rendered, is admitted in every form (it is refused under the other fabric's policies).
        jobset = cases.base_jobset(kind)
        for form in ("Pod", "Job", "JobSet"):
            obj = cases.as_kind(jobset, form)
            obj["metadata"].setdefault("namespace", cases.NS)
            wait_for(f"the {kind} policies in force for a {form}", lambda o=obj: not real_denials(bare, o),
                     timeout=60)
    return install


# The cases sorted by fabric, so each fabric's policies are installed once.
ORDERED = sorted(cases.CASES, key=lambda c: c[1] == "efa")


@pytest.mark.parametrize("form", ["Pod", "Job", "JobSet"])
@pytest.mark.parametrize(("case", "kind", "mutate", "denied", "rule"), ORDERED, ids=[c[0] for c in ORDERED])
def test_the_cel_evaluator_agrees_with_the_api_server(bare, policies_by_fabric, case, kind, mutate, denied, rule,
                                                      form):
    policies_by_fabric(kind)
    jobset = cases.base_jobset(kind)
    if mutate is not None:
        mutate(cases._template(jobset)["spec"])
    obj = cases.as_kind(jobset, form)
    if form == "JobSet":
        obj.setdefault("metadata", {})["namespace"] = cases.NS
    admission, _, _ = cases.policies_for(kind)
    emulated = admission.denials(obj, cases.NS)
    real = real_denials(bare, obj)
    assert bool(real) == bool(emulated) == denied, (real, emulated)
    if rule and real.startswith("403"):
        assert f"denied request: {rule}:" in real, real


def _chart_pods() -> list[tuple[str, dict]]:
    """Every pod the pinned charts render for the stacks (tools/validation/chart_pods.py's record): its
    security-relevant fields."""
    out = []
    for path in sorted((ROOT / "tests" / "schemas" / "charts").glob("*.json")):
        for render in (json.loads(path.read_text()).get("pods") or {}).get("renders", []):
            for w in render["workloads"]:
                for i, p in enumerate(w["pods"]):
                    out.append((f"{path.stem}:{render['shape'][:6]}:{w['kind']}/{w['name']}[{i}]", p["pod"]))
    return out


CHART_PODS = _chart_pods()


@pytest.fixture(scope="module")
def psa_namespaces(bare):
    for level in LEVELS:
        _namespace(bare, f"psa-{level}", {"pod-security.kubernetes.io/enforce": level})
    return {level: f"psa-{level}" for level in LEVELS}


def _as_pod(pod: dict, namespace: str) -> dict:
    """A Pod the API server can store from the recorded fields: an image per container and a name where a volume
    source needs one (the record keeps only what Pod Security reads)."""
    spec = copy.deepcopy(pod.get("spec") or {})
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            c.setdefault("image", "registry.k8s.io/pause:3.10")
    for v in spec.get("volumes") or []:
        if "configMap" in v:
            v["configMap"].setdefault("name", "x")
        if "secret" in v:
            v["secret"].setdefault("secretName", "x")
        if "persistentVolumeClaim" in v:
            v["persistentVolumeClaim"].setdefault("claimName", "x")
        if len(v) == 1:
            v["emptyDir"] = {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**(pod.get("metadata") or {}), "name": "probe",
                                                           "namespace": namespace}, "spec": spec}


@pytest.mark.parametrize(("name", "pod"), CHART_PODS, ids=[n for n, _ in CHART_PODS])
def test_pod_security_levels_agree_with_the_api_server(bare, psa_namespaces, name, pod):
    for level, ns in psa_namespaces.items():
        obj = _as_pod(pod, ns)
        emulated = pod_security.evaluate(obj, level, "1.34")
        real = real_denials(bare, obj)
        assert bool(real) == bool(emulated), (level, real, emulated)
        if real:
            assert real.startswith("403") and "violates PodSecurity" in real, real
