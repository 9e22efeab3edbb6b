"""A team namespace's serving objects through the Kubernetes API: InferenceServices, each service's route
ConfigMap (weights, the canary on trial, the last decisions), Events; and the promotion loop's actions there.

Usage:
    cluster = ServingCluster(api_client, "team-research")
    cluster.apply(obj)                                 # create, or replace what is there
    route = cluster.route("chat")                      # Route(doc, canary state, decisions) or None
    cluster.write_route(spec_name, doc, canary=None)   # the weights the route replicas follow within a second
    actions = ClusterActions(cluster, "chat")          # what gpu_train.serving.canary's loop does in the cluster

The route ConfigMap (gpu_train.jobs.serving.route_config_map) is the one record of a service's state: which
versions take which share of traffic (`route.json`), the canary on trial and where its schedule stands
(`canary.json`, present while there is one), and the last decisions with their numbers (`decisions.json`). The
route replicas read it (gpu_train.serving.router), `gpu-train serve` writes it, and the namespace's promotion loop
(gpu_train.serving.promote) drives every canary marked for it. A quality check reaches a version's predictor
through the API server's service proxy, from a laptop and from the loop's pod alike.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpu_train.jobs.serving import (
    CANARY_CONFIG_KEY,
    KSERVE_API,
    PREDICTOR_PORT,
    ROUTE_CONFIG_KEY,
)
from gpu_train.serving.canary import CanaryState, Decision
from gpu_train.spec import naming

DECISIONS_KEY = "decisions.json"
KEEP_DECISIONS = 20
_PLURALS = {"InferenceService": "inferenceservices"}
KSERVE_GROUP, KSERVE_VERSION = KSERVE_API.split("/")


@dataclass
class RouteState:
    doc: dict[str, Any]  # route.json
    canary: dict[str, Any] | None = None  # canary.json: {"driver": "cluster"|"cli"|"manual", "state": {...}}
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def backend(self, role: str) -> dict[str, Any] | None:
        return next((b for b in self.doc.get("backends", []) if b.get("role") == role), None)


class ServingCluster:
    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.core, self.apps, self.custom = k8s.CoreV1Api(api), k8s.AppsV1Api(api), k8s.CustomObjectsApi(api)

    # -------------------------------------------------------------------------------------------- objects
    def apply(self, obj: dict[str, Any]) -> None:
        """Create the object, or replace the one of the same name (keeping its resourceVersion)."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind in _PLURALS:
            args = (KSERVE_GROUP, KSERVE_VERSION, self.namespace, _PLURALS[kind])
            try:
                current = self.custom.get_namespaced_custom_object(*args, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self.custom.create_namespaced_custom_object(*args, obj)
                return
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
            self.custom.replace_namespaced_custom_object(*args, name, body)
            return
        api, noun = {"ConfigMap": (self.core, "config_map"), "Service": (self.core, "service"),
                     "Deployment": (self.apps, "deployment")}[kind]
        try:
            current = getattr(api, f"read_namespaced_{noun}")(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            getattr(api, f"create_namespaced_{noun}")(self.namespace, obj)
            return
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current.metadata.resource_version}}
        if kind == "Service":  # clusterIP is immutable and assigned by the API server
            body["spec"] = {**obj["spec"], "clusterIP": current.spec.cluster_ip}
        getattr(api, f"replace_namespaced_{noun}")(name, self.namespace, body)

    def delete_version(self, service: str, version: int) -> None:
        try:
            self.custom.delete_namespaced_custom_object(KSERVE_GROUP, KSERVE_VERSION, self.namespace,
                                                        "inferenceservices", naming.version_name(service, version))
        except ApiException as exc:
            if exc.status != 404:
                raise

    def versions(self, service: str) -> list[dict[str, Any]]:
        found = self.custom.list_namespaced_custom_object(KSERVE_GROUP, KSERVE_VERSION, self.namespace,
                                                          "inferenceservices",
                                                          label_selector=f"{naming.SERVICE_LABEL}={service}")
        return list(found.get("items", []))

    # -------------------------------------------------------------------------------------------- the route
    def route(self, service: str) -> RouteState | None:
        try:
            cm = self.core.read_namespaced_config_map(naming.route_name(service), self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return _route_state(cm.data or {})

    def routes(self) -> dict[str, RouteState]:
        """Every service's route in the namespace, by service name."""
        found = self.core.list_namespaced_config_map(self.namespace,
                                                     label_selector=f"{naming.SERVING_ROLE_LABEL}=route")
        return {cm.metadata.labels[naming.SERVICE_LABEL]: _route_state(cm.data or {}) for cm in found.items}

    def write_route(self, service: str, doc: dict[str, Any] | None = None, *, canary: dict[str, Any] | None = None,
                    clear_canary: bool = False, decision: dict[str, Any] | None = None) -> None:
        """Patch the route ConfigMap: the weights, the canary's state (or its removal), a decision appended."""
        current = self.route(service)
        if current is None:
            raise LookupError(f"service {service!r} has no route in {self.namespace} (gpu-train serve deploy first)")
        data: dict[str, Any] = {}
        if doc is not None:
            data[ROUTE_CONFIG_KEY] = json.dumps(doc, sort_keys=True)
        if canary is not None:
            data[CANARY_CONFIG_KEY] = json.dumps(canary, sort_keys=True)
        elif clear_canary:
            data[CANARY_CONFIG_KEY] = None  # a strategic-merge patch removes the key
        if decision is not None:
            data[DECISIONS_KEY] = json.dumps([*current.decisions, decision][-KEEP_DECISIONS:], sort_keys=True)
        self.core.patch_namespaced_config_map(naming.route_name(service), self.namespace, {"data": data})

    def event(self, service: str, reason: str, message: str, warning: bool = False) -> None:
        """An Event on the service's route ConfigMap (kubectl describe configmap <service>-route shows it)."""
        now = datetime.datetime.now(datetime.UTC)
        name = naming.route_name(service)
        self.core.create_namespaced_event(self.namespace, {
            "metadata": {"generateName": f"{name}.", "namespace": self.namespace},
            "involvedObject": {"kind": "ConfigMap", "apiVersion": "v1", "name": name, "namespace": self.namespace},
            "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
            "firstTimestamp": now.isoformat(), "lastTimestamp": now.isoformat(), "count": 1,
            "source": {"component": "gpu-train-serving"}})

    def complete(self, service: str, version: int, prompt: str, max_tokens: int) -> str:
        """One greedy completion from one version, through the API server's service proxy."""
        # CoreV1Api's connect_post_*_proxy methods send no body: the same POST through the client's call_api.
        # (The path is written out: call_api would quote the slashes of a {path} parameter.)
        predictor = f"{naming.version_name(service, version)}-predictor:{PREDICTOR_PORT}"
        answer = self.api.call_api(
            f"/api/v1/namespaces/{self.namespace}/services/{predictor}/proxy/openai/v1/completions", "POST",
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body={"model": service, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        return json.loads(answer.data)["choices"][0]["text"]


def _route_state(data: dict[str, str]) -> RouteState:
    return RouteState(doc=json.loads(data.get(ROUTE_CONFIG_KEY) or "{}"),
                      canary=json.loads(data[CANARY_CONFIG_KEY]) if data.get(CANARY_CONFIG_KEY) else None,
                      decisions=json.loads(data.get(DECISIONS_KEY) or "[]"))


def weighted(doc: dict[str, Any], stable: int, canary: int | None, percent: int) -> dict[str, Any]:
    """The route document with the canary at `percent` (and the stable version at the rest); `canary` None leaves
    the stable version alone at 100."""
    by_version = {int(b["version"]): b for b in doc["backends"]}
    backends = [{**by_version[stable], "role": "stable", "weight": 100 - (percent if canary is not None else 0)}]
    if canary is not None:
        backends.append({**by_version[canary], "role": "canary", "weight": percent})
    return {**doc, "backends": backends}


def decision_document(state: CanaryState, decision: Decision, who: str) -> dict[str, Any]:
    return {"model": state.model, "stable": state.stable, "canary": state.canary, "action": decision.action,
            "reason": decision.reason, "weight": decision.weight, "metrics": decision.metrics,
            "at": datetime.datetime.fromtimestamp(decision.at, datetime.UTC).isoformat(timespec="seconds"),
            "by": who}


class ClusterActions:
    """The promotion loop's actions on one service in a team namespace: the route's weights, the versions'
    InferenceServices, an Event and the route's decision list for each decision."""

    def __init__(self, cluster: ServingCluster, service: str, who: str = "promotion loop") -> None:
        self.cluster, self.service, self.who = cluster, service, who

    def set_canary_weight(self, state: CanaryState, percent: int) -> None:
        current = self.cluster.route(state.service)
        doc = weighted(current.doc, state.stable, state.canary, percent)
        self.cluster.write_route(state.service, doc, canary={**(current.canary or {}), "state": state.document()})

    def promote(self, state: CanaryState) -> None:
        current = self.cluster.route(state.service)
        backend = {**next(b for b in current.doc["backends"] if int(b["version"]) == state.canary),
                   "role": "stable", "weight": 100}
        self.cluster.write_route(state.service, {**current.doc, "backends": [backend]}, clear_canary=True)
        self.cluster.delete_version(state.service, state.stable)

    def rollback(self, state: CanaryState) -> None:
        current = self.cluster.route(state.service)
        self.cluster.write_route(state.service, weighted(current.doc, state.stable, None, 0), clear_canary=True)
        self.cluster.delete_version(state.service, state.canary)

    def record(self, state: CanaryState, decision: Decision) -> None:
        self.cluster.write_route(state.service, decision=decision_document(state, decision, self.who))
        reason = {"start": "CanaryStarted", "advance": "CanaryAdvanced", "promote": "CanaryPromoted",
                  "rollback": "CanaryRolledBack"}[decision.action]
        self.cluster.event(state.service, reason, decision.line(state), warning=decision.action == "rollback")

    def complete(self, version: int, prompt: str, max_tokens: int) -> str:
        return self.cluster.complete(self.service, version, prompt, max_tokens)
