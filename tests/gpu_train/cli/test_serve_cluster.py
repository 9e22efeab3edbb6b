"""`gpu-train serve` against a cluster: the fake API server (tests/gpu_train/cli/fake_api.py) checks every
InferenceService against KServe's CRD and every request against the platform's own Roles (a serving stack's team
roles, the promotion loop's Role), so these say that the commands work with exactly the rights the platform grants.

- deploy creates the version's InferenceService and the service's route; deploying the next version moves the
  route and removes the one it replaced;
- a canary by hand takes its share, shows in status, and promote / rollback move the route, remove the right
  version and leave an Event and a decision;
- a canary handed to the namespace's promotion loop (gpu_train.serving.promote.once, with the loop's own token) is
  quality-checked through the service proxy, started, advanced and promoted as Prometheus's numbers say;
- a viewer reads status but may not deploy, in one line.

Run: .venv/bin/pytest tests/gpu_train/cli/test_serve_cluster.py -q
"""

from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import config as k8s_config

from gpu_train.serving import promote
from gpu_train.serving.cluster import ServingCluster
from gpu_train.spec import naming
from gpu_train.spec.contract import Serving
from gpu_train.spec.serving import RUNTIME_IMAGES
from tests.gpu_train.cli.conftest import ALICE, TEAMS, VIEWER, contract_doc, only_error_lines
from tests.gpu_train.cli.fake_api import FakeApi
from tests.gpu_train.serving.test_canary import Table

RUN = "0123456789abcdef0123456789abcdef"
ROOT = "s3://gpu-train-aws-dev-artifacts/mlflow"
NS = "team-research"
LOOP = "promoter-token"


@pytest.fixture
def api(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    doc = contract_doc()
    doc["serving"] = Serving(kserve_version="v0.20.0", runtime_images=dict(RUNTIME_IMAGES), artifacts_root=ROOT,
                             cpu_node_selector={"gpu-train.io/system": "true"}, gpu_pools=[],
                             prometheus="http://prom:9090", scrape_interval_seconds=15).document()
    users = {ALICE: ("alice", {NS: "serving-submitter"}), VIEWER: ("vera", {NS: "serving-viewer"}),
             LOOP: (f"system:serviceaccount:{NS}:{naming.PROMOTER_SERVICE_ACCOUNT}", {NS: "promoter"})}
    with FakeApi(users) as server:
        for team in TEAMS:
            server.put_configmap(naming.team_namespace(team.name), naming.PLATFORM_CONFIGMAP,
                                 {naming.PLATFORM_CONFIGMAP_KEY: json.dumps(doc)})
        yield server


def spec_file(tmp_path, **extra) -> str:
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump({"source": f"mlflow-artifacts:/1/{RUN}/artifacts/model", "runId": RUN,
                                    "resources": {"cpu": "1", "memory": "4Gi"}, **extra}))
    return str(path)


def routed(api: FakeApi) -> list[tuple[str, int, str]]:
    cm = api.get("configmaps", NS, "chat-route")
    return [(b["version"], b["weight"], b["role"]) for b in json.loads(cm["data"]["route.json"])["backends"]]


def decisions(api: FakeApi) -> list[str]:
    return [d["action"] for d in json.loads(api.get("configmaps", NS, "chat-route")["data"].get("decisions.json",
                                                                                                 "[]"))]


def events(api: FakeApi) -> list[str]:
    return [e["reason"] for e in api.of("events", NS)]


def serve(cli, api, tmp_path, *args, token=ALICE, **extra):
    kubeconfig = api.kubeconfig(tmp_path, token=token, namespace=NS)
    flags = ["--spec", spec_file(tmp_path, **extra)] if args[0] in ("deploy", "canary") else []
    return cli("serve", *args, "--name", "chat", "--kubeconfig", kubeconfig, *flags)


def test_deploy_creates_the_version_and_its_route_and_the_next_one_replaces_it(cli, api, tmp_path):
    code, out, err = serve(cli, api, tmp_path, "deploy", "tiny-gpt:3")
    assert code == 0, err
    assert "deployed tiny-gpt:3 as service chat in team-research" in out
    assert [i["metadata"]["name"] for i in api.of("inferenceservices", NS)] == ["chat-v3"]
    assert api.get("deployments", NS, "chat-route") and api.get("services", NS, "chat")
    assert routed(api) == [("3", 100, "stable")]
    code, _, err = serve(cli, api, tmp_path, "deploy", "tiny-gpt:4")
    assert code == 0, err
    assert [i["metadata"]["name"] for i in api.of("inferenceservices", NS)] == ["chat-v4"]
    assert routed(api) == [("4", 100, "stable")]


def test_a_canary_by_hand_is_promoted_or_rolled_back(cli, api, tmp_path):
    assert serve(cli, api, tmp_path, "deploy", "tiny-gpt:3")[0] == 0
    code, out, err = serve(cli, api, tmp_path, "canary", "tiny-gpt:4", "--traffic", "10")
    assert code == 0, err
    assert "canary tiny-gpt:4 takes 10% of chat" in out
    assert routed(api) == [("3", 90, "stable"), ("4", 10, "canary")]
    code, out, err = serve(cli, api, tmp_path, "status", token=VIEWER)
    assert code == 0, err
    status = yaml.safe_load(out)
    assert status["canary"]["version"] == 4 and status["canary"]["driver"] == "manual"
    assert sorted((v["version"], v["role"], v["weight"]) for v in status["versions"]) == [
        ("3", "stable", 90), ("4", "canary", 10)]
    code, out, err = serve(cli, api, tmp_path, "promote")
    assert code == 0 and "promoted by hand" in out, err
    assert routed(api) == [("4", 100, "stable")]
    assert [i["metadata"]["name"] for i in api.of("inferenceservices", NS)] == ["chat-v4"]
    assert "canary.json" not in api.get("configmaps", NS, "chat-route")["data"]
    assert decisions(api) == ["start", "promote"] and events(api).count("CanaryPromoted") == 1

    assert serve(cli, api, tmp_path, "canary", "tiny-gpt:5", "--traffic", "20")[0] == 0
    code, out, err = serve(cli, api, tmp_path, "rollback")
    assert code == 0 and "rolled back by hand" in out, err
    assert routed(api) == [("4", 100, "stable")]
    assert [i["metadata"]["name"] for i in api.of("inferenceservices", NS)] == ["chat-v4"]
    assert decisions(api) == ["start", "promote", "start", "rollback"]
    warning = next(e for e in api.of("events", NS) if e["reason"] == "CanaryRolledBack")
    assert warning["type"] == "Warning" and warning["involvedObject"]["name"] == "chat-route"
    code, _, err = serve(cli, api, tmp_path, "promote")
    assert code == 2 and only_error_lines(err) and "service 'chat' has no canary on trial" in err


def test_the_promotion_loop_drives_a_canary_with_its_own_role(cli, api, tmp_path):
    assert serve(cli, api, tmp_path, "deploy", "tiny-gpt:3")[0] == 0
    quality = {"prompts": [{"prompt": "def f(", "expect": "return"}], "minScore": 1.0}
    code, out, err = serve(cli, api, tmp_path, "canary", "tiny-gpt:4", "--traffic", "10", "--auto",
                           canary={"steps": [10, 50], "stepSeconds": 60, "intervalSeconds": 10, "minRequests": 20,
                                   "quality": quality})
    assert code == 0 and "handed to the promotion loop of team-research" in out, err
    assert routed(api) == [("3", 100, "stable"), ("4", 0, "canary")]
    api.completions = {(NS, "chat-v3-predictor"): "): return 1", (NS, "chat-v4-predictor"): "): return 2"}
    loop_config = api.kubeconfig(tmp_path, token=LOOP, namespace=NS, name="loop")
    cluster = ServingCluster(k8s_config.new_client_from_config(config_file=str(loop_config)), NS)
    prom, last = Table(), {}
    t0 = json.loads(api.get("configmaps", NS, "chat-route")["data"]["canary.json"])["state"]["started_at"]

    assert promote.once(cluster, prom, None, last, t0 + 1) == 1  # quality check passed: 10%
    assert routed(api) == [("3", 90, "stable"), ("4", 10, "canary")]
    assert promote.once(cluster, prom, None, last, t0 + 5) == 0  # not due before intervalSeconds
    prom.now = {"3": (500, 0, 0.08), "4": (60, 0, 0.09)}
    assert promote.once(cluster, prom, None, last, t0 + 62) == 1  # a held step of 60 s: 50%
    assert routed(api) == [("3", 50, "stable"), ("4", 50, "canary")]
    assert promote.once(cluster, prom, None, last, t0 + 123) == 1  # the last step held: promoted
    assert routed(api) == [("4", 100, "stable")]
    assert [i["metadata"]["name"] for i in api.of("inferenceservices", NS)] == ["chat-v4"]
    assert decisions(api) == ["start", "advance", "promote"]
    assert sorted(events(api)) == ["CanaryAdvanced", "CanaryPromoted", "CanaryStarted"]
    # The loop's requests were all its Role allows: reach predictors by the service proxy, no more.
    proxied = [r[1] for r in api.requests if "/proxy/" in r[1]]
    assert proxied == [f"/api/v1/namespaces/{NS}/services/chat-v{v}-predictor:80/proxy/openai/v1/completions"
                       for v in (4, 3)]


def test_a_canary_failing_its_quality_check_never_takes_traffic(cli, api, tmp_path):
    assert serve(cli, api, tmp_path, "deploy", "tiny-gpt:3")[0] == 0
    quality = {"prompts": [{"prompt": "def f(", "expect": "return"}], "minScore": 1.0}
    assert serve(cli, api, tmp_path, "canary", "tiny-gpt:4", "--traffic", "10", "--auto",
                 canary={"quality": quality})[0] == 0
    api.completions = {(NS, "chat-v3-predictor"): "): return 1", (NS, "chat-v4-predictor"): "): pass"}
    loop_config = api.kubeconfig(tmp_path, token=LOOP, namespace=NS, name="loop")
    cluster = ServingCluster(k8s_config.new_client_from_config(config_file=str(loop_config)), NS)
    assert promote.once(cluster, Table(), None, {}, 1e10) == 1
    assert routed(api) == [("3", 100, "stable")]
    assert [i["metadata"]["name"] for i in api.of("inferenceservices", NS)] == ["chat-v3"]
    last = json.loads(api.get("configmaps", NS, "chat-route")["data"]["decisions.json"])[-1]
    assert last["action"] == "rollback" and last["reason"] == "quality 0% < minScore 100%"
    assert last["metrics"]["quality"] == {"canary": 0.0, "stable": 1.0, "prompts": 1}


def test_a_viewer_reads_but_does_not_deploy(cli, api, tmp_path):
    code, _, err = serve(cli, api, tmp_path, "deploy", "tiny-gpt:3", token=VIEWER)
    assert code == 1 and only_error_lines(err)
    assert 'cannot create resource "inferenceservices" in API group "serving.kserve.io"' in err
    code, _, err = serve(cli, api, tmp_path, "status", token=VIEWER)
    assert code == 2 and "service 'chat' is not deployed in team-research" in err
