"""Serving on the cluster: the serving alerts (promtool), the dashboard's queries, the team namespaces' network holes,
and the plans of the dev stacks with serving enabled (tools/variants.py): cert-manager, KServe and its CRDs, the
stack's InferenceService reading MLflow's artifacts with a read-only identity, the admission policies and the
policy pack over its pods; the stacks without serving hold none of it.

Run: .venv/bin/pytest tests/infra/k8s/test_serving.py -q
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import yaml

from gpu_train.jobs.serving import predictor_pod
from gpu_train.spec import naming
from gpu_train.spec.pod_rules import SERVING_IMAGES
from gpu_train.spec.serving import KSERVE_VERSION, STORAGE_INITIALIZER_IMAGE
from gpu_train.spec.settings import ServingSettings
from infra.k8s import monitoring, serving
from infra.plan import kubernetes_objects
from policies.check import check_plan, load_config
from policies.kubernetes import allow_all_problems
from tests.conftest import SERVING_VARIANTS, resources_of
from tests.infra.k8s.checks import run_checkov
from tests.infra.k8s.vap import Admission

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULES = serving.RULES
TESTS = RULES.parent / "tests" / "serving.test.yaml"
RUN = "0f3c2a9e8b7d4c6a9e1b2d3f4a5c6e7f"  # examples/serving.yaml's run


def promtool_test(tmp_path, settings: ServingSettings) -> subprocess.CompletedProcess:
    (tmp_path / "serving.yaml").write_text(yaml.safe_dump({"groups": serving.rule_groups(settings)}))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    return subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / TESTS.name)], capture_output=True, text=True,
                          timeout=60)


def test_the_serving_alerts_pass_promtool_and_their_unit_tests(tmp_path):
    check = subprocess.run([PROMTOOL, "check", "rules", "/dev/stdin"], capture_output=True, text=True, timeout=60,
                           input=yaml.safe_dump({"groups": serving.rule_groups(ServingSettings())}))
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    proc = promtool_test(tmp_path, ServingSettings())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = {r["alert"] for g in serving.rule_groups(ServingSettings()) for r in g["rules"]}
    tested = {c["alertname"] for t in yaml.safe_load(TESTS.read_text())["tests"] for c in t["alert_rule_test"]
              if c["exp_alerts"]}
    assert alerts == tested == {"ServingLatencyHigh", "ServingErrorRateHigh", "ServingRouteDown"}


@pytest.mark.parametrize("change", [{"latency_alert_ms": 1000}, {"error_rate_alert": 0.05}])
def test_the_unit_tests_notice_another_threshold(tmp_path, change):
    """The unit tests pin the defaults (p99 500 ms, 1%): other settings must make them fail, so the stack's
    thresholds really reach the rules."""
    assert promtool_test(tmp_path, ServingSettings(**change)).returncode != 0


def test_the_dashboard_reads_the_routes_series(tmp_path):
    """The dashboard's p99 query, over the latency alert's unit-test series, gives the p99 computed by hand
    (0.875 s for version 3); its error-ratio query gives 2% for version 3."""
    board = json.loads(monitoring.load_dashboards(serving.DASHBOARDS)["serving.json"])
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"]}
    assert set(exprs) == {"Requests per second, by version", "Share of 5xx answers, by version",
                          "Latency p50 / p95 / p99, by version", "Route weights"}
    tests = yaml.safe_load(TESTS.read_text())["tests"]

    def evaluate(expr: str, series: list, v3: float, v4: float) -> None:
        """The query over the series, in ten-thousandths (round: promtool compares floats exactly)."""
        query = expr.replace("$namespace", "team-research").replace("$service", "chat").replace("$__rate_interval",
                                                                                                 "5m")
        labels = '{{namespace="team-research", service="chat", version="{}"}}'
        doc = {"evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": f"round(({query}) * 10000)", "eval_time": "20m", "exp_samples": [
                {"labels": labels.format(3), "value": v3 * 10000}, {"labels": labels.format(4), "value": v4 * 10000}]}]}]}
        path = tmp_path / "dashboard.test.yaml"
        path.write_text(yaml.safe_dump(doc))
        proc = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    # Version 4's p99 is within (0, 0.2]: 0.2 * 0.99 = 0.198 s; its error ratio 1 in 200.
    evaluate(exprs["Latency p50 / p95 / p99, by version"][2], tests[0]["input_series"], 0.875, 0.198)
    evaluate(exprs["Share of 5xx answers, by version"][0], tests[1]["input_series"], 0.02, 0.005)


def test_the_team_holes_admit_no_one_from_everywhere():
    platform = SimpleNamespace(api_server_cidrs=["10.10.0.0/28"])  # what team_policies reads of the platform
    for name, spec in serving.team_policies(platform):
        assert allow_all_problems({"kind": "NetworkPolicy", "spec": spec}) == [], name
    _, spec = serving.prometheus_from_promoters()
    assert allow_all_problems({"kind": "NetworkPolicy", "spec": spec}) == []


# ------------------------------------------------------------------------------------------- the plans


def objects(plan: dict, kind: str) -> list[dict]:
    return [o for o in kubernetes_objects(plan) if o["kind"] == kind]


@pytest.mark.parametrize("stack", SERVING_VARIANTS)
def test_a_serving_plan_holds_kserve_its_crds_and_the_stacks_service(serving_plans, stack):
    plan = serving_plans[stack]
    releases = {r["inputs"]["name"]: r["inputs"] for r in resources_of(plan, "kubernetes:helm.sh/v3:Release")}
    assert releases["cert-manager"]["version"] == serving.CERT_MANAGER_VERSION == "v1.21.1"
    assert releases["cert-manager"]["values"]["crds"] == {"enabled": True, "keep": True}
    assert (releases["kserve-crd"]["chart"], releases["kserve-crd"]["version"]) == (serving.KSERVE_CRD_CHART,
                                                                                   KSERVE_VERSION)
    assert releases["kserve"]["values"]["kserve"]["controller"]["deploymentMode"] == "Standard"
    (isvc,) = objects(plan, "InferenceService")
    assert (isvc["metadata"]["name"], isvc["metadata"]["namespace"]) == ("chat-v3", "team-research")
    assert isvc["metadata"]["annotations"]["gpu-train.io/mlflow-run-id"] == RUN
    container = isvc["spec"]["predictor"]["containers"][0]
    artifacts = plan["outputs"]["artifactsBucket"]
    storage_uri = next(e["value"] for e in container["env"] if e["name"] == "STORAGE_URI")
    assert storage_uri == f"{artifacts}/mlflow/1/{RUN}/artifacts/model"
    (storage,) = objects(plan, "ClusterStorageContainer")
    assert storage["spec"]["container"]["image"] == STORAGE_INITIALIZER_IMAGE
    contract = plan["outputs"]["platform"]["serving"]
    assert contract["artifactsRoot"] == f"{artifacts}/mlflow" and contract["kserveVersion"] == KSERVE_VERSION
    assert {o["metadata"]["name"] for o in objects(plan, "PodMonitor")} >= {serving.ROUTES_MONITOR}
    rules = {r["alert"] for o in objects(plan, "PrometheusRule") for g in o["spec"]["groups"] for r in g["rules"]
             if "alert" in r}
    assert {"ServingLatencyHigh", "ServingErrorRateHigh", "ServingRouteDown"} <= rules
    workloads = next(r for o in objects(plan, "PrometheusRule") for g in o["spec"]["groups"] for r in g["rules"]
                     if r.get("alert") == "PlatformWorkloadUnavailable")
    assert "cert-manager|" in workloads["expr"] and "|kserve|" in workloads["expr"]
    for ns in {naming.team_namespace(t["name"]) for t in plan["outputs"]["platform"]["teams"]}:
        names = {(o["kind"], o["metadata"]["name"]) for o in kubernetes_objects(plan)
                 if o["metadata"].get("namespace") == ns}
        assert {("ServiceAccount", "model-server"), ("Role", "serving-promoter"), ("Deployment", "serving-promoter"),
                ("NetworkPolicy", "allow-serving-models")} <= names


def test_the_model_servers_identity_reads_mlflows_artifacts_only(serving_plans):
    aws = serving_plans["aws-dev-serving"]
    bucket = aws["outputs"]["artifactsBucket"].removeprefix("s3://")
    policy = next(r for r in resources_of(aws, "aws:iam/rolePolicy:RolePolicy")
                  if r["name"] == "identities-serving-research")
    statements = {s["Sid"]: s for s in json.loads(policy["inputs"]["policy"])["Statement"]}
    assert statements["ArtifactsRead"]["Action"] == "s3:GetObject"
    assert statements["ArtifactsRead"]["Resource"] == f"arn:aws:s3:::{bucket}/mlflow/*"
    assert statements["ArtifactsListPrefix"]["Condition"] == {"StringLike": {"s3:prefix": ["mlflow/", "mlflow/*"]}}
    assert all("Put" not in str(s["Action"]) and "Delete" not in str(s["Action"]) for s in statements.values())
    association = next(r for r in resources_of(aws, "aws:eks/podIdentityAssociation:PodIdentityAssociation")
                       if r["name"] == "identities-serving-research")
    assert (association["inputs"]["namespace"], association["inputs"]["serviceAccount"]) == ("team-research",
                                                                                             "model-server")
    gcp = serving_plans["gcp-dev-serving"]
    grants = {r["inputs"]["role"]: r["inputs"] for r in resources_of(gcp, "gcp:storage/bucketIAMMember:BucketIAMMember")
              if r["name"].startswith("identities-serving-research-")}
    assert set(grants) == {"roles/storage.objectViewer", "roles/storage.legacyBucketReader"}
    assert grants["roles/storage.objectViewer"]["condition"]["expression"].endswith('/objects/mlflow/")')


def test_the_stacks_without_serving_hold_none_of_it(stack_plans):
    for stack, plan in stack_plans.items():
        assert not [r for r in plan["resources"] if "kserve" in r["urn"] or "cert-manager" in r["urn"]
                    or "serving" in r["name"]], stack
        assert "serving" not in plan["outputs"]["platform"], stack
        vap = json.dumps([o for o in kubernetes_objects(plan) if o["kind"] == "ValidatingAdmissionPolicy"])
        assert "kserve-container" not in vap, stack


def _predictor(plan: dict) -> dict:
    (isvc,) = objects(plan, "InferenceService")
    (storage,) = objects(plan, "ClusterStorageContainer")
    pod = predictor_pod(isvc, storage)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**pod["metadata"], "name": "chat-v3-predictor-x"},
            "spec": pod["spec"]}


def test_the_admission_policies_admit_kserves_pinned_pods_only_where_the_stack_serves(serving_plans, stack_plans):
    plan = serving_plans["aws-dev-serving"]
    pod = _predictor(plan)
    assert [c["image"] for c in pod["spec"]["initContainers"]] == [STORAGE_INITIALIZER_IMAGE]
    assert Admission(kubernetes_objects(plan)).denials(pod, "team-research") == []
    other_tag = copy.deepcopy(pod)
    other_tag["spec"]["containers"][0]["image"] = "docker.io/kserve/huggingfaceserver:v0.19.0"
    assert sorted(m.split(":")[0] for m in Admission(kubernetes_objects(plan)).denials(other_tag, "team-research")) \
        == ["image-digest", "image-registry"]
    renamed = copy.deepcopy(pod)
    renamed["spec"]["containers"][0]["name"] = "server"
    assert Admission(kubernetes_objects(plan)).denials(renamed, "team-research")
    # The same pod in a stack that does not serve: its policies carry no grant for KServe's images.
    denied = Admission(kubernetes_objects(stack_plans["aws-dev"])).denials(pod, "team-research")
    assert {m.split(":")[0] for m in denied} == {"image-digest", "image-registry"}
    assert set(SERVING_IMAGES) == {c["name"] for c in [*pod["spec"]["containers"], *pod["spec"]["initContainers"]]}


def test_the_policy_pack_judges_the_inference_service(serving_plans):
    plan = serving_plans["gcp-dev-serving"]
    assert [f for f in check_plan(plan, load_config(None), "gcp-dev-serving") if f.level == "mandatory"] == []
    broken = copy.deepcopy(plan)
    isvc = next(r for r in broken["resources"] if r["type"].endswith(":InferenceService"))
    isvc["inputs"]["spec"]["predictor"]["containers"][0]["image"] = "docker.io/kserve/huggingfaceserver:latest"
    isvc["inputs"]["spec"]["predictor"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    found = {f.violation.rule.id for f in check_plan(broken, load_config(None), "gcp-dev-serving")
             if f.level == "mandatory"}
    assert {"training-image-digest", "training-pod-security"} <= found, found


def test_the_serving_plans_pass_checkov(variant_plan_dir, tmp_path):
    """Every object of the serving variants, the routes' and promotion loops' among them, passes checkov; the one
    skip they carry (CKV_K8S_38, an API token) says why in the object's own annotation."""
    assert run_checkov({s: variant_plan_dir / s / "k8s" for s in SERVING_VARIANTS}, tmp_path) == []
