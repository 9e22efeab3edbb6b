"""What the platform gives each team namespace for serving, as plain dicts: the predictor's, the route's and the
promotion loop's service accounts with their roles, and the promotion loop's Deployment.

Usage (infra/k8s/serving.py, once per team namespace when the stack enables serving):
    objects = team_serving_objects(namespace, image=image, cpu_node_selector=sel, prometheus=url, tracking_uri=uri,
                                   identity_annotations={...})

The promotion loop (gpu_train.serving.promote) runs in every team namespace and drives each canary that
`gpu-train serve canary --auto` hands it through the service's route ConfigMap; the route
(gpu_train.serving.router) reads the same ConfigMap. Each account may do exactly what its program does, in its own
namespace only (Roles, never ClusterRoles):
- serving-router: read ConfigMaps (the route's weights);
- serving-promoter: read and update ConfigMaps (weights, canary state), read and delete InferenceServices (a
  rolled-back canary, a replaced stable version), ask predictors through the service proxy (the quality check),
  record Events (each decision);
- model-server: nothing in the Kubernetes API; its cloud identity reads the MLflow artifact store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_train.jobs.pods import container_security, node_scheduling, pod_security
from gpu_train.spec import naming

RBAC_API = "rbac.authorization.k8s.io/v1"
PROMOTER = "serving-promoter"
LABELS = {"app.kubernetes.io/part-of": "gpu-train"}
READ = ["get", "list", "watch"]
HEARTBEAT = "/tmp/heartbeat"  # the promotion loop touches it every turn (gpu_train.serving.promote --heartbeat)
HEARTBEAT_MAX_AGE_S = 60


def service_account(name: str, namespace: str, *, token: bool,
                    annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(LABELS)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": token}


def role_with_binding(name: str, namespace: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Role in the namespace and its binding to the service account of the same name."""
    meta = {"name": name, "namespace": namespace, "labels": dict(LABELS)}
    return [
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": meta, "rules": rules},
        {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def router_rules() -> list[dict[str, Any]]:
    return [{"apiGroups": [""], "resources": ["configmaps"], "verbs": READ}]


def promoter_rules() -> list[dict[str, Any]]:
    return [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": [*READ, "patch", "update"]},
        {"apiGroups": ["serving.kserve.io"], "resources": ["inferenceservices"], "verbs": [*READ, "delete"]},
        # The quality check asks each version's predictor through the API server's service proxy.
        {"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["create", "get"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    ]


def heartbeat_probe(path: str, max_age_s: int, period_s: int) -> dict[str, Any]:
    """A probe that fails when the program has not touched `path` for `max_age_s` seconds."""
    return {"exec": {"command": ["python", "-c", "import os, sys, time; sys.exit(time.time() - os.path.getmtime("
                                 f"{path!r}) > {max_age_s})"]}, "periodSeconds": period_s}


def singleton_deployment(*, name: str, namespace: str, labels: Mapping[str, str], selector: Mapping[str, str],
                         service_account: str, node_selector: Mapping[str, str], api_use: str,
                         container: Mapping[str, Any], grace_s: int | None = None) -> dict[str, Any]:
    """One replica of a program the platform runs in a team namespace (the promotion loop, a sweep's controller):
    the Recreate strategy, since two would take each decision twice; UID 10001 on the CPU nodes; /tmp an emptyDir
    (the root filesystem is read-only). `api_use` says why its pod mounts its account's token (checkov CKV_K8S_38)."""
    spec: dict[str, Any] = {"serviceAccountName": service_account, "enableServiceLinks": False,
                            **node_scheduling(node_selector), "securityContext": pod_security(naming.TRAINER_UID)}
    if grace_s is not None:
        spec["terminationGracePeriodSeconds"] = grace_s
    spec["containers"] = [{**container, "securityContext": container_security(naming.TRAINER_UID),
                           "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}]
    spec["volumes"] = [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                     "annotations": {"checkov.io/skip1": f"CKV_K8S_38={api_use}"}},
        "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": dict(selector)},
                 "template": {"metadata": {"labels": dict(labels)}, "spec": spec}},
    }


def promoter_deployment(namespace: str, *, image: str, cpu_node_selector: Mapping[str, str], prometheus: str,
                        tracking_uri: str) -> dict[str, Any]:
    """The namespace's promotion loop: one replica (two would judge the same canary twice), restarted in place, and
    restarted when its loop stops turning (it touches a heartbeat file every second; the probes read its age)."""
    alive = heartbeat_probe(HEARTBEAT, HEARTBEAT_MAX_AGE_S, 30)
    return singleton_deployment(
        name=PROMOTER, namespace=namespace, labels={**LABELS, naming.SERVING_ROLE_LABEL: "promoter"},
        selector={naming.SERVING_ROLE_LABEL: "promoter"}, service_account=naming.PROMOTER_SERVICE_ACCOUNT,
        node_selector=cpu_node_selector,
        api_use="the promotion loop reads and updates the routes and InferenceServices through the Kubernetes API",
        container={
            "name": "promote",
            "image": image,
            "command": ["python", "-m", "gpu_train.serving.promote"],
            "args": ["--namespace", namespace, "--prometheus", prometheus, "--heartbeat", HEARTBEAT],
            "env": [{"name": "HOME", "value": "/tmp"},
                    *([{"name": "MLFLOW_TRACKING_URI", "value": tracking_uri}] if tracking_uri else [])],
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
            "readinessProbe": alive, "livenessProbe": {**alive, "failureThreshold": 4},
        })


def team_serving_objects(namespace: str, *, image: str, cpu_node_selector: Mapping[str, str], prometheus: str,
                         tracking_uri: str, identity_annotations: Mapping[str, str]) -> list[dict[str, Any]]:
    """Every per-namespace serving object the platform creates, in creation order."""
    return [
        service_account(naming.MODEL_SERVER_SERVICE_ACCOUNT, namespace, token=False,
                        annotations=identity_annotations),
        service_account(naming.ROUTER_SERVICE_ACCOUNT, namespace, token=True),
        *role_with_binding(naming.ROUTER_SERVICE_ACCOUNT, namespace, router_rules()),
        service_account(naming.PROMOTER_SERVICE_ACCOUNT, namespace, token=True),
        *role_with_binding(naming.PROMOTER_SERVICE_ACCOUNT, namespace, promoter_rules()),
        promoter_deployment(namespace, image=image, cpu_node_selector=cpu_node_selector, prometheus=prometheus,
                            tracking_uri=tracking_uri),
    ]
