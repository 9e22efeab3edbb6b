"""A team's served models, as one typed client: deploy a version, try a new one as a canary, promote or roll it
back, and read where a service stands. `gpu-train serve` parses arguments and prints; everything else is here.

Usage:
    client = ServingClient(contract, cluster=ServingCluster(api, "team-research"), registry=MlflowRegistry(uri))
    objects = client.deploy(spec, dry_run=True)          # the manifests, nothing applied
    client.deploy(spec)                                   # applied; champion -> this version
    client.canary(spec, traffic=10, driver="cluster")     # the namespace's promotion loop takes it from here
    client.promote("chat"); client.rollback("chat")       # by hand
    client.status("chat")                                 # weights, versions, canary, last decisions

The service spec is gpu_train.spec.serving's, checked against the platform contract as the stack checks its own
services; the objects come from the one serving renderer (gpu_train.jobs.serving). A version is resolved in the
model registry unless the spec pins it (NAME:VERSION with `source` and `runId`, as a stack does), which is what
lets `--dry-run --platform FILE` work without MLflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gpu_train.jobs.serving import (
    Backend,
    ServedVersion,
    ServingPlacement,
    inference_service,
    route_config_map,
    route_document,
    route_objects,
)
from gpu_train.serving.canary import CanaryState, Decision, PromotionLoop
from gpu_train.serving.cluster import ClusterActions, RouteState, ServingCluster, weighted
from gpu_train.serving.prometheus import Prometheus
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.serving import ServiceSpec, service_problems

READY_TIMEOUT_S = 900.0
# Who decides a canary: the namespace's promotion loop, this process (--here), or a person (promote/rollback).
Driver = Literal["cluster", "cli", "manual"]


class ServingError(ValueError):
    """Something the user must change (a spec, a name, the order of commands); the message says what."""


@dataclass
class ServingClient:
    contract: PlatformContract
    cluster: ServingCluster | None = None  # None: dry runs only
    registry: Any = None  # gpu_train.serving.registry.MlflowRegistry, or None when every version is pinned
    progress: Callable[[str], None] = lambda line: None
    clock: Callable[[], float] = time.time

    # ---------------------------------------------------------------------------------------- checks
    def check(self, spec: ServiceSpec) -> ServingPlacement:
        serving = self.contract.serving
        if serving is None:
            raise ServingError(f"platform {self.contract.stack or self.contract.source!r} does not serve models: its "
                               "stack sets no serving.enabled: true (docs/serving.md)")
        problems = service_problems(spec, teams=[t.name for t in self.contract.teams],
                                    gpu_pools=list(serving.gpu_pools),
                                    scrape_interval_s=serving.scrape_interval_seconds)
        if problems:
            raise ServingError("\n".join(problems))
        return ServingPlacement.from_contract(self.contract, spec)

    def resolve(self, spec: ServiceSpec) -> ServedVersion:
        """The version the spec names: pinned in the spec, else from the registry."""
        if spec.model.version is not None and spec.source and spec.run_id:
            return ServedVersion(spec.model.version, spec.run_id, spec.source)
        if self.registry is None:
            raise ServingError(f"service.model {str(spec.model)!r} must be resolved in MLflow: give --tracking-uri "
                               "(or MLFLOW_TRACKING_URI), or pin NAME:VERSION with source and runId in the spec")
        return self.registry.resolve(spec.model)

    def _cluster(self) -> ServingCluster:
        if self.cluster is None:
            raise ServingError("no cluster to apply to (pass --dry-run to only print the manifests)")
        return self.cluster

    def _route(self, name: str) -> RouteState:
        route = self._cluster().route(name)
        if route is None or route.backend("stable") is None:
            raise ServingError(f"service {name!r} is not deployed in {self._cluster().namespace} "
                               "(gpu-train serve deploy first)")
        return route

    # ---------------------------------------------------------------------------------------- deploy
    def deploy(self, spec: ServiceSpec, *, dry_run: bool = False) -> list[dict[str, Any]]:
        """One version taking all of the service's traffic; a version it replaces is removed once the route has
        moved. Refused while a canary is on trial."""
        where = self.check(spec)
        version = self.resolve(spec)
        isvc = inference_service(spec, version, where)
        route = route_document(spec, [Backend(version.version, 100, "stable", version.run_id)], where.namespace)
        objects = [isvc, *route_objects(spec, route, where)]
        if dry_run:
            return objects
        cluster = self._cluster()
        current = cluster.route(spec.name)
        if current is not None and current.canary:
            raise ServingError(f"service {spec.name!r} has a canary on trial (version "
                               f"{current.canary['state']['canary']}): promote or roll it back first")
        old = current.backend("stable") if current is not None else None
        cluster.apply(isvc)
        self.wait_ready(spec.name, version.version)
        for obj in objects[1:]:
            if obj["kind"] == "ConfigMap" and current is not None:
                cluster.write_route(spec.name, route)  # keep the decision history
            else:
                cluster.apply(obj)
        if old is not None and int(old["version"]) != version.version:
            cluster.delete_version(spec.name, int(old["version"]))
        if self.registry is not None:
            self.registry.deployed(spec.model.name, version.version, f"{spec.team}/{spec.name}")
        return objects

    def wait_ready(self, name: str, version: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until KServe reports the version's InferenceService Ready (image pulled, model downloaded, server up)."""
        cluster, deadline, said = self._cluster(), self.clock() + timeout_s, ""
        while self.clock() < deadline:
            isvc = next((i for i in cluster.versions(name)
                         if i["metadata"]["name"] == naming.version_name(name, version)), None)
            conditions = {c.get("type"): c for c in ((isvc or {}).get("status") or {}).get("conditions", [])}
            ready = conditions.get("Ready") or {}
            if ready.get("status") == "True":
                return
            line = f"waiting for {naming.version_name(name, version)} to be ready: {ready.get('message') or 'pending'}"
            if line != said:
                self.progress(line)
                said = line
            time.sleep(5)
        raise ServingError(f"{naming.version_name(name, version)} was not ready within {timeout_s:.0f} s: kubectl -n "
                           f"{cluster.namespace} describe inferenceservice {naming.version_name(name, version)}")

    # ---------------------------------------------------------------------------------------- canary
    def canary(self, spec: ServiceSpec, *, traffic: int, driver: Driver, dry_run: bool = False,
               stable: int | None = None) -> tuple[list[dict[str, Any]], CanaryState]:
        """The new version beside the stable one, at `traffic` percent once it is ready; `driver` says who decides:
        the namespace's promotion loop ("cluster"), this process ("cli", see run_here) or a person ("manual")."""
        where = self.check(spec)
        version = self.resolve(spec)
        if dry_run and self.cluster is None:
            if stable is None:
                raise ServingError("--dry-run without a cluster needs --stable VERSION (the version serving now)")
            current = RouteState(route_document(spec, [Backend(stable, 100, "stable")], where.namespace))
        else:
            current = self._route(spec.name)
            if current.canary:
                raise ServingError(f"service {spec.name!r} already has a canary on trial (version "
                                   f"{current.canary['state']['canary']})")
        stable_version = int(current.backend("stable")["version"])
        if version.version == stable_version:
            raise ServingError(f"version {version.version} of {spec.model.name!r} is already the stable version")
        state = CanaryState.new(spec, stable=stable_version, canary=version.version, canary_run_id=version.run_id,
                                now=self.clock())
        if driver != "manual":
            state = CanaryState(**{**state.document(), "policy": {**state.policy, "steps": list(
                schedule(traffic, spec.canary.steps))}})
        isvc = inference_service(spec, version, where)
        doc = {**current.doc, "backends": [*current.doc["backends"], {
            "version": str(version.version), "role": "canary", "weight": 0, "runId": version.run_id,
            "url": route_document(spec, [Backend(version.version, 100, "canary")], where.namespace)
            ["backends"][0]["url"]}]}
        doc = weighted(doc, stable_version, version.version, traffic if driver == "manual" else 0)
        objects = [isvc, route_config_map(spec, doc, where.namespace, {"driver": driver, "state": state.document()})]
        if dry_run:
            return objects, state
        cluster = self._cluster()
        cluster.apply(isvc)
        self.wait_ready(spec.name, version.version)
        cluster.write_route(spec.name, doc, canary={"driver": driver, "state": state.document()})
        if driver == "manual":
            state = CanaryState(**{**state.document(), "step": 0, "step_started_at": self.clock(),
                                   "policy": {**state.policy, "steps": [traffic]}})
            ClusterActions(cluster, spec.name, who="gpu-train serve").record(
                state, Decision("start", "deployed by hand (gpu-train serve canary)", traffic, self.clock()))
            if self.registry is not None:
                self.registry.canary_started(spec.model.name, version.version, f"{spec.team}/{spec.name}")
        return objects, state

    def run_here(self, spec: ServiceSpec, state: CanaryState, prometheus: str) -> Decision:
        """The promotion loop in this process, against a Prometheus this machine reaches."""
        loop = PromotionLoop(prometheus=Prometheus(prometheus),
                             selector=f'service="{spec.name}",namespace="{self._cluster().namespace}"',
                             actions=ClusterActions(self._cluster(), spec.name, who="gpu-train serve canary --here"),
                             registry=self.registry)
        return loop.run(state)

    # ---------------------------------------------------------------------------------------- by hand
    def decide(self, name: str, action: str) -> Decision:
        """Promote or roll back the service's canary by hand."""
        route = self._route(name)
        if not route.canary:
            raise ServingError(f"service {name!r} has no canary on trial")
        state = CanaryState.from_document(route.canary["state"])
        decision = Decision(action, f"{'promoted' if action == 'promote' else 'rolled back'} by hand "
                                    f"(gpu-train serve {action})", 100 if action == "promote" else 0, self.clock())
        actions = ClusterActions(self._cluster(), name, who=f"gpu-train serve {action}")
        (actions.promote if action == "promote" else actions.rollback)(state)
        actions.record(state, decision)
        if self.registry is not None:
            self.registry.decided(state.model, state.canary, state.stable, decision,
                                  f"{self._cluster().namespace}/{name}")
        return decision

    def status(self, name: str) -> dict[str, Any]:
        route = self._route(name)
        versions = []
        for isvc in self._cluster().versions(name):
            meta = isvc["metadata"]
            ready = {c.get("type"): c.get("status") for c in (isvc.get("status") or {}).get("conditions", [])}
            version = meta.get("labels", {}).get(naming.MODEL_VERSION_LABEL, "?")
            backend = next((b for b in route.doc["backends"] if b["version"] == version), {})
            versions.append({"version": version, "model": meta.get("annotations", {}).get("gpu-train.io/model"),
                             "runId": meta.get("annotations", {}).get("gpu-train.io/mlflow-run-id"),
                             "ready": ready.get("Ready") == "True", "role": backend.get("role", "unrouted"),
                             "weight": backend.get("weight", 0)})
        canary = None
        if route.canary:
            state = CanaryState.from_document(route.canary["state"])
            canary = {"version": state.canary, "driver": route.canary.get("driver"), "weight": state.weight(),
                      "step": state.step, "steps": list(state.canary_policy.steps),
                      "runningSeconds": round(self.clock() - state.started_at)}
        return {"service": name, "namespace": self._cluster().namespace, "versions": versions, "canary": canary,
                "decisions": route.decisions[-5:]}


def schedule(traffic: int, steps: tuple[int, ...]) -> tuple[int, ...]:
    """The canary's steps when it starts at `traffic` percent: that, then the spec's larger steps."""
    return (traffic, *[s for s in steps if s > traffic])

