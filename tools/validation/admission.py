"""Every pod the plan installs, held against what admits it: its namespace's Pod Security level and, in team
namespaces, the platform's own ValidatingAdmissionPolicies.

Usage:
    from tools.validation import admission
    result = admission.check_plan(plan)          # plan: the JSON `python -m infra.plan` writes
    result.problems                              # one line per refused pod: release/component, workload, field, level
    result.notes                                 # what was judged against a default (namespaces the plan does not create)
    python -m tools.validation build/plan/*.json # runs it with the chart and CRD checks

Workloads come from two places. Those the program renders itself (typed DaemonSets, Deployments, Jobs, the
JobSet, ... in the plan) are judged from the plan directly; an InferenceService by the predictor pod KServe makes
of it (gpu_train.jobs.serving.predictor_pod, with the storage initializer of the ClusterStorageContainer it names). A Helm release's workloads are read from its
chart's snapshot (tests/schemas/charts/<chart>-<version>.json, `pods`: what `helm template` rendered for the
same shape of values, recorded by `make schemas`, tools/validation/chart_pods.py); a release whose values'
shape has no recorded render fails, naming the keys that differ, until `make schemas` records it.

A namespace's level is its `pod-security.kubernetes.io/enforce` label (and `enforce-version`, else the
stack's Kubernetes version). A namespace the plan does not create (kube-system, one a release creates)
carries no label, so the API server's default applies: `privileged` on EKS and GKE, which configure no
cluster-wide Pod Security default (https://kubernetes.io/docs/concepts/security/pod-security-admission/).
The pods are judged by tools.validation.pod_security (a port of k8s.io/pod-security-admission); the
policies by evaluating their CEL with cel-python on each pod, as a Pod, and on each Job and JobSet as itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import celpy
from celpy import celtypes

from tools.validation import chart_pods, helm, pod_security

ENFORCE = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION = "pod-security.kubernetes.io/enforce-version"
DEFAULT_LEVEL = "privileged"
# kind -> (API group, resource) as admission policies' resourceRules name them.
RESOURCES = {"Pod": ("", "pods"), "Job": ("batch", "jobs"), "JobSet": ("jobset.x-k8s.io", "jobsets"),
             "Deployment": ("apps", "deployments"), "DaemonSet": ("apps", "daemonsets"),
             "StatefulSet": ("apps", "statefulsets"), "CronJob": ("batch", "cronjobs")}


@dataclass(frozen=True)
class Namespace:
    name: str
    level: str
    version: str
    labels: Mapping[str, str]
    created: bool  # a Namespace of the plan (else the cluster's default level applies)


@dataclass(frozen=True)
class Workload:
    origin: str  # "release monitoring/kube-prometheus-stack (kube-prometheus-stack 88.5.3)" or "component ..."
    kind: str
    name: str
    namespace: str
    pods: tuple[tuple[str, Mapping[str, Any]], ...]  # (where in the object, pod)
    obj: Mapping[str, Any] | None = None  # the whole object, for policies that admit its kind


@dataclass
class Result:
    stack: str
    workloads: list[Workload] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def kube_version(stack: str, default: str = "1.33") -> str:
    from tools.validation.cluster import ROOT, stack_kube_version

    if (ROOT / "stacks" / f"Pulumi.{stack}.yaml").is_file():
        return ".".join(stack_kube_version(stack).split(".")[:2])
    return default


def namespaces(plan: Mapping[str, Any], version: str) -> dict[str, Namespace]:
    out = {}
    for res in plan.get("resources") or []:
        if res.get("type") != "kubernetes:core/v1:Namespace":
            continue
        meta = (res.get("inputs") or {}).get("metadata") or {}
        labels = dict(meta.get("labels") or {})
        ver = labels.get(ENFORCE_VERSION, "latest")
        out[meta["name"]] = Namespace(meta["name"], labels.get(ENFORCE, DEFAULT_LEVEL),
                                      version if ver == "latest" else ver.lstrip("v"), labels, True)
    return out


def _k8s_object(res: Mapping[str, Any]) -> dict[str, Any] | None:
    typ = str(res.get("type") or "")
    inputs = res.get("inputs") or {}
    if not typ.startswith("kubernetes:") or typ.startswith("kubernetes:helm.sh"):
        return None
    kind = inputs.get("kind") or typ.rsplit(":", 1)[-1]
    return {**inputs, "kind": kind} if kind in pod_security.TEMPLATE_PATHS else None


def _inference_services(plan: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], dict[str, Any]]]:
    """(resource, the predictor pod KServe runs) for each InferenceService of the plan, with the storage initializer
    of the ClusterStorageContainer it names (gpu_train.jobs.serving.predictor_pod); a missing container is a
    KeyError naming it."""
    from gpu_train.jobs.serving import predictor_pod

    objects = [(res, {**(res.get("inputs") or {}), "kind": str(res.get("type")).rsplit(":", 1)[-1]})
               for res in plan.get("resources") or [] if str(res.get("type") or "").startswith("kubernetes:serving.kserve.io")]
    storage = {o["metadata"]["name"]: o for _, o in objects if o["kind"] == "ClusterStorageContainer"}
    out = []
    for res, isvc in objects:
        if isvc["kind"] != "InferenceService":
            continue
        wanted = isvc["spec"]["predictor"].get("storageContainerName", "")
        if wanted not in storage:
            raise KeyError(f"InferenceService {isvc['metadata']['name']} names ClusterStorageContainer {wanted!r}, "
                           "which the plan does not create")
        out.append((res, predictor_pod(isvc, storage[wanted])))
    return out


def plan_workloads(plan: Mapping[str, Any]) -> list[Workload]:
    """The workloads the program renders itself, with the component that creates each; an InferenceService's is
    the predictor pod KServe's controller and webhook make of it."""
    out = []
    for res, pod in _inference_services(plan):
        meta = (res.get("inputs") or {}).get("metadata") or {}
        parent = str(res.get("parent") or "").rsplit("::", 1)[-1]
        out.append(Workload(f"component {parent or res.get('name')}", "InferenceService", str(meta.get("name")),
                            str(meta.get("namespace") or "default"), (("spec.predictor, as KServe runs it", pod),)))
    for res in plan.get("resources") or []:
        obj = _k8s_object(res)
        if obj is None:
            continue
        meta = obj.get("metadata") or {}
        parent = str(res.get("parent") or "").rsplit("::", 1)[-1]
        out.append(Workload(f"component {parent or res.get('name')}", obj["kind"], str(meta.get("name")),
                            str(meta.get("namespace") or "default"), tuple(pod_security.pod_templates(obj)), obj))
    return out


def _nearest(lines: Sequence[str], renders: Sequence[Mapping[str, Any]]) -> str:
    """How the values differ from the nearest recorded shape: the key paths (with their type or kept value)
    each side has and the other lacks."""
    best = min(renders, key=lambda r: len(set(lines) ^ set(r["valuesShape"])))
    new, gone = sorted(set(lines) - set(best["valuesShape"])), sorted(set(best["valuesShape"]) - set(lines))
    parts = ([f"the plan has {new[:6]}"] if new else []) + ([f"the render has {gone[:6]}"] if gone else [])
    return f"nearest render, recorded for {', '.join(best['stacks'])}: " + "; ".join(parts)


def release_workloads(release: helm.Release, snapshots: helm.Snapshots,
                      stack: str = "") -> tuple[list[Workload], list[str]]:
    """A release's workloads from its chart snapshot's recorded render for the same values shape (those rendered
    for this stack where the shape was rendered for it, else every stack's); else a problem naming the release
    and what changed."""
    snap = snapshots.chart(release.chart_name, release.version)
    label = f"release {release.namespace}/{release.name} ({release.chart_name} {release.version})"
    if snap is None or not (snap.get("pods") or {}).get("renders"):
        return [], [f"{label}: tests/schemas/charts/{release.chart_name}-{release.version}.json records no "
                    "workloads (pods): run make schemas"]
    lines = chart_pods.values_shape(release.values)
    render = next((r for r in snap["pods"]["renders"] if r["shape"] == chart_pods.shape_id(lines)), None)
    if render is None:
        return [], [f"{label}: the values' shape has no recorded render in the chart snapshot, so what the chart "
                    f"renders is not known ({_nearest(lines, snap['pods']['renders'])}): run make schemas"]
    chosen = [w for w in render["workloads"] if stack in w.get("stacks", ())] or render["workloads"]
    out = [Workload(label, w["kind"], w["name"], w["namespace"] or release.namespace or "default",
                    tuple((p["where"], p["pod"]) for p in w["pods"]))
           for w in chosen]
    return out, []


# ----------------------------------------------------------------------- the platform's admission policies

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(expression: str) -> Any:
    if expression not in _PROGRAMS:
        _PROGRAMS[expression] = _ENV.program(_ENV.compile(expression))
    return _PROGRAMS[expression]


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics; an absent selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


class Policies:
    """The plan's ValidatingAdmissionPolicies with a Deny binding, evaluated like the API server: matched by
    resource and by the binding's namespace selector; an evaluation error is a denial (failurePolicy Fail)."""

    def __init__(self, objects: Sequence[Mapping[str, Any]]):
        policies = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ValidatingAdmissionPolicy"}
        self.bound = [(policies[b["spec"]["policyName"]], (b["spec"].get("matchResources") or {}).get(
                       "namespaceSelector")) for b in objects if b.get("kind") == "ValidatingAdmissionPolicyBinding"
                      and "Deny" in (b["spec"].get("validationActions") or []) and b["spec"]["policyName"] in policies]

    def denials(self, obj: Mapping[str, Any], namespace: Namespace) -> list[str]:
        group, resource = RESOURCES.get(str(obj.get("kind")), ("?", "?"))
        out = []
        for policy, ns_selector in self.bound:
            rules = ((policy["spec"].get("matchConstraints") or {}).get("resourceRules") or [])
            if not any(group in r.get("apiGroups", []) and resource in r.get("resources", []) for r in rules):
                continue
            if not _selects(ns_selector, {**namespace.labels, "kubernetes.io/metadata.name": namespace.name}):
                continue
            activation: dict[str, Any] = {"object": celpy.json_to_cel(dict(obj)), "request": celpy.json_to_cel(
                {"namespace": namespace.name, "operation": "CREATE"})}
            variables = {celtypes.StringType(v["name"]): _program(v["expression"]).evaluate(activation)
                         for v in policy["spec"].get("variables") or []}
            activation["variables"] = celtypes.MapType(variables)
            for validation in policy["spec"]["validations"]:
                try:
                    result = _program(validation["expression"]).evaluate(activation)
                except celpy.CELEvalError as exc:
                    result = exc
                if result is not True and not (isinstance(result, celtypes.BoolType) and bool(result)):
                    out.append(f"{policy['metadata']['name']}: {validation.get('message', validation['expression'])}")
        return out


def policy_objects(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    return [{**(r.get("inputs") or {}), "kind": r["type"].rsplit(":", 1)[-1]} for r in plan.get("resources") or []
            if str(r.get("type") or "").rsplit(":", 1)[-1] in kinds]


# ------------------------------------------------------------------------------------------------ judge


def judge(workload: Workload, ns: Namespace, policies: Policies) -> list[str]:
    """One line per refusal: the origin, the workload, the level or policy, the offending fields."""
    out = []
    head = f"{workload.origin}: {workload.kind} {workload.namespace}/{workload.name}"
    for where, pod in workload.pods:
        at = f" ({where})" if where else ""
        for v in pod_security.evaluate(pod, ns.level, ns.version):
            out.append(f"{head}{at}: namespace {ns.name} enforces Pod Security {ns.level!r}, which refuses "
                       f"{v.reason} [{v.check}]: {', '.join(v.fields)}")
        as_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**pod.get("metadata", {}), "namespace": ns.name,
                                                                  "name": f"{workload.name}-pod"},
                  "spec": pod.get("spec", {})}
        for d in policies.denials(as_pod, ns):
            out.append(f"{head}{at}: its pods are refused in namespace {ns.name} by admission policy {d}")
    if workload.obj is not None and workload.kind != "Pod":
        for d in policies.denials(workload.obj, ns):
            out.append(f"{head}: refused in namespace {ns.name} by admission policy {d}")
    return out


def check_plan(plan: Mapping[str, Any], snapshots: helm.Snapshots | None = None) -> Result:
    snaps = snapshots or helm.Snapshots()
    stack = str(plan.get("stack"))
    version = kube_version(stack)
    result = Result(stack)
    known = namespaces(plan, version)
    policies = Policies(policy_objects(plan))
    result.workloads += plan_workloads(plan)
    for release in helm.releases(plan):
        found, problems = release_workloads(release, snaps, stack)
        result.workloads += found
        result.problems += problems
    for w in result.workloads:
        ns = known.get(w.namespace)
        if ns is None:
            ns = known.setdefault(w.namespace, Namespace(w.namespace, DEFAULT_LEVEL, version, {}, False))
            result.notes.append(f"namespace {w.namespace} is not created by the plan: its workloads are judged "
                                f"at the cluster's default Pod Security level, {DEFAULT_LEVEL!r}")
        result.problems += judge(w, ns, policies)
    return result
