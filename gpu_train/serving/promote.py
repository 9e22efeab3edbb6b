"""A team namespace's promotion loop: drives every canary that `gpu-train serve canary --auto` hands to the cluster.

Run (the namespace's serving-promoter Deployment runs this; gpu_train.jobs.serving_platform renders it):
    python -m gpu_train.serving.promote --namespace team-research --prometheus http://...:9090

Every second it lists the namespace's route ConfigMaps; each canary marked `driver: cluster` is evaluated once
per its `intervalSeconds` by the same loop `gpu-train serve canary --auto --here` runs in a terminal
(gpu_train.serving.canary), with the cluster's actions (gpu_train.serving.cluster). Its state lives in the route
ConfigMap, so a restarted pod takes up every canary where it stood. The MLflow aliases move through
MLFLOW_TRACKING_URI (the platform's tracking server). Its account may only read and update ConfigMaps, read and
delete InferenceServices, reach predictors through the service proxy and record Events, in this namespace.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from gpu_train.serving.canary import CanaryState, PromotionLoop
from gpu_train.serving.cluster import ClusterActions, ServingCluster
from gpu_train.serving.prometheus import Prometheus

LOG = logging.getLogger("gpu_train.serving.promote")
DRIVER = "cluster"


def once(cluster: ServingCluster, prometheus: Prometheus, registry, last: dict[str, float], now: float) -> int:
    """Evaluate every canary due; returns how many were evaluated."""
    evaluated = 0
    for service, route in cluster.routes().items():
        if not route.canary or route.canary.get("driver") != DRIVER:
            continue
        state = CanaryState.from_document(route.canary["state"])
        if now - last.get(service, 0.0) < state.canary_policy.interval_seconds and state.step >= 0:
            continue
        last[service] = now
        evaluated += 1
        loop = PromotionLoop(prometheus=prometheus, selector=f'service="{service}",namespace="{cluster.namespace}"',
                             actions=ClusterActions(cluster, service), registry=registry)
        try:
            if state.step < 0:
                loop.start(state)
                continue
            after, decision = loop.tick(state, now)
            if decision is None and after != state:
                cluster.write_route(service, canary={**route.canary, "state": after.document()})
        except Exception as exc:  # one service's trouble must not stop the others' canaries
            LOG.error("canary of service %s: %s", service, one_line(exc))
    return evaluated


def one_line(exc: Exception) -> str:
    """An error as one log line: for the API server's, its status and its own message (an ApiException's text is
    the whole response, headers and body, over several lines)."""
    from kubernetes.client.rest import ApiException

    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message") or ""
        except (AttributeError, TypeError, ValueError):
            message = ""
        return f"the API server answered {exc.status} {exc.reason}: {' '.join(message.split()) or 'no message'}"
    return " ".join(str(exc).split())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_train.serving.promote", description=__doc__.splitlines()[0])
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--prometheus", required=True, help="the platform's Prometheus (HTTP API)")
    ap.add_argument("--heartbeat", type=Path, default=None, help="a file touched every turn (the pod's probes)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kubernetes import client, config

    config.load_incluster_config()
    cluster = ServingCluster(client.ApiClient(), args.namespace)
    registry = None
    if os.environ.get("MLFLOW_TRACKING_URI"):
        from gpu_train.serving.registry import MlflowRegistry

        registry = MlflowRegistry()
    else:
        LOG.warning("MLFLOW_TRACKING_URI is not set: canaries run, but no MLflow alias or tag moves")
    prometheus = Prometheus(args.prometheus)
    last: dict[str, float] = {}
    LOG.info("promotion loop for namespace %s, Prometheus %s", args.namespace, args.prometheus)
    while True:
        try:
            once(cluster, prometheus, registry, last, time.time())
        except Exception as exc:  # the API server briefly unavailable: try again next second
            LOG.error("listing the routes of %s: %s", args.namespace, exc)
        if args.heartbeat is not None:
            args.heartbeat.touch()
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
