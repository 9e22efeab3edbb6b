"""checkov and the policy pack agree on every Kubernetes object the plans write, for the classes both cover.

Usage: `.venv/bin/pytest tests/policies/test_checkov_agreement.py -q` (runs checkov 3.3.30 from
`.venv-checkov`, which `make tools` installs, once, offline with --skip-download).

checkov reads the YAML the plans write (`<plan>/<stack>/k8s/*.yaml`, the four stacks and the fabric
variants) with the objects' `checkov.io/skip` annotations removed, so it reports everything it would
flag, plus broken copies: the Kubernetes entries of the mutation table (tests/policies/mutations.py)
and a few more aimed at checks the table does not touch. Then:
- on a broken copy, every shared check that checkov newly fails is reported by the pack too;
- on a real object, every shared check checkov fails is reported by the pack, or the object is one of
  the pack's documented host agents and carries a checkov skip for that check: both tools exempt the
  same objects, for the same reasons;
- the documented differences (`DIFFERENCES`, repeated in docs/policies.md) hold as stated.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.plan import kubernetes_objects
from policies import pods
from policies.core import Context, Resource
from policies.registry import RULES
from tests.conftest import ROOT, STACKS, VARIANTS
from tests.policies.mutations import MUTATIONS

CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
CTX = Context(stack="agreement", environment="prod")
# checkov check -> the pack rules that cover the same class (one of them must report it).
SHARED: dict[str, set[str]] = {
    "CKV_K8S_16": {"pod-host-isolation"},  # privileged
    "CKV_K8S_17": {"pod-host-isolation"},  # hostPID
    "CKV_K8S_18": {"pod-host-isolation"},  # hostIPC
    "CKV_K8S_19": {"pod-host-isolation"},  # hostNetwork
    "CKV_K8S_20": {"pod-non-root", "training-pod-security"},  # allowPrivilegeEscalation
    "CKV_K8S_23": {"pod-non-root", "training-pod-security"},  # root containers
    "CKV_K8S_25": {"pod-host-isolation"},  # added capabilities (see DIFFERENCES)
    "CKV_K8S_26": {"pod-host-isolation"},  # hostPort
    "CKV_K8S_27": {"pod-host-isolation"},  # Docker socket hostPath
    "CKV_K8S_39": {"pod-host-isolation"},  # CAP_SYS_ADMIN
    "CKV_K8S_43": {"image-digest", "training-image-digest"},
    "CKV_K8S_10": {"container-requests"},  # CPU requests
    "CKV_K8S_12": {"container-requests"},  # memory requests
    "CKV_K8S_49": {"rbac-least-privilege"},  # wildcard roles
    "CKV_K8S_157": {"rbac-least-privilege"},  # bind
    "CKV_K8S_158": {"rbac-least-privilege"},  # escalate
}
# Differences between the two, each asserted below and listed in docs/policies.md.
DIFFERENCES = {
    "net-bind-service": "checkov CKV_K8S_25 fails any added capability; the pack allows NET_BIND_SERVICE, "
                        "the one capability the Pod Security Standards restricted profile allows.",
    "jobset": "checkov does not read JobSets (a custom resource), so training pods are checked by the pack alone.",
    "host-paths": "checkov's only hostPath check is the Docker socket (CKV_K8S_27); the pack allows a short "
                  "list of host paths and fails every other one.",
    "pack-only": "cluster-admin bindings, allow-all NetworkPolicies and public load balancers have no checkov "
                 "Kubernetes check.",
}


def _deployment(objs: list[dict]) -> dict:
    return next(o for o in objs if o.get("kind") == "Deployment" and not o["metadata"]["namespace"].startswith("team-"))


def _pod_of(obj: dict) -> dict:
    return pods.pod_specs(obj)[0][1]


def _first(obj: dict) -> dict:
    return _pod_of(obj)["containers"][0]


def _role(objs: list[dict]) -> dict:
    return next(o for o in objs if o.get("kind") == "Role")


# (id, mutation of a deep copy of the real objects of aws-prod -> the broken object, or (original, broken))
EXTRA = [
    ("deployment-host-network", lambda objs: _edit(_deployment(objs), lambda o: _pod_of(o).update(hostNetwork=True))),
    ("deployment-host-ipc", lambda objs: _edit(_deployment(objs), lambda o: _pod_of(o).update(hostIPC=True))),
    ("deployment-host-pid", lambda objs: _edit(_deployment(objs), lambda o: _pod_of(o).update(hostPID=True))),
    ("deployment-privileged", lambda objs: _edit(_deployment(objs), lambda o: _first(o)["securityContext"].update(
        privileged=True))),
    ("deployment-escalation", lambda objs: _edit(_deployment(objs), lambda o: _first(o)["securityContext"].update(
        allowPrivilegeEscalation=True))),
    ("deployment-sys-admin", lambda objs: _edit(_deployment(objs), lambda o: _first(o)["securityContext"][
        "capabilities"].update(add=["SYS_ADMIN"]))),
    ("deployment-docker-socket", lambda objs: _edit(_deployment(objs), lambda o: [
        _pod_of(o)["volumes"].append({"name": "docker", "hostPath": {"path": "/var/run/docker.sock"}}),
        _first(o)["volumeMounts"].append({"name": "docker", "mountPath": "/var/run/docker.sock"})])),
    ("deployment-no-resources", lambda objs: _edit(_deployment(objs), lambda o: _first(o).pop("resources"))),
    # The real Deployment pins by tag (an upstream image); its broken copy is that, next to a digest-pinned original.
    ("deployment-image-by-tag", lambda objs: (
        _edit(_deployment(objs), lambda o: _first(o).update(image=_first(o)["image"] + "@sha256:" + "0" * 64)),
        _deployment(objs))),
    ("role-bind", lambda objs: _edit(_role(objs), lambda o: o["rules"].append(
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"], "verbs": ["bind"]}))),
    ("role-escalate", lambda objs: _edit(_role(objs), lambda o: o["rules"].append(
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "verbs": ["escalate"]}))),
    # Documented differences:
    ("diff-net-bind-service", lambda objs: _edit(_deployment(objs), lambda o: _first(o)["securityContext"][
        "capabilities"].update(add=["NET_BIND_SERVICE"]))),
    ("diff-root-host-path", lambda objs: _edit(_deployment(objs), lambda o: [
        _pod_of(o)["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        _first(o)["volumeMounts"].append({"name": "root", "mountPath": "/host"})])),
]


def _edit(obj: dict, fn) -> dict:
    out = copy.deepcopy(obj)
    fn(out)
    return out


def _strip_skips(obj: dict) -> dict:
    out = copy.deepcopy(obj)
    notes = out.get("metadata", {}).get("annotations") or {}
    for key in [k for k in notes if k.startswith("checkov.io/skip")]:
        notes.pop(key)
    if not notes:
        out.get("metadata", {}).pop("annotations", None)
    return out


def _skipped(obj: dict) -> set[str]:
    notes = obj.get("metadata", {}).get("annotations") or {}
    return {str(v).split("=", 1)[0] for k, v in notes.items() if k.startswith("checkov.io/skip")}


def _as_resource(obj: dict) -> Resource:
    api = obj["apiVersion"]
    module = api if "/" in api else f"core/{api}"
    typ = f"kubernetes:{module}:{obj['kind']}"
    return Resource(type=typ, name=obj["metadata"]["name"], urn=f"urn:agreement::{typ}::{obj['metadata']['name']}",
                    props=obj)


def pack_flags(obj: dict) -> set[str]:
    """The resource-scoped rules of the pack that report this one object."""
    res = _as_resource(obj)
    return {r.id for r in RULES if r.scope == "resource" and list(r.run([res], CTX))}


def _run_checkov(objects: dict[str, dict], work: Path) -> dict[str, set[str]]:
    assert CHECKOV.exists(), f"{CHECKOV} is missing: run `make tools` (checkov lives in its own virtualenv)"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name, obj in objects.items():
        (work / f"{name}.yaml").write_text(yaml.safe_dump(obj, sort_keys=False))
    proc = subprocess.run([str(CHECKOV), "-d", str(work), "--framework", "kubernetes", "--skip-download",
                           "--quiet", "-o", "json"], capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), f"checkov printed nothing (rc {proc.returncode}): {proc.stderr[-2000:]}"
    reports = json.loads(proc.stdout)
    failed: dict[str, set[str]] = {name: set() for name in objects}
    for report in reports if isinstance(reports, list) else [reports]:
        assert report.get("summary", report)["parsing_errors"] == 0, report.get("summary")
        for f in report.get("results", {}).get("failed_checks", []):
            failed[Path(f["file_path"]).stem].add(f["check_id"])
    return failed


def _changed_objects(before: dict, after: dict) -> list[dict]:
    """The Kubernetes objects, as the plan writes them, of resources a mutation changed."""
    old = {r["urn"]: r["inputs"] for r in before["resources"]}
    changed = [r for r in after["resources"] if r["urn"] in old and r["inputs"] != old[r["urn"]]]
    return kubernetes_objects({"resources": changed})


@pytest.fixture(scope="module")
def agreement(plan_dir, variant_plan_dir, plans, tmp_path_factory) -> dict[str, Any]:
    real: dict[str, dict] = {}
    for base, names in ((plan_dir, STACKS), (variant_plan_dir, sorted(VARIANTS))):
        for stack in names:
            for f in sorted((base / stack / "k8s").glob("*.yaml")):
                real[f"real--{stack}--{f.stem}"] = yaml.safe_load(f.read_text())
    assert len(real) > 400, len(real)
    broken: dict[str, tuple[dict, dict]] = {}  # name -> (original, broken copy)
    for m in MUTATIONS:
        plan = copy.deepcopy(plans[m.stack])
        m.mutate(plan)
        originals = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
                     for o in kubernetes_objects(plans[m.stack])}
        for i, obj in enumerate(_changed_objects(plans[m.stack], plan)):
            key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
            original = originals.get(key) or next(o for o in kubernetes_objects(plans[m.stack])
                                                  if o["kind"] == obj["kind"] and o["metadata"]["name"] == obj["metadata"]["name"])
            broken[f"broken--{m.id}--{i}"] = (original, obj)
    aws_objects = kubernetes_objects(plans["aws-prod"])
    for name, fn in EXTRA:
        made = fn(copy.deepcopy(aws_objects))
        original, obj = made if isinstance(made, tuple) else (
            next(o for o in aws_objects if o["kind"] == made["kind"] and o["metadata"] == made["metadata"]), made)
        broken[f"broken--{name}"] = (original, obj)
    inputs = {name: _strip_skips(o) for name, o in real.items()}
    for name, (original, obj) in broken.items():
        inputs[name] = _strip_skips(obj)
        inputs[f"{name}--original"] = _strip_skips(original)
    failed = _run_checkov(inputs, tmp_path_factory.mktemp("checkov") / "in")
    return {"real": real, "broken": broken, "failed": failed}


def test_checkov_read_every_object(agreement):
    assert set(agreement["failed"]) >= set(agreement["real"])
    assert any(agreement["failed"][n] for n in agreement["real"]), "checkov flagged nothing: did it run?"


def test_what_checkov_newly_flags_on_a_broken_copy_the_pack_flags_too(agreement):
    seen: set[str] = set()
    for name, (_, obj) in agreement["broken"].items():
        new = (agreement["failed"][name] - agreement["failed"][f"{name}--original"]) & set(SHARED)
        if name.startswith("broken--diff-"):
            continue
        flagged = pack_flags(obj)
        for check in new:
            assert flagged & SHARED[check], f"{name}: checkov fails {check}, the pack reports only {sorted(flagged)}"
        seen |= new
    # The comparison is not vacuous: the broken copies make checkov fail every shared check.
    assert seen == set(SHARED), sorted(set(SHARED) - seen)


def test_on_the_real_objects_both_tools_flag_or_exempt_the_same_things(agreement):
    for name, obj in agreement["real"].items():
        failing = agreement["failed"][name] & set(SHARED)
        flagged = pack_flags(obj)
        for check in failing:
            if flagged & SHARED[check]:
                continue  # both report it (e.g. the advisory image-digest on tag-pinned upstream images)
            assert pods.host_agent(obj) is not None, f"{name}: checkov fails {check}, the pack passes it"
            assert check in _skipped(obj), f"{name}: the pack exempts {check} but the object has no checkov skip"
        for check in _skipped(obj) & set(SHARED):
            assert pods.host_agent(obj) is not None or flagged & SHARED[check], \
                f"{name}: checkov skip {check} has no counterpart exemption in the pack"


def test_documented_differences_hold(agreement):
    failed, broken = agreement["failed"], agreement["broken"]
    assert "CKV_K8S_25" in failed["broken--diff-net-bind-service"]
    assert "pod-host-isolation" not in pack_flags(broken["broken--diff-net-bind-service"][1])
    root = "broken--diff-root-host-path"
    assert failed[root] - failed[f"{root}--original"] == set()
    assert "pod-host-isolation" in pack_flags(broken[root][1])
    jobsets = [n for n, (_, o) in broken.items() if o["kind"] == "JobSet" and n.startswith("broken--training-")]
    assert jobsets and all(failed[n] == set() for n in jobsets)
    assert all(pack_flags(broken[n][1]) for n in jobsets)
    for m in ("team-binding-cluster-admin", "allow-all-beside-default-deny", "service-load-balancer"):
        name = f"broken--{m}--0"
        assert failed[name] - failed[f"{name}--original"] == set(), name
    assert set(DIFFERENCES) == {"net-bind-service", "jobset", "host-paths", "pack-only"}
    docs = (ROOT / "docs" / "policies.md").read_text()
    assert "NET_BIND_SERVICE" in docs and "JobSet" in docs and "CKV_K8S_27" in docs
