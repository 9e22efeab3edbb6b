"""A local HTTP server that answers like the Kubernetes API server the CLI talks to, for the CLI tests.

Usage:
    with FakeApi(users={"alice-token": ("alice", {"team-research": "submitter"})}) as api:
        api.put_configmap(...); api.add_pod(...)
        kubeconfig = api.kubeconfig(tmp_path, token="alice-token", namespace="team-research")
        ... run gpu-train with --kubeconfig kubeconfig ...
        api.requests    # every request: (method, path, query, body)

What makes it answer like the real API rather than like the CLI expects:
- authentication: a bearer token of a known user, else 401 with a Status body;
- authorization: the request is mapped to (API group, resource/subresource, verb, name) as the API server's
  RBAC authorizer sees it, and allowed only if the user's role in that namespace (the platform's own Role
  rules, infra.k8s.tenancy.submitter_rules / viewer_rules) grants it, else 403 with the API server's message;
- what the CLI sends is checked like the API server does: a JobSet against the JobSet CRD at the pinned
  version (tools.validation.crd, tests/schemas/crds), a Workload after a merge patch against the Workload
  CRD, and both through the team namespaces' ValidatingAdmissionPolicies when given (422 Invalid on a denial,
  with the API server's wording);
- errors are Status objects with the real reasons and codes (NotFound 404, AlreadyExists 409, Invalid 422);
- lists carry apiVersion/kind/metadata; created objects get a uid, resourceVersion and creationTimestamp; and,
  like Kueue, a created JobSet gets a Workload it owns, labelled with its UID;
- serving: InferenceServices (checked against KServe's CRD, and reported Ready at once, as KServe does once its
  pods are ready), the routes' ConfigMaps, Deployments and Services (created, replaced with PUT, patched), Events,
  and a predictor's answer through the service proxy (`completions`); roles `serving-submitter` and
  `serving-viewer` are the team roles of a stack that serves, `promoter` the promotion loop's own Role,
  `sweep-controller` the in-cluster sweep controller's.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import re
import threading
import uuid
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from gpu_train.jobs.serving_platform import promoter_rules
from gpu_train.jobs.sweep_platform import sweep_controller_rules
from infra.k8s import tenancy
from tests.infra.k8s.vap import Admission
from tools.validation import crd

NOW = "2026-03-01T10:00:00Z"
# Kinds the team namespaces' admission policies admit (tests/infra/k8s/vap.py).
ADMITTED = ("Pod", "Job", "JobSet")
ROLES = {"submitter": tenancy.submitter_rules, "viewer": tenancy.viewer_rules,
         "serving-submitter": lambda: tenancy.submitter_rules() + tenancy.serving_submitter_rules(),
         "serving-viewer": lambda: tenancy.viewer_rules() + tenancy.serving_viewer_rules(),
         "promoter": promoter_rules, "sweep-controller": sweep_controller_rules}
PLURAL_KIND = {"jobsets": "JobSet", "workloads": "Workload", "configmaps": "ConfigMap", "pods": "Pod",
               "services": "Service", "events": "Event", "deployments": "Deployment",
               "inferenceservices": "InferenceService"}
API_VERSIONS = {"": "v1", "jobset.x-k8s.io": "jobset.x-k8s.io/v1alpha2", "kueue.x-k8s.io": "kueue.x-k8s.io/v1beta2",
                "apps": "apps/v1", "serving.kserve.io": "serving.kserve.io/v1beta1"}
CRD_KINDS = ("JobSet", "Workload", "InferenceService")
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


def status(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, **({"details": dict(details)} if details else {}), "code": code}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what application/merge-patch+json means to the API server)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def allowed(rules: Sequence[Mapping[str, Any]], group: str, resource: str, verb: str, name: str) -> bool:
    """Kubernetes RBAC: some rule names the group, the resource (or resource/subresource), the verb and, if it
    lists resourceNames, the name."""
    for rule in rules:
        if group in rule.get("apiGroups", []) and resource in rule.get("resources", []) \
                and verb in rule.get("verbs", []) and (not rule.get("resourceNames") or name in rule["resourceNames"]):
            return True
    return False


class FakeApi:
    def __init__(self, users: Mapping[str, tuple[str, Mapping[str, str]]], policies: Sequence[Mapping[str, Any]] = (),
                 make_workloads: bool = True):
        self.users = dict(users)  # token -> (user name, {namespace: "submitter" | "viewer"})
        self.admission = Admission(list(policies)) if policies else None
        self.make_workloads = make_workloads
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, namespace, name) -> object
        self.logs: dict[tuple[str, str, str], str] = {}
        self.metrics: dict[tuple[str, str, int], str] = {}
        self.pending: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.visibility_served = True
        self.completions: dict[tuple[str, str], str] = {}  # (namespace, service) -> a predictor's completion
        self.requests: list[tuple[str, str, dict[str, list[str]], Any]] = []
        self.server: ThreadingHTTPServer | None = None

    # ---------------------------------------------------------------- fixtures

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", "1")
        meta.setdefault("creationTimestamp", NOW)
        self.objects[(plural, meta.get("namespace", ""), meta["name"])] = obj
        return obj

    def put_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        self.put("configmaps", {"apiVersion": "v1", "kind": "ConfigMap",
                                "metadata": {"name": name, "namespace": namespace}, "data": dict(data)})

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((plural, namespace, name))

    def of(self, plural: str, namespace: str) -> list[dict[str, Any]]:
        return [o for (p, ns, _), o in sorted(self.objects.items()) if p == plural and ns == namespace]

    # ---------------------------------------------------------------- kueue, as it reacts to a JobSet

    def workload_for(self, jobset: Mapping[str, Any]) -> dict[str, Any]:
        meta = jobset["metadata"]
        rjob = jobset["spec"]["replicatedJobs"][0]
        spec = rjob["template"]["spec"]
        # pkg/controller/jobframework: GetWorkloadNameForOwnerWithGVK -> <kind>-<name>-<hash of the uid>
        name = f"jobset-{meta['name']}-{hashlib.sha256(meta['uid'].encode()).hexdigest()[:5]}"
        return {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": name, "namespace": meta["namespace"],
                         "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                         "ownerReferences": [{"apiVersion": jobset["apiVersion"], "kind": "JobSet", "name": meta["name"],
                                              "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"active": True, "queueName": meta["labels"]["kueue.x-k8s.io/queue-name"],
                     "podSets": [{"name": rjob["name"], "count": spec["parallelism"], "template": spec["template"]}]},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                       "message": "couldn't assign flavors to pod set worker: insufficient unused "
                                                  "quota for nvidia.com/gpu in flavor l4-spot, 2 more needed",
                                       "lastTransitionTime": NOW, "observedGeneration": 1}]},
        }

    # ---------------------------------------------------------------- serving

    def kubeconfig(self, directory: Path, token: str, namespace: str = "", name: str = "fake") -> Path:
        context = {"cluster": name, "user": name, **({"namespace": namespace} if namespace else {})}
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": name,
               "clusters": [{"name": name, "cluster": {"server": self.url}}],
               "contexts": [{"name": name, "context": context}],
               "users": [{"name": name, "user": {"token": token}}]}
        path = directory / f"kubeconfig-{name}-{token}"
        path.write_text(yaml.safe_dump(doc))
        return path

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                api.requests.append((method, unquote(parts.path), query, body))
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                if token not in api.users:
                    self._send(401, status(401, "Unauthorized", "Unauthorized"))
                    return
                user, roles = api.users[token]
                code, out, ctype = api.route(method, unquote(parts.path), query, body, self.headers, user, roles)
                self._send(code, out, ctype)

        for verb in ("GET", "POST", "PATCH", "DELETE", "PUT"):  # do_GET, ...: what BaseHTTPRequestHandler calls
            setattr(Handler, f"do_{verb}", lambda handler, verb=verb: handler._handle(verb))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    # ---------------------------------------------------------------- routing

    ROUTES = [
        (r"/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>configmaps|pods|services|events)(/(?P<name>[^/:]+))?", ""),
        (r"/api/v1/namespaces/(?P<ns>[^/]+)/services/(?P<name>[^/:]+):(?P<port>[0-9]+)/proxy/(?P<path>.*)", "svcproxy"),
        (r"/apis/(?P<group>apps)/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>deployments)(/(?P<name>[^/]+))?", ""),
        (r"/apis/(?P<group>serving\.kserve\.io)/v1beta1/namespaces/(?P<ns>[^/]+)/(?P<plural>inferenceservices)"
         r"(/(?P<name>[^/]+))?", ""),
        (r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/:]+)/log", "log"),
        (r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/:]+):(?P<port>[0-9]+)/proxy/(?P<path>.*)", "proxy"),
        (r"/apis/(?P<group>jobset\.x-k8s\.io)/v1alpha2/namespaces/(?P<ns>[^/]+)/(?P<plural>jobsets)(/(?P<name>[^/]+))?",
         ""),
        (r"/apis/(?P<group>kueue\.x-k8s\.io)/v1beta2/namespaces/(?P<ns>[^/]+)/(?P<plural>workloads)(/(?P<name>[^/]+))?",
         ""),
        (r"/apis/visibility\.kueue\.x-k8s\.io/v1beta2/namespaces/(?P<ns>[^/]+)/localqueues/(?P<name>[^/]+)"
         r"/pendingworkloads", "pending"),
    ]

    def route(self, method: str, path: str, query: dict[str, list[str]], body: Any, headers: Any, user: str,
              roles: Mapping[str, str]) -> tuple[int, Any, str]:
        found = next(((m, sub) for pattern, sub in self.ROUTES if (m := re.fullmatch(pattern, path))), None)
        if found is None:
            return 404, status(404, "NotFound", "the server could not find the requested resource"), "application/json"
        m, sub = found
        g = m.groupdict()
        ns, name = g["ns"], g.get("name") or ""
        group = g.get("group") or ("visibility.kueue.x-k8s.io" if sub == "pending" else "")
        plural = {"log": "pods", "proxy": "pods", "pending": "localqueues", "svcproxy": "services"}.get(
            sub, g.get("plural") or "")
        subresource = {"log": "log", "proxy": "proxy", "pending": "pendingworkloads", "svcproxy": "proxy"}.get(sub)
        resource = f"{plural}/{subresource}" if subresource else plural
        verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}.get(method) or (
            "get" if name else "list")
        role = roles.get(ns)
        if role is None or not allowed(ROLES[role](), group, resource, verb, name):
            what = f"{plural}.{group}" if group else plural
            msg = (f'{what}{f" {json.dumps(name)}" if name else ""} is forbidden: User "{user}" cannot {verb} '
                   f'resource "{resource}" in API group "{group}" in the namespace "{ns}"')
            return 403, status(403, "Forbidden", msg, {"name": name, "group": group, "kind": plural}), "application/json"
        if sub == "log":
            text = self.logs.get((ns, name, (query.get("container") or [""])[0]))
            if text is None:
                return 404, status(404, "NotFound", f'pods "{name}" not found'), "application/json"
            lines = text.splitlines(keepends=True)
            tail = query.get("tailLines")
            return 200, "".join(lines[-int(tail[0]):] if tail else lines), "text/plain"
        if sub == "proxy":
            text = self.metrics.get((ns, name, int(g["port"])))
            if text is None or g["path"] != "metrics":
                return 503, status(503, "ServiceUnavailable", "error trying to reach service: dial tcp: connect: "
                                   "connection refused"), "application/json"
            return 200, text, "text/plain; version=0.0.4"
        if sub == "svcproxy":
            answer = self.completions.get((ns, name))
            if answer is None or g["path"] != "openai/v1/completions":
                return 503, status(503, "ServiceUnavailable", "no endpoints available for service"), "application/json"
            return 200, {"choices": [{"index": 0, "text": answer, "finish_reason": "length"}]}, "application/json"
        if sub == "pending":
            if not self.visibility_served:
                return 503, status(503, "ServiceUnavailable", "the server is currently unable to handle the request"), \
                    "application/json"
            return 200, {"kind": "PendingWorkloadsSummary", "apiVersion": "visibility.kueue.x-k8s.io/v1beta2",
                         "metadata": {"creationTimestamp": None}, "items": self.pending.get((ns, name), [])}, \
                "application/json"
        kind = PLURAL_KIND[plural]
        api_version = API_VERSIONS[group]
        what = f"{plural}.{group}" if group else plural
        if method == "GET" and not name:
            selector = (query.get("labelSelector") or [""])[0]
            items = [o for o in self.of(plural, ns) if selector_matches(selector, o["metadata"].get("labels") or {})]
            return 200, {"apiVersion": api_version, "kind": f"{kind}List", "metadata": {"resourceVersion": "9"},
                         "items": items}, "application/json"
        existing = self.get(plural, ns, name) if name else None
        if method == "GET":
            if existing is None:
                return 404, status(404, "NotFound", f'{what} "{name}" not found', {"name": name, "kind": plural}), \
                    "application/json"
            return 200, existing, "application/json"
        if method == "DELETE":
            if existing is None:
                return 404, status(404, "NotFound", f'{what} "{name}" not found', {"name": name, "kind": plural}), \
                    "application/json"
            del self.objects[(plural, ns, name)]
            for key, wl in list(self.objects.items()):  # garbage collection of what it owned
                if any(r.get("uid") == existing["metadata"]["uid"] for r in wl["metadata"].get("ownerReferences") or []):
                    del self.objects[key]
            return 200, {**existing, "metadata": {**existing["metadata"], "deletionTimestamp": NOW}}, "application/json"
        if method == "POST":
            obj = body or {}
            oname = (obj.get("metadata") or {}).get("name", "")
            problems = crd.validate(obj).problems if kind in CRD_KINDS else []
            if problems:
                return 422, status(422, "Invalid", f'{kind}.{group} "{oname}" is invalid: {"; ".join(problems)}'), \
                    "application/json"
            if (obj.get("metadata") or {}).get("namespace", ns) != ns:
                return 400, status(400, "BadRequest", "the namespace of the provided object does not match the "
                                   "namespace sent on the request"), "application/json"
            if self.admission is not None and kind in ADMITTED:
                denied = self.admission.denials(obj, ns)
                if denied:
                    return 422, status(422, "Invalid", f'{what} "{oname}" is forbidden: ValidatingAdmissionPolicy '
                                       f"'gpu-train-team-{plural}' with binding 'gpu-train-team-{plural}' denied "
                                       f"request: {denied[0]}"), "application/json"
            if self.get(plural, ns, oname) is not None:
                return 409, status(409, "AlreadyExists", f'{what} "{oname}" already exists',
                                   {"name": oname, "group": group, "kind": plural}), "application/json"
            if kind == "Event" and not (obj.get("metadata") or {}).get("name"):
                oname = f"{obj['metadata']['generateName']}{uuid.uuid4().hex[:5]}"
                obj = {**obj, "metadata": {**obj["metadata"], "name": oname}}
            stored = self.put(plural, {**obj, "metadata": {**obj["metadata"], "namespace": ns}})
            if kind == "InferenceService":  # KServe reports it Ready once its pods are
                stored["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
            if kind == "JobSet" and self.make_workloads:
                self.put("workloads", self.workload_for(stored))
            return 201, stored, "application/json"
        if method == "PUT":
            if existing is None:
                return 404, status(404, "NotFound", f'{what} "{name}" not found'), "application/json"
            if (body.get("metadata") or {}).get("resourceVersion") != existing["metadata"]["resourceVersion"]:
                return 409, status(409, "Conflict", f'Operation cannot be fulfilled on {what} "{name}": the object '
                                   "has been modified; please apply your changes to the latest version and try again"), \
                    "application/json"
            problems = crd.validate(body).problems if kind in CRD_KINDS else []
            if problems:
                return 422, status(422, "Invalid", f'{kind}.{group} "{name}" is invalid: {"; ".join(problems)}'), \
                    "application/json"
            replaced = copy.deepcopy(body)
            replaced["metadata"] = {**existing["metadata"], **body["metadata"],
                                    "resourceVersion": str(int(existing["metadata"]["resourceVersion"]) + 1)}
            if kind == "InferenceService":
                replaced["status"] = existing.get("status", {})
            self.objects[(plural, ns, name)] = replaced
            return 200, replaced, "application/json"
        if method == "PATCH":
            if existing is None:
                return 404, status(404, "NotFound", f'{what} "{name}" not found'), "application/json"
            if headers.get("Content-Type") not in PATCH_TYPES:
                return 415, status(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                                   "accepted media types include: application/merge-patch+json"), "application/json"
            patched = merge_patch(existing, body)
            problems = crd.validate(patched).problems if kind in CRD_KINDS else []
            if problems:
                return 422, status(422, "Invalid", f'{kind}.{group} "{name}" is invalid: {"; ".join(problems)}'), \
                    "application/json"
            patched["metadata"]["resourceVersion"] = str(int(existing["metadata"]["resourceVersion"]) + 1)
            self.objects[(plural, ns, name)] = patched
            return 200, patched, "application/json"
        return 405, status(405, "MethodNotAllowed", method), "application/json"


def pod(jobset: Mapping[str, Any], rank: int, phase: str = "Running", suffix: str = "x7k2p", node: str = "ip-10-0-1-1",
        restarts: int = 0, created: str = NOW) -> dict[str, Any]:
    """A pod as the Job controller makes it from the JobSet's template: name, labels and status."""
    name = jobset["metadata"]["name"]
    tpl = copy.deepcopy(jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
    labels = {**tpl["metadata"]["labels"], "jobset.sigs.k8s.io/jobset-name": name,
              "jobset.sigs.k8s.io/replicatedjob-name": "worker", "jobset.sigs.k8s.io/job-index": "0",
              "batch.kubernetes.io/job-completion-index": str(rank)}
    running = {"running": {"startedAt": created}} if phase == "Running" else (
        {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": created, "finishedAt": created}}
        if phase in ("Succeeded", "Failed") else {"waiting": {"reason": "ContainerCreating"}})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-worker-0-{rank}-{suffix}", "namespace": jobset["metadata"]["namespace"],
                     "labels": labels, "annotations": tpl["metadata"].get("annotations", {}),
                     "creationTimestamp": created, "uid": str(uuid.uuid4())},
        "spec": {**tpl["spec"], "nodeName": node if phase != "Pending" else None},
        "status": {"phase": phase, "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": phase == "Running",
             "restartCount": restarts, "state": running} for c in tpl["spec"]["containers"]]},
    }


def iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")
