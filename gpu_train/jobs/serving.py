"""The one serving renderer: a service spec and where it runs -> KServe InferenceServices and the service's
weighted route, as plain dicts; and the pod KServe makes of an InferenceService, for the admission checks.

Usage:
    where = ServingPlacement.from_contract(contract, spec)         # `gpu-train serve`: the team's namespace
    isvc = inference_service(spec, ServedVersion(3, run_id, source), where)
    route_objects(spec, route_document(spec, backends, where.namespace), where)   # ConfigMap, Deployment, Service
    predictor_pod(isvc, storage_container(pod_env))                # what KServe's controller and webhook run

The stack's own services (infra/k8s/serving.py) and `gpu-train serve` render here, from the service spec
(gpu_train.spec.serving) and the platform contract's `serving` section; the platform's per-team objects (the
route's and the promotion loop's accounts and roles, the loop's Deployment, KServe's storage container) are in
gpu_train.jobs.serving_platform. docs/serving.md gives the reasons; in short:
- one InferenceService per model version, in KServe's standard mode (`serving.kserve.io/deploymentMode:
  Standard`: a Deployment and a Service, no Knative), named <service>-v<version>. KServe 0.20's own
  `spec.canary` in standard mode sizes a canary Deployment by its traffic share but routes none of that share to
  it (its Service and route point at the stable predictor only), so the split is the platform's: the service's
  route (gpu_train.serving.router) sends each request to a version by weight and meters what clients see;
- the predictor is a container of KServe's Hugging Face server image (the version pinned in
  gpu_train.spec.serving), written out in the InferenceService itself rather than referenced through a
  ServingRuntime object, so the policy pack, the plan's admission check and the team namespaces' admission
  policies see the exact container that runs; KServe's storage initializer downloads the version's files from
  the MLflow artifact store into /mnt/models (env STORAGE_URI) with the team's model-server identity;
- on a GPU pool the server runs vLLM on that pool's nodes (tolerations and node selector from the pool, as a
  training pod's); otherwise transformers on the cluster's CPU nodes;
- every object carries the model's name, version and MLflow run id, so a served version leads back to the run
  that trained it (its data and config are that run's tags and params).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpu_train.jobs.pods import (
    container_security,
    gpu_resources,
    node_scheduling,
    pod_security,
    pool_scheduling,
)
from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool, PlatformContract
from gpu_train.spec.serving import RUNTIME_IMAGES, STORAGE_INITIALIZER_IMAGE, ServiceSpec

KSERVE_API = "serving.kserve.io/v1beta1"
STORAGE_API = "serving.kserve.io/v1alpha1"
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"  # pkg/constants DeploymentMode; value "Standard" (0.20)
# KServe's names (pkg/constants/constants.go at v0.20.0): the model container, the init container that downloads
# the model, where it lands, the pod label naming the InferenceService, and the predictor Service's port.
MODEL_CONTAINER = "kserve-container"
# The platform's ClusterStorageContainer, which every predictor names (KServe would otherwise pick any that
# claims the URI's scheme, its own default among them).
STORAGE_CONTAINER = "gpu-train"
STORAGE_INITIALIZER = "storage-initializer"
MODEL_DIR = "/mnt/models"
ISVC_LABEL = "serving.kserve.io/inferenceservice"
PREDICTOR_PORT = 80
SERVER_PORT = 8080
# The Hugging Face server and storage initializer images run as user 1000 (python/huggingface_server*.Dockerfile
# and python/storage-initializer.Dockerfile: USER 1000).
MODEL_SERVER_UID = 1000
ROUTE_CONFIG_KEY = "route.json"
CANARY_CONFIG_KEY = "canary.json"
ROUTE_REPLICAS = 2
# Why the route's pods carry an API token (checkov's CKV_K8S_38 asks for none where it is not needed).
API_TOKEN_REASON = "the route reads its weights from its ConfigMap through the Kubernetes API"
APP_LABELS = {"app.kubernetes.io/part-of": "gpu-train"}
# Annotations on every served version: what it is and where it came from.
MODEL_ANNOTATION = "gpu-train.io/model"
VERSION_ANNOTATION = "gpu-train.io/model-version"
RUN_ANNOTATION = "gpu-train.io/mlflow-run-id"
SOURCE_ANNOTATION = "gpu-train.io/model-source"
Role = Literal["stable", "canary"]


class ServingError(ValueError):
    """A service that cannot be rendered on this platform; the message names the setting."""


@dataclass(frozen=True)
class ServedVersion:
    """A registered model version as the registry resolved it."""

    version: int
    run_id: str
    source: str  # the version's artifact URI as MLflow records it (mlflow-artifacts:/..., s3://..., gs://...)


@dataclass(frozen=True)
class Backend:
    """One version behind a service's route."""

    version: int
    weight: int  # percent of requests
    role: Role
    run_id: str = ""


@dataclass(frozen=True, kw_only=True)
class ServingPlacement:
    """Where a service runs: everything the renderer needs besides the spec, all values resolved."""

    namespace: str
    pool: GpuPool | None  # None: the cluster's CPU nodes
    cpu_node_selector: Mapping[str, str]
    artifacts_root: str  # MLflow's artifacts destination (s3://bucket/prefix or gs://bucket/prefix)
    image: str  # the platform image (digest-pinned): the route and the promotion loop run it
    prometheus: str = ""
    tracking_uri: str = ""
    pod_env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_contract(cls, contract: PlatformContract, spec: ServiceSpec) -> ServingPlacement:
        serving = contract.serving
        if serving is None:
            raise ServingError(f"platform {contract.stack or contract.source!r} does not serve models (its stack sets "
                               "no serving.enabled: true)")
        if spec.pool and spec.pool not in serving.gpu_pools:
            raise ServingError(f"service.pool {spec.pool!r} is not a serving pool of this platform "
                               f"({', '.join(serving.gpu_pools) or 'none'})")
        return cls(namespace=contract.team(spec.team).namespace, pool=contract.pool(spec.pool) if spec.pool else None,
                   cpu_node_selector=dict(serving.cpu_node_selector), artifacts_root=serving.artifacts_root,
                   image=contract.image, prometheus=serving.prometheus, tracking_uri=contract.endpoints.tracking,
                   pod_env=dict(contract.pod_env))


def storage_uri(source: str, artifacts_root: str) -> str:
    """Where the storage initializer reads a version's files: MLflow's proxied `mlflow-artifacts:/<path>` is
    <artifacts root>/<path> in the bucket; a bucket URI under the root is itself."""
    root = artifacts_root.rstrip("/")
    if source.startswith("mlflow-artifacts:"):
        path = source[len("mlflow-artifacts:"):].lstrip("/")
        if path:
            return f"{root}/{path}"
    elif source == root or source.startswith(root + "/"):
        return source
    raise ServingError(f"model source {source!r} is not in the platform's MLflow artifact store ({root}): only "
                       "versions registered through the platform's MLflow can be served")


def labels(spec: ServiceSpec, role: str, version: int | None = None) -> dict[str, str]:
    out = {**APP_LABELS, naming.TEAM_LABEL: spec.team, naming.SERVICE_LABEL: spec.name,
           naming.SERVING_ROLE_LABEL: role}
    if version is not None:
        out[naming.MODEL_VERSION_LABEL] = str(version)
    return out


def lineage(spec: ServiceSpec, version: ServedVersion) -> dict[str, str]:
    return {MODEL_ANNOTATION: spec.model.name, VERSION_ANNOTATION: str(version.version), RUN_ANNOTATION: version.run_id,
            SOURCE_ANNOTATION: version.source}


def server_args(spec: ServiceSpec) -> list[str]:
    """KServe's Hugging Face server (python/huggingfaceserver/__main__.py at v0.20.0): the model's name in the
    OpenAI API, its files, and the backend (vLLM on a GPU, transformers on CPU)."""
    return [f"--model_name={spec.name}", f"--model_dir={MODEL_DIR}", f"--backend={spec.backend()}",
            f"--http_port={SERVER_PORT}"]


def model_container(spec: ServiceSpec, version: ServedVersion, where: ServingPlacement) -> dict[str, Any]:
    gpus = spec.gpus()
    requests = {"cpu": spec.resources.cpu, "memory": spec.resources.memory, **gpu_resources(gpus)}
    return {
        "name": MODEL_CONTAINER,
        "image": RUNTIME_IMAGES[spec.backend()],
        "args": server_args(spec),
        # KServe's webhook adds the storage initializer for STORAGE_URI and mounts its download at /mnt/models.
        "env": [{"name": "STORAGE_URI", "value": storage_uri(version.source, where.artifacts_root)},
                {"name": "HF_HOME", "value": "/tmp/hf"}],
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        # No CPU limit (throttling adds tail latency); memory limited to what is requested.
        "resources": {"requests": requests, "limits": {"memory": spec.resources.memory, **gpu_resources(gpus)}},
        "readinessProbe": {"httpGet": {"path": f"/v1/models/{spec.name}", "port": SERVER_PORT},
                           "periodSeconds": 10, "failureThreshold": 3},
        # The server writes its caches under /tmp and HF_HOME; the image's own files stay as they are.
        "securityContext": container_security(MODEL_SERVER_UID, read_only_root=False),
    }


def inference_service(spec: ServiceSpec, version: ServedVersion, where: ServingPlacement) -> dict[str, Any]:
    """The InferenceService of one version of a service. Whether it is the stable version or the canary is the
    route's business (its ConfigMap): a promotion changes no label, so it restarts no pod."""
    if not version.run_id:
        raise ServingError(f"version {version.version} of {spec.model.name!r} has no MLflow run: a served version "
                           "must lead back to the run that trained it")
    scheduling = pool_scheduling(where.pool) if where.pool else node_scheduling(where.cpu_node_selector)
    meta_labels = labels(spec, "model", version.version)
    return {
        "apiVersion": KSERVE_API, "kind": "InferenceService",
        "metadata": {"name": naming.version_name(spec.name, version.version), "namespace": where.namespace,
                     "labels": meta_labels,
                     "annotations": {DEPLOYMENT_MODE: "Standard", **lineage(spec, version)}},
        "spec": {"predictor": {
            "minReplicas": spec.replicas.min,
            "maxReplicas": spec.replicas.max,
            "labels": meta_labels,
            "serviceAccountName": naming.MODEL_SERVER_SERVICE_ACCOUNT,
            # The server never calls the Kubernetes API; cloud credentials come from the workload identity.
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "storageContainerName": STORAGE_CONTAINER,
            **scheduling,
            "securityContext": pod_security(MODEL_SERVER_UID),
            "containers": [model_container(spec, version, where)],
            # vLLM's workers share tensors through /dev/shm.
            **({"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]}
               if where.pool else {}),
        }},
    }


def predictor_url(service: str, version: int, namespace: str) -> str:
    """The predictor Service KServe makes for a version: <isvc>-predictor, port 80 (pkg/constants at v0.20.0)."""
    return f"http://{naming.version_name(service, version)}-predictor.{namespace}.svc.cluster.local:{PREDICTOR_PORT}"


def route_document(spec: ServiceSpec, backends: Sequence[Backend], namespace: str) -> dict[str, Any]:
    """What the route reads: each version's predictor URL and weight; the weights add up to 100."""
    if sum(b.weight for b in backends) != 100 or not backends:
        raise ServingError(f"route of {spec.name!r}: weights {[b.weight for b in backends]} must add up to 100")
    return {"service": spec.name, "model": spec.model.name, "backends": [
        {"version": str(b.version), "role": b.role, "weight": b.weight, "runId": b.run_id,
         "url": predictor_url(spec.name, b.version, namespace)} for b in backends]}


def route_config_map(spec: ServiceSpec, route: Mapping[str, Any], namespace: str,
                     canary: Mapping[str, Any] | None = None) -> dict[str, Any]:
    data = {ROUTE_CONFIG_KEY: json.dumps(route, sort_keys=True)}
    if canary is not None:
        data[CANARY_CONFIG_KEY] = json.dumps(canary, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": naming.route_name(spec.name), "namespace": namespace,
                         "labels": labels(spec, "route")},
            "data": data}


def route_deployment(spec: ServiceSpec, where: ServingPlacement) -> dict[str, Any]:
    """The service's route: the platform image running gpu_train.serving.router against its ConfigMap."""
    pod_labels = labels(spec, "router")
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": naming.route_name(spec.name), "namespace": where.namespace, "labels": pod_labels,
                     "annotations": {"checkov.io/skip1": f"CKV_K8S_38={API_TOKEN_REASON}"}},
        "spec": {
            "replicas": ROUTE_REPLICAS,
            "selector": {"matchLabels": {naming.SERVICE_LABEL: spec.name, naming.SERVING_ROLE_LABEL: "router"}},
            "template": {"metadata": {"labels": pod_labels}, "spec": {
                "serviceAccountName": naming.ROUTER_SERVICE_ACCOUNT,
                "enableServiceLinks": False,
                **node_scheduling(where.cpu_node_selector),
                "securityContext": pod_security(naming.TRAINER_UID),
                "containers": [{
                    "name": "route",
                    "image": where.image,
                    "command": ["python", "-m", "gpu_train.serving.router"],
                    "args": ["--service", spec.name, "--namespace", where.namespace,
                             "--config-map", naming.route_name(spec.name), "--port", str(naming.ROUTE_PORT)],
                    "env": [{"name": "HOME", "value": "/tmp"}],
                    "ports": [{"name": "http", "containerPort": naming.ROUTE_PORT, "protocol": "TCP"}],
                    "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
                    "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                                  "limits": {"cpu": "2", "memory": "512Mi"}},
                    "securityContext": container_security(naming.TRAINER_UID),
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }],
                "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
            }},
        },
    }


def route_service(spec: ServiceSpec, namespace: str) -> dict[str, Any]:
    """The service's address in the cluster: http://<service>.<namespace>.svc/v1/completions."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": spec.name, "namespace": namespace, "labels": labels(spec, "router")},
            "spec": {"type": "ClusterIP",
                     "selector": {naming.SERVICE_LABEL: spec.name, naming.SERVING_ROLE_LABEL: "router"},
                     "ports": [{"name": "http", "port": PREDICTOR_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def route_objects(spec: ServiceSpec, route: Mapping[str, Any], where: ServingPlacement,
                  canary: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    return [route_config_map(spec, route, where.namespace, canary), route_deployment(spec, where),
            route_service(spec, where.namespace)]


# ----------------------------------------------------------------------------------------- what KServe makes


def storage_container(pod_env: Mapping[str, str]) -> dict[str, Any]:
    """KServe's ClusterStorageContainer for the platform's object stores: the pinned storage initializer, non-root
    and unprivileged, with the cloud's environment. KServe's storage reads its region from AWS_DEFAULT_REGION
    (python/storage/kserve_storage/kserve_storage.py at v0.20.0), the name botocore reads, so the cloud's
    AWS_REGION is given under that name too."""
    env = dict(pod_env)
    if "AWS_REGION" in env:
        env.setdefault("AWS_DEFAULT_REGION", env["AWS_REGION"])
    return {
        "apiVersion": STORAGE_API, "kind": "ClusterStorageContainer",
        "metadata": {"name": STORAGE_CONTAINER, "labels": dict(APP_LABELS)},
        "spec": {
            "container": {
                "name": STORAGE_INITIALIZER, "image": STORAGE_INITIALIZER_IMAGE, "imagePullPolicy": "IfNotPresent",
                "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                "securityContext": container_security(MODEL_SERVER_UID, read_only_root=False),
            },
            "supportedUriFormats": [{"prefix": "s3://"}, {"prefix": "gs://"}],
            "workloadType": "initContainer",
        },
    }


def predictor_pod(isvc: Mapping[str, Any], storage: Mapping[str, Any]) -> dict[str, Any]:
    """The pod KServe runs for an InferenceService's predictor (standard mode): the predictor's pod fields and
    containers, KServe's labels, and the storage initializer its webhook adds with the model volume
    (pkg/webhook/admission/pod/storage_initializer_injector.go at v0.20.0)."""
    predictor = copy.deepcopy(dict(isvc["spec"]["predictor"]))
    name = isvc["metadata"]["name"]
    pod_labels = {**isvc["metadata"].get("labels", {}), **predictor.pop("labels", {}), ISVC_LABEL: name,
                  "component": "predictor", "app": f"isvc.{name}-predictor"}
    for key in ("minReplicas", "maxReplicas", "annotations", "storageContainerName"):
        predictor.pop(key, None)
    mount = {"name": "kserve-provision-location", "mountPath": MODEL_DIR}
    init = {**copy.deepcopy(dict(storage["spec"]["container"])), "volumeMounts": [mount]}
    containers = [{**c, "volumeMounts": [*c.get("volumeMounts", []), {**mount, "readOnly": True}]}
                  if c.get("name") == MODEL_CONTAINER else c for c in predictor.pop("containers")]
    return {"metadata": {"labels": pod_labels, "namespace": isvc["metadata"]["namespace"]},
            "spec": {**predictor, "initContainers": [init], "containers": containers,
                     "volumes": [*predictor.get("volumes", []), {"name": mount["name"], "emptyDir": {}}]}}
