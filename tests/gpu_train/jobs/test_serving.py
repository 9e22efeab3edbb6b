"""The one serving renderer: InferenceServices on a GPU pool (placed like a training pod on that pool) and on the
CPU nodes, the route, the platform's per-team objects, and the pod KServe makes, checked against KServe's CRD,
Kubernetes' schemas and Pod Security.

Run: .venv/bin/pytest tests/gpu_train/jobs/test_serving.py -q
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from gpu_train.jobs import jobset as js
from gpu_train.jobs.serving import (
    Backend,
    ServedVersion,
    ServingError,
    ServingPlacement,
    inference_service,
    predictor_pod,
    route_document,
    route_objects,
    storage_container,
    storage_uri,
)
from gpu_train.jobs.serving_platform import promoter_rules, router_rules, team_serving_objects
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract, Serving
from gpu_train.spec.job import read_job
from gpu_train.spec.serving import RUNTIME_IMAGES, STORAGE_INITIALIZER_IMAGE, read_service
from tests.gpu_train.cli.conftest import contract_doc
from tools.validation import crd, pod_security

K8S = "1.33"
RUN = "0123456789abcdef0123456789abcdef"
ROOT = "s3://gpu-train-aws-dev-artifacts/mlflow"
VERSION = ServedVersion(3, RUN, f"mlflow-artifacts:/1/{RUN}/artifacts/model")
SYSTEM = {naming.SYSTEM_LABEL: "true"}


def contract(gpu_pools: tuple[str, ...] = ("l40s-spot",)) -> PlatformContract:
    doc = contract_doc()
    doc["serving"] = Serving(kserve_version="v0.20.0", runtime_images=dict(RUNTIME_IMAGES), artifacts_root=ROOT,
                             cpu_node_selector=SYSTEM, gpu_pools=list(gpu_pools), prometheus="http://prom:9090",
                             scrape_interval_seconds=15).document()
    return PlatformContract.from_document(doc, "test")


def render(**spec) -> dict:
    s = read_service({"name": "chat", "team": "research", "model": "tiny-gpt:3", **spec})
    return inference_service(s, VERSION, ServingPlacement.from_contract(contract(), s))


def test_a_cpu_version_runs_transformers_on_the_cpu_nodes_and_fits_kserves_crd():
    isvc = render()
    assert crd.validate(isvc).problems == []
    assert isvc["metadata"]["name"] == "chat-v3" and isvc["metadata"]["namespace"] == "team-research"
    assert isvc["metadata"]["annotations"] == {
        "serving.kserve.io/deploymentMode": "Standard", "gpu-train.io/model": "tiny-gpt",
        "gpu-train.io/model-version": "3", "gpu-train.io/mlflow-run-id": RUN, "gpu-train.io/model-source": VERSION.source}
    predictor = isvc["spec"]["predictor"]
    assert predictor["nodeSelector"] == SYSTEM and "tolerations" not in predictor
    assert predictor["serviceAccountName"] == "model-server" and predictor["automountServiceAccountToken"] is False
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container" and container["image"] == RUNTIME_IMAGES["huggingface"]
    assert "--backend=huggingface" in container["args"] and "--model_name=chat" in container["args"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # MLflow proxies its artifacts: mlflow-artifacts:/<path> is <its --artifacts-destination>/<path> in the bucket.
    assert env["STORAGE_URI"] == f"{ROOT}/1/{RUN}/artifacts/model"
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}


def test_a_gpu_version_runs_vllm_placed_as_a_training_pod_on_that_pool():
    isvc = render(pool="l40s-spot", resources={"gpus": 1, "cpu": "6", "memory": "48Gi"})
    assert crd.validate(isvc).problems == []
    predictor = isvc["spec"]["predictor"]
    (container,) = predictor["containers"]
    assert container["image"] == RUNTIME_IMAGES["vllm"] and "--backend=vllm" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The same node selector and tolerations as the JobSet renderer gives a job on the pool.
    job = read_job({"name": "llm", "team": "research", "pool": "l40s-spot", "steps": 10, "globalBatchTokens": 4096})
    where = js.Placement.from_contract(contract(), job)
    pod = js.pod_template(job, where, gpus=1)["spec"]
    assert (predictor["nodeSelector"], predictor["tolerations"]) == (pod["nodeSelector"], pod["tolerations"])
    assert predictor["securityContext"]["seccompProfile"] == pod["securityContext"]["seccompProfile"]


@pytest.mark.parametrize(("source", "problem"), [
    ("s3://someone-elses-bucket/model", "is not in the platform's MLflow artifact store (s3://gpu-train-aws-dev-"
                                        "artifacts/mlflow)"),
    ("mlflow-artifacts:", "is not in the platform's MLflow artifact store"),
    ("runs:/abc/model", "is not in the platform's MLflow artifact store"),
])
def test_a_source_outside_the_artifact_store_is_refused(source, problem):
    with pytest.raises(ServingError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        storage_uri(source, ROOT)
    assert storage_uri(f"{ROOT}/1/x/artifacts/model", ROOT) == f"{ROOT}/1/x/artifacts/model"


def test_a_version_without_its_run_is_refused():
    s = read_service({"name": "chat", "team": "research", "model": "tiny-gpt:3"})
    with pytest.raises(ServingError, match="must lead back to the run that trained it"):
        inference_service(s, ServedVersion(3, "", VERSION.source), ServingPlacement.from_contract(contract(), s))


def test_a_pool_the_platform_does_not_lend_to_serving_is_refused():
    s = read_service({"name": "chat", "team": "research", "model": "tiny-gpt:3", "pool": "l4-spot"})
    with pytest.raises(ServingError, match="service.pool 'l4-spot' is not a serving pool of this platform"):
        ServingPlacement.from_contract(contract(), s)
    no_serving = PlatformContract.from_document(contract_doc(), "test")
    with pytest.raises(ServingError, match="does not serve models"):
        ServingPlacement.from_contract(no_serving, s)


def test_the_route_is_valid_kubernetes_and_splits_by_weight():
    s = read_service({"name": "chat", "team": "research", "model": "tiny-gpt:3"})
    doc = route_document(s, [Backend(3, 90, "stable", RUN), Backend(4, 10, "canary")], "team-research")
    assert [(b["version"], b["weight"], b["url"]) for b in doc["backends"]] == [
        ("3", 90, "http://chat-v3-predictor.team-research.svc.cluster.local:80"),
        ("4", 10, "http://chat-v4-predictor.team-research.svc.cluster.local:80")]
    objects = route_objects(s, doc, ServingPlacement.from_contract(contract(), s))
    for obj in objects:
        kubernetes_validate.validate(obj, K8S, strict=True)
    cm, deployment, service = objects
    assert set(cm["data"]) == {"route.json"} and service["metadata"]["name"] == "chat"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == contract().image
    with pytest.raises(ServingError, match=r"weights \[90, 20\] must add up to 100"):
        route_document(s, [Backend(3, 90, "stable"), Backend(4, 20, "canary")], "team-research")


def test_the_pod_kserve_makes_meets_pod_security_restricted():
    pod = predictor_pod(render(), storage_container({"AWS_REGION": "us-east-1"}))
    assert [c["image"] for c in pod["spec"]["initContainers"]] == [STORAGE_INITIALIZER_IMAGE]
    assert pod["metadata"]["labels"]["serving.kserve.io/inferenceservice"] == "chat-v3"
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **pod["metadata"]},
                                  "spec": pod["spec"]}, K8S, strict=True)
    assert pod_security.evaluate(pod, "restricted", K8S) == []
    init = pod["spec"]["initContainers"][0]
    # KServe's storage reads its region as AWS_DEFAULT_REGION (kserve_storage.py at v0.20.0).
    assert {e["name"]: e["value"] for e in init["env"]} == {"AWS_REGION": "us-east-1",
                                                             "AWS_DEFAULT_REGION": "us-east-1"}


def test_the_storage_container_fits_kserves_crd():
    assert crd.validate(storage_container({})).problems == []


def test_each_team_gets_least_privilege_accounts_and_one_promotion_loop():
    objects = team_serving_objects("team-research", image=contract().image, cpu_node_selector=SYSTEM,
                                   prometheus="http://prom:9090", tracking_uri="http://mlflow:5000",
                                   identity_annotations={"iam.gke.io/gcp-service-account": "m@p.iam"})
    for obj in objects:
        kubernetes_validate.validate(obj, K8S, strict=True)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    model = by[("ServiceAccount", "model-server")]
    assert model["automountServiceAccountToken"] is False
    assert model["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "m@p.iam"}
    assert router_rules() == [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]
    verbs = {(r, g): set(rule["verbs"]) for rule in promoter_rules() for r in rule["resources"] for g in rule["apiGroups"]}
    assert verbs[("inferenceservices", "serving.kserve.io")] == {"get", "list", "watch", "delete"}
    assert not any("create" in v for (r, _), v in verbs.items() if r in ("inferenceservices", "configmaps"))
    loop = by[("Deployment", "serving-promoter")]
    assert loop["spec"]["replicas"] == 1 and loop["spec"]["strategy"] == {"type": "Recreate"}
    container = loop["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "gpu_train.serving.promote"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"} in container["env"]
