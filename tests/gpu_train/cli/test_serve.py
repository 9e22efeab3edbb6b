"""`gpu-train serve` without a cluster: `deploy` and `canary` print the manifests the one serving renderer makes
for the platform contract (--dry-run --platform), and every bad input is one line naming the culprit.

Run: .venv/bin/pytest tests/gpu_train/cli/test_serve.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gpu_train.spec.contract import Serving
from gpu_train.spec.serving import RUNTIME_IMAGES
from tests.gpu_train.cli.conftest import contract_doc, only_error_lines

RUN = "0123456789abcdef0123456789abcdef"
ROOT = "s3://gpu-train-aws-dev-artifacts/mlflow"


def platform(tmp_path: Path, serving: bool = True) -> Path:
    doc = contract_doc()
    if serving:
        doc["serving"] = Serving(kserve_version="v0.20.0", runtime_images=dict(RUNTIME_IMAGES), artifacts_root=ROOT,
                                 cpu_node_selector={"gpu-train.io/system": "true"}, gpu_pools=[],
                                 prometheus="http://prom:9090", scrape_interval_seconds=15).document()
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return path


def pinned(tmp_path: Path, version: int = 3, **extra) -> Path:
    """A service spec that pins its version (what `gpu-train serve deploy --dry-run` needs without MLflow)."""
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump({"source": f"mlflow-artifacts:/1/{RUN}/artifacts/model", "runId": RUN,
                                    "resources": {"cpu": "1", "memory": "4Gi"}, **extra}))
    return path


def deploy(cli, tmp_path, *extra: str, model: str = "tiny-gpt:3"):
    return cli("serve", "deploy", model, "--team", "research", "--name", "chat", "--spec", pinned(tmp_path),
               "--dry-run", "--platform", platform(tmp_path), *extra)


def test_deploy_dry_run_prints_the_inference_service_and_its_route(cli, tmp_path):
    code, out, err = deploy(cli, tmp_path)
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["InferenceService", "ConfigMap", "Deployment", "Service"]
    isvc, route, deployment, service = docs
    assert isvc["metadata"]["name"] == "chat-v3" and isvc["metadata"]["namespace"] == "team-research"
    env = {e["name"]: e["value"] for e in isvc["spec"]["predictor"]["containers"][0]["env"]}
    assert env["STORAGE_URI"] == f"{ROOT}/1/{RUN}/artifacts/model"
    assert isvc["spec"]["predictor"]["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "4Gi"}
    backends = json.loads(route["data"]["route.json"])["backends"]
    assert [(b["version"], b["weight"], b["role"]) for b in backends] == [("3", 100, "stable")]
    assert service["metadata"]["name"] == "chat" and deployment["metadata"]["name"] == "chat-route"


def test_canary_dry_run_adds_the_version_at_its_share(cli, tmp_path):
    code, out, err = cli("serve", "canary", "tiny-gpt:4", "--team", "research", "--name", "chat", "--traffic", "10",
                         "--spec", pinned(tmp_path), "--stable", "3", "--dry-run", "--platform", platform(tmp_path))
    assert code == 0, err
    isvc, route = list(yaml.safe_load_all(out))
    assert isvc["metadata"]["name"] == "chat-v4"
    backends = json.loads(route["data"]["route.json"])["backends"]
    assert [(b["version"], b["weight"], b["role"]) for b in backends] == [("3", 90, "stable"), ("4", 10, "canary")]
    canary = json.loads(route["data"]["canary.json"])
    assert canary["driver"] == "manual" and (canary["state"]["stable"], canary["state"]["canary"]) == (3, 4)


def test_auto_hands_the_schedule_from_the_first_share_on(cli, tmp_path):
    code, out, err = cli("serve", "canary", "tiny-gpt:4", "--team", "research", "--name", "chat", "--traffic", "20",
                         "--steps", "10,50,80", "--auto", "--spec", pinned(tmp_path), "--stable", "3", "--dry-run",
                         "--platform", platform(tmp_path))
    assert code == 0, err
    _, route = list(yaml.safe_load_all(out))
    canary = json.loads(route["data"]["canary.json"])
    # The loop starts the canary itself (weight 0 until then), at --traffic, then the larger steps.
    assert canary["driver"] == "cluster" and canary["state"]["policy"]["steps"] == [20, 50, 80]
    assert [b["weight"] for b in json.loads(route["data"]["route.json"])["backends"]] == [100, 0]


def test_bad_inputs_name_their_culprit(cli, tmp_path):
    cases = [
        (["--steps", "10,x"], "--steps '10,x' is not a list of percentages like 10,50"),
        (["--error-rate", "2"], "service.canary.slo.errorRate must be <= 1.0 (got 2.0)"),
        (["--step-seconds", "20", "--interval-seconds", "30"],
         "service.canary.intervalSeconds 30 must be <= stepSeconds 20"),
        (["--step-seconds", "900"], "service.canary.maxReactionSeconds 900 is below the reaction bound 945 s"),
    ]
    for extra, message in cases:
        code, _, err = cli("serve", "canary", "tiny-gpt:4", "--team", "research", "--name", "chat", "--traffic", "10",
                           "--spec", pinned(tmp_path), "--stable", "3", "--dry-run", "--platform",
                           platform(tmp_path), *extra)
        assert code == 2 and only_error_lines(err) and message in err, (extra, err)
    code, _, err = deploy(cli, tmp_path, "--pool", "h100")
    assert code == 2 and "service.pool 'h100' is not one of serving.gpuPools (none)" in err
    code, _, err = deploy(cli, tmp_path, model="tiny gpt")
    assert code == 2 and "service.model must name the model with letters" in err


def test_a_version_that_is_not_pinned_needs_mlflow(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = tmp_path / "loose.yaml"
    spec.write_text("{}")
    code, _, err = cli("serve", "deploy", "tiny-gpt@champion", "--team", "research", "--name", "chat", "--spec", spec,
                       "--dry-run", "--platform", platform(tmp_path))
    assert code == 2 and only_error_lines(err)
    assert "service.model 'tiny-gpt@champion' must be resolved in MLflow: give --tracking-uri" in err


def test_a_platform_that_does_not_serve_says_so(cli, tmp_path):
    code, _, err = cli("serve", "deploy", "tiny-gpt:3", "--team", "research", "--name", "chat", "--spec",
                       pinned(tmp_path), "--dry-run", "--platform", platform(tmp_path, serving=False))
    assert code == 2 and "does not serve models: its stack sets no serving.enabled: true" in err


def test_serve_needs_an_action_or_local(cli):
    code, _, err = cli("serve")
    assert code == 2 and only_error_lines(err) and "needs an action" in err
    code, _, err = cli("serve", "--local", "/nonexistent/export")
    assert code == 2 and "is neither a directory nor a registered model" in err
