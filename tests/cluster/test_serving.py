"""`gpu-train serve` and the namespace's promotion loop on the real control plane, as the team's users and as the
loop's own service account (its Role only): deploy creates a version's InferenceService (stored against KServe's
CRD) and the service's route, and the next version replaces it; a canary by hand takes its share, shows in status,
and promote / rollback move the route, remove the right version and leave Events and decisions; a canary handed to
the promotion loop is quality-checked, started, advanced and promoted as Prometheus's numbers say, or rolled back
when its answers fail the check; a viewer reads status but may not deploy, refused by the real RBAC. Every
assertion is on what the real API server holds afterwards.

What stands in for what this plane does not run:
- KServe's controller (`kserve_ready`): once the test decides a version's predictor is ready, it reads back the
  InferenceService the product created, checks it, and as the admin writes its status (Ready, PredictorReady, url,
  components) through the API server's status subresource, as KServe does.
- A predictor answering through the service proxy: the real API server proxies only to global unicast addresses,
  and this plane's pods have loopback ones, which an Endpoints object may not even hold, so no predictor answers
  here. `test_the_loop_may_reach_predictors_and_says_in_one_line_when_the_server_refuses` shows the loop's identity
  allowed the service proxy by the real RBAC and the real server's refusal logged in one line. For the quality
  check's answers, the one method that reaches a predictor, `ServingCluster.complete`
  (gpu_train/serving/cluster.py), is replaced on the loop's ServingCluster by a POST of the same request to a local
  HTTP server on 127.0.0.1 that answers as each version's predictor (`predictors`); everything else the loop does
  goes to the real API server.
- Prometheus: the canary's numbers come from the table of tests/gpu_train/serving/test_canary.py.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_serving.py -q
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpu_train.serving import promote
from gpu_train.serving.cluster import ServingCluster
from gpu_train.spec import naming
from tests.cluster.conftest import wait_for
from tests.cluster.jobs import NS, service_account_kubeconfig
from tests.gpu_train.cli.conftest import only_error_lines
from tests.gpu_train.serving.test_canary import Table

RUN = "0123456789abcdef0123456789abcdef"
KSERVE = ("serving.kserve.io", "v1beta1", NS, "inferenceservices")
QUALITY = {"prompts": [{"prompt": "def f(", "expect": "return"}], "minScore": 1.0}


def admin(platform) -> k8s.ApiClient:
    return k8s_config.new_client_from_config(str(platform.plane.admin_kubeconfig))


def isvc_names(platform, service: str) -> list[str]:
    found = k8s.CustomObjectsApi(admin(platform)).list_namespaced_custom_object(
        *KSERVE, label_selector=f"{naming.SERVICE_LABEL}={service}")
    return sorted(i["metadata"]["name"] for i in found["items"])


def route_data(platform, service: str) -> dict[str, str]:
    return platform.core().read_namespaced_config_map(naming.route_name(service), NS).data or {}


def routed(platform, service: str) -> list[tuple[str, int, str]]:
    return [(b["version"], b["weight"], b["role"])
            for b in json.loads(route_data(platform, service)["route.json"])["backends"]]


def decisions(platform, service: str) -> list[dict]:
    return json.loads(route_data(platform, service).get("decisions.json", "[]"))


def events(platform, service: str) -> list:
    """The Events on the service's route ConfigMap (the product's; the Deployment's are the cluster's own)."""
    return platform.core().list_namespaced_event(
        NS, field_selector=f"involvedObject.kind=ConfigMap,involvedObject.name={naming.route_name(service)}").items


@contextmanager
def kserve_ready(platform, *names: str) -> Iterator[None]:
    """KServe's part (module docstring): each named InferenceService, once the product has created it, checked and
    reported Ready through the status subresource, in order, while the test's command waits for it."""
    custom, failed = k8s.CustomObjectsApi(admin(platform)), []

    def run() -> None:
        try:
            for name in names:
                isvc = wait_for(f"InferenceService {name}", lambda n=name: next(
                    (i for i in custom.list_namespaced_custom_object(*KSERVE)["items"]
                     if i["metadata"]["name"] == n), None), timeout=60, every=0.05)
                predictor = isvc["spec"]["predictor"]
                assert predictor["serviceAccountName"] == naming.MODEL_SERVER_SERVICE_ACCOUNT, predictor
                assert isvc["metadata"]["annotations"]["gpu-train.io/mlflow-run-id"] == RUN
                url = f"http://{name}.{NS}.svc.cluster.local"
                custom.patch_namespaced_custom_object_status(*KSERVE, name, {"status": {
                    "url": url, "address": {"url": url},
                    "components": {"predictor": {"url": f"http://{name}-predictor.{NS}.svc.cluster.local"}},
                    "conditions": [{"type": t, "status": "True", "lastTransitionTime": "2026-03-01T10:00:00Z"}
                                   for t in ("PredictorReady", "Ready")]}})
        except BaseException as exc:  # noqa: BLE001 (said in the test's thread)
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    thread.join(timeout=90)
    assert not failed, failed


@pytest.fixture
def served(platform, monkeypatch):
    """A service name per test; afterwards its versions, route, Events and the route's pods are gone."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    names: list[str] = []
    yield names.append
    api = admin(platform)
    core, apps, custom = platform.core(), k8s.AppsV1Api(api), k8s.CustomObjectsApi(api)
    for service in names:
        for name in isvc_names(platform, service):
            custom.delete_namespaced_custom_object(*KSERVE, name)
        route = naming.route_name(service)
        for delete, name in ((core.delete_namespaced_config_map, route), (core.delete_namespaced_service, service),
                             (apps.delete_namespaced_deployment, route)):
            try:
                delete(name, NS, propagation_policy="Foreground")
            except k8s.ApiException as exc:
                assert exc.status == 404, exc
        for e in events(platform, service):
            core.delete_namespaced_event(e.metadata.name, NS)
        wait_for(f"everything of service {service} gone", lambda s=service: not isvc_names(platform, s) and not [
            d for d in apps.list_namespaced_deployment(NS).items if d.metadata.name == naming.route_name(s)] and not
            core.list_namespaced_pod(NS, label_selector=f"{naming.SERVICE_LABEL}={s}").items and not events(platform, s))


def serve(cli, platform, tmp_path, service: str, *args: str, user: str = "alice", **extra):
    flags = []
    if args[0] in ("deploy", "canary"):
        path = tmp_path / f"{service}.yaml"
        path.write_text(yaml.safe_dump({"source": f"mlflow-artifacts:/1/{RUN}/artifacts/model", "runId": RUN,
                                        "resources": {"cpu": "1", "memory": "4Gi"}, **extra}))
        flags = ["--spec", str(path)]
    return cli("serve", *args, "--name", service, "--kubeconfig", platform.kubeconfigs[user], *flags)


def deploy(cli, platform, tmp_path, service: str, version: int, *args: str, **extra) -> str:
    with kserve_ready(platform, naming.version_name(service, version)):
        code, out, err = serve(cli, platform, tmp_path, service, "canary" if args else "deploy",
                               f"tiny-gpt:{version}", *args, **extra)
    assert code == 0, err
    return out


def test_deploy_creates_the_version_and_its_route_and_the_next_one_replaces_it(cli, platform, tmp_path, served):
    served("sv-deploy")
    out = deploy(cli, platform, tmp_path, "sv-deploy", 3)
    assert "deployed tiny-gpt:3 as service sv-deploy in team-research" in out
    assert isvc_names(platform, "sv-deploy") == ["sv-deploy-v3"]
    # The route: its ConfigMap, its replicas (admitted, placed on a system node by the scheduler) and its Service.
    pods = wait_for("the route's replicas Running", lambda: [
        p for p in platform.core().list_namespaced_pod(NS, label_selector=f"{naming.SERVICE_LABEL}=sv-deploy").items
        if p.status.phase == "Running"])
    assert platform.core().read_node(pods[0].spec.node_name).metadata.labels.get(naming.SYSTEM_LABEL) == "true"
    assert platform.core().read_namespaced_service("sv-deploy", NS).spec.cluster_ip
    assert routed(platform, "sv-deploy") == [("3", 100, "stable")]
    deploy(cli, platform, tmp_path, "sv-deploy", 4)
    assert isvc_names(platform, "sv-deploy") == ["sv-deploy-v4"]
    assert routed(platform, "sv-deploy") == [("4", 100, "stable")]


def test_a_canary_by_hand_is_promoted_or_rolled_back(cli, platform, tmp_path, served):
    served(svc := "sv-hand")
    deploy(cli, platform, tmp_path, svc, 3)
    out = deploy(cli, platform, tmp_path, svc, 4, "--traffic", "10")
    assert "canary tiny-gpt:4 takes 10% of sv-hand" in out
    assert routed(platform, svc) == [("3", 90, "stable"), ("4", 10, "canary")]
    code, out, err = serve(cli, platform, tmp_path, svc, "status", user="vera")
    assert code == 0, err
    status = yaml.safe_load(out)
    assert status["canary"]["version"] == 4 and status["canary"]["driver"] == "manual"
    assert sorted((v["version"], v["role"], v["weight"], v["ready"]) for v in status["versions"]) == [
        ("3", "stable", 90, True), ("4", "canary", 10, True)]
    code, out, err = serve(cli, platform, tmp_path, svc, "promote")
    assert code == 0 and "promoted by hand" in out, err
    assert routed(platform, svc) == [("4", 100, "stable")]
    assert isvc_names(platform, svc) == ["sv-hand-v4"]
    assert "canary.json" not in route_data(platform, svc)
    assert [d["action"] for d in decisions(platform, svc)] == ["start", "promote"]
    assert [e.reason for e in events(platform, svc)].count("CanaryPromoted") == 1

    deploy(cli, platform, tmp_path, svc, 5, "--traffic", "20")
    code, out, err = serve(cli, platform, tmp_path, svc, "rollback")
    assert code == 0 and "rolled back by hand" in out, err
    assert routed(platform, svc) == [("4", 100, "stable")]
    assert isvc_names(platform, svc) == ["sv-hand-v4"]
    assert [d["action"] for d in decisions(platform, svc)] == ["start", "promote", "start", "rollback"]
    warning = next(e for e in events(platform, svc) if e.reason == "CanaryRolledBack")
    assert warning.type == "Warning" and warning.involved_object.name == "sv-hand-route"
    code, _, err = serve(cli, platform, tmp_path, svc, "promote")
    assert code == 2 and only_error_lines(err) and "service 'sv-hand' has no canary on trial" in err


@pytest.fixture
def predictors() -> Iterator[tuple[dict[str, str], list[str], str]]:
    """A local HTTP server on 127.0.0.1 answering OpenAI completions as each predictor: (answers by predictor,
    the predictors asked in order, its URL)."""
    answers: dict[str, str] = {}
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            predictor, _, path = self.path.strip("/").partition("/")
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(predictor)
            ok = path == "openai/v1/completions" and predictor in answers and body["temperature"] == 0
            data = json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": answers[predictor],
                                                                         "finish_reason": "length"}]}
                              if ok else {"error": f"no predictor {predictor} at {path}"}).encode()
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield answers, asked, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def loop_cluster(platform, monkeypatch, predictors_url: str | None = None) -> ServingCluster:
    """The promotion loop's ServingCluster with its own identity; with `predictors_url`, its `complete` (the one
    method that reaches a predictor) asks the local server instead of the API server's service proxy."""
    me = service_account_kubeconfig(platform, naming.PROMOTER_SERVICE_ACCOUNT)
    cluster = ServingCluster(k8s_config.new_client_from_config(config_file=str(me)), NS)
    if predictors_url:
        def complete(service: str, version: int, prompt: str, max_tokens: int) -> str:
            answer = requests.post(f"{predictors_url}/{naming.version_name(service, version)}-predictor/openai/v1/"
                                   "completions", json={"model": service, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}, timeout=10)
            answer.raise_for_status()
            return answer.json()["choices"][0]["text"]
        monkeypatch.setattr(cluster, "complete", complete)
    return cluster


def test_the_promotion_loop_drives_a_canary_with_its_own_role(cli, platform, tmp_path, served, predictors,
                                                              monkeypatch):
    served(svc := "sv-loop")
    answers, asked, url = predictors
    deploy(cli, platform, tmp_path, svc, 3)
    out = deploy(cli, platform, tmp_path, svc, 4, "--traffic", "10", "--auto",
                 canary={"steps": [10, 50], "stepSeconds": 60, "intervalSeconds": 10, "minRequests": 20,
                         "quality": QUALITY})
    assert "handed to the promotion loop of team-research" in out
    assert routed(platform, svc) == [("3", 100, "stable"), ("4", 0, "canary")]
    answers.update({"sv-loop-v3-predictor": "): return 1", "sv-loop-v4-predictor": "): return 2"})
    cluster = loop_cluster(platform, monkeypatch, url)
    prom, last = Table(), {}
    t0 = json.loads(route_data(platform, svc)["canary.json"])["state"]["started_at"]

    assert promote.once(cluster, prom, None, last, t0 + 1) >= 1  # quality check passed: 10%
    assert asked == ["sv-loop-v4-predictor", "sv-loop-v3-predictor"]
    assert routed(platform, svc) == [("3", 90, "stable"), ("4", 10, "canary")]
    assert promote.once(cluster, prom, None, last, t0 + 5) == 0  # not due before intervalSeconds
    # The first step started when the loop started it (its clock), a few seconds after the canary was made.
    s0 = json.loads(route_data(platform, svc)["canary.json"])["state"]["step_started_at"]
    prom.now = {"3": (500, 0, 0.08), "4": (60, 0, 0.09)}
    assert promote.once(cluster, prom, None, last, s0 + 62) == 1  # a held step of 60 s: 50%
    assert routed(platform, svc) == [("3", 50, "stable"), ("4", 50, "canary")]
    assert promote.once(cluster, prom, None, last, s0 + 123) == 1  # the last step held: promoted
    assert routed(platform, svc) == [("4", 100, "stable")]
    assert isvc_names(platform, svc) == ["sv-loop-v4"]
    assert [d["action"] for d in decisions(platform, svc)] == ["start", "advance", "promote"]
    assert sorted(e.reason for e in events(platform, svc)) == ["CanaryAdvanced", "CanaryPromoted", "CanaryStarted"]
    assert {e.source.component for e in events(platform, svc)} == {"gpu-train-serving"}


def test_a_canary_failing_its_quality_check_never_takes_traffic(cli, platform, tmp_path, served, predictors,
                                                                monkeypatch):
    served(svc := "sv-bad")
    answers, asked, url = predictors
    deploy(cli, platform, tmp_path, svc, 3)
    deploy(cli, platform, tmp_path, svc, 4, "--traffic", "10", "--auto", canary={"quality": QUALITY})
    answers.update({"sv-bad-v3-predictor": "): return 1", "sv-bad-v4-predictor": "): pass"})
    assert promote.once(loop_cluster(platform, monkeypatch, url), Table(), None, {}, 1e10) >= 1
    assert routed(platform, svc) == [("3", 100, "stable")]
    assert isvc_names(platform, svc) == ["sv-bad-v3"]
    last = decisions(platform, svc)[-1]
    assert last["action"] == "rollback" and last["reason"] == "quality 0% < minScore 100%"
    assert last["metrics"]["quality"] == {"canary": 0.0, "stable": 1.0, "prompts": 1}
    assert [e.type for e in events(platform, svc) if e.reason == "CanaryRolledBack"] == ["Warning"]


def test_the_loop_may_reach_predictors_and_says_in_one_line_when_the_server_refuses(cli, platform, tmp_path, served,
                                                                                    monkeypatch, caplog):
    """The real RBAC allows the loop's account the service proxy in its namespace and nowhere else; the real
    server then refuses to reach a predictor this plane cannot have (no Endpoints for loopback pods), and the loop
    logs that in one line and leaves the canary untouched, to try again."""
    user = f"system:serviceaccount:{NS}:{naming.PROMOTER_SERVICE_ACCOUNT}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{NS}", "system:authenticated"]
    authz = k8s.AuthorizationV1Api(admin(platform))

    def allowed(ns: str) -> bool:
        review = authz.create_subject_access_review({"spec": {"user": user, "groups": groups, "resourceAttributes": {
            "namespace": ns, "verb": "create", "resource": "services", "subresource": "proxy",
            "name": "sv-proxy-v4-predictor"}}})
        return review.status.allowed

    assert allowed(NS) and not allowed("team-platform")
    served(svc := "sv-proxy")
    deploy(cli, platform, tmp_path, svc, 3)
    deploy(cli, platform, tmp_path, svc, 4, "--traffic", "10", "--auto", canary={"quality": QUALITY})
    before = route_data(platform, svc)
    with caplog.at_level(logging.ERROR, logger=promote.LOG.name):
        assert promote.once(loop_cluster(platform, monkeypatch), Table(), None, {}, 1e10) >= 1
    (line,) = [r.getMessage() for r in caplog.records if svc in r.getMessage()]
    assert "\n" not in line, line
    assert line == ('canary of service sv-proxy: the API server answered 404 Not Found: services '
                    '"sv-proxy-v4-predictor" not found'), line
    assert route_data(platform, svc) == before and not decisions(platform, svc)  # still to start, as it was
    assert routed(platform, svc) == [("3", 100, "stable"), ("4", 0, "canary")]


def test_a_viewer_reads_but_does_not_deploy(cli, platform, tmp_path, served):
    served("sv-view")
    code, _, err = serve(cli, platform, tmp_path, "sv-view", "deploy", "tiny-gpt:3", user="vera")
    assert code == 1 and only_error_lines(err)
    assert 'User "vera" cannot create resource "inferenceservices" in API group "serving.kserve.io"' in err
    assert isvc_names(platform, "sv-view") == []
    code, _, err = serve(cli, platform, tmp_path, "sv-view", "status", user="vera")
    assert code == 2 and "service 'sv-view' is not deployed in team-research" in err
