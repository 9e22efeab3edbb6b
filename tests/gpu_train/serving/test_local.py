"""`gpu-train serve --local` for real: an exported model answers completions as the trainer's own sampler would,
a bounded load test reports percentiles, and a canary behind the weighted route is promoted or rolled back by the
promotion loop reading a real Prometheus, with the MLflow aliases of a real tracking server following.

Run: .venv/bin/pytest tests/gpu_train/serving/test_local.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from transformers import AutoTokenizer

from tests.gpu_train.serving.servers import (
    LocalMlflow,
    LocalPrometheus,
    Process,
    export_tiny,
    free_port,
    get_json,
    register,
    wait_for,
)
from trainer.data.tokenizer import ByteTokenizer
from trainer.export import load_model_dir
from trainer.sample import generate

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
GPU_TRAIN = Path(sys.executable).with_name("gpu-train")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("exports")
    return export_tiny(root / "a", seed=1), export_tiny(root / "b", seed=2)


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    with LocalMlflow(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    with LocalPrometheus(tmp_path_factory.mktemp("prometheus")) as server:
        yield server


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.load(resp), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def serve(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Process, str]:
    """`gpu-train serve --local ...` on a free port; returns once its route answers."""
    port = free_port()
    proc = Process([str(GPU_TRAIN), "serve", *args, "--port", str(port), "--threads", "1", "--workdir",
                    str(tmp / "work")], tmp / "serve.log", env={"PYTHONPATH": str(ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: get_json(f"{url}/health"), "the route", timeout_s=180, proc=proc.proc, log=proc.log)
    return proc, url


def test_an_exported_model_answers_as_the_trainers_sampler_and_is_load_tested(exports, tmp_path):
    proc, url = serve(tmp_path, "--local", str(exports[0]), "--name", "tiny")
    try:
        status, answer, headers = post(f"{url}/v1/completions", {"model": "tiny", "prompt": "def ", "max_tokens": 12,
                                                                 "temperature": 0})
        assert status == 200 and headers["x-gpu-train-model-version"] == "1"
        # The trainer's own greedy sampler on the same export (trainer.sample, trainer.export) gives the same tokens.
        model = load_model_dir(exports[0]).model
        ids = generate(model, ByteTokenizer().encode("def ").tolist(), max_tokens=12, temperature=0, vocab_limit=257,
                       stop_id=256)
        expected = AutoTokenizer.from_pretrained(exports[0]).decode([i for i in ids if i != 256])
        choice = answer["choices"][0]
        assert answer["object"] == "text_completion" and answer["model"] == "tiny"
        assert choice["text"] == expected
        assert choice["finish_reason"] == ("stop" if 256 in ids else "length")
        assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": len([i for i in ids if i != 256]),
                                   "total_tokens": 4 + len([i for i in ids if i != 256])}
        # KServe's path answers the same; a stop string cuts the text where it first occurs.
        assert post(f"{url}/openai/v1/completions", {"prompt": "def ", "max_tokens": 12, "temperature": 0})[1][
            "choices"][0]["text"] == expected
        stop = expected[3:5] if len(expected) >= 5 else expected[-1:]
        cut = post(f"{url}/v1/completions", {"prompt": "def ", "max_tokens": 12, "temperature": 0, "stop": stop})[1]
        assert cut["choices"][0] == {"index": 0, "text": expected[:expected.find(stop)], "finish_reason": "stop",
                                     "logprobs": None}
        assert get_json(f"{url}/v1/models")["data"][0]["id"] == "tiny"
        assert post(f"{url}/v1/completions", {"model": "other", "prompt": "x"})[0] == 404

        bench = subprocess.run([str(GPU_TRAIN), "serve", "bench", "--url", url, "--requests", "24", "--concurrency",
                                "3", "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=300,
                               env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert bench.returncode == 0, bench.stderr
        summary = json.loads(bench.stdout)
        assert summary["requests"] == summary["ok"] == 24 and summary["errors"] == {}
        assert summary["versions"] == {"1": 24}
        assert 0 < summary["p50_ms"] <= summary["p95_ms"] <= summary["p99_ms"] and summary["rps"] > 0
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        # Every completion the route answered is metered: 4 above (one refused by the model, 404) and 24 of the bench.
        assert 'gpu_train_route_requests_total{code="200",service="tiny",version="1"} 27.0' in metrics
        assert 'gpu_train_route_requests_total{code="404",service="tiny",version="1"} 1.0' in metrics
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.log.read_text()[-2000:]


class Traffic:
    """Completions sent one after another to the route until stopped; counts answers by version and status."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.seen = url, model, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            status, _, headers = post(f"{self.url}/v1/completions", {"model": self.model, "prompt": "x",
                                                                     "max_tokens": 2})
            key = (headers.get("x-gpu-train-model-version"), status)
            self.seen[key] = self.seen.get(key, 0) + 1

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def decided(workdir: Path) -> dict:
    """The promotion loop's decision, once it is in decisions.jsonl."""
    path = workdir / "decisions.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((d for d in lines if d["action"] in ("promote", "rollback")), None)


def canary_run(exports, mlflow, prometheus, tmp_path, model: str, *flags: str) -> tuple[dict, Traffic, list[str]]:
    """Register the two exports as versions 1 and 2 of `model` (champion 1), serve champion with version 2 as a
    canary under the promotion loop, send traffic until it decides; the decision, the traffic and the run ids."""
    runs = register(mlflow.uri, model, list(exports))
    client = MlflowClient(mlflow.uri)
    client.set_registered_model_alias(model, "champion", "1")
    proc, url = serve(tmp_path, "--local", f"models:/{model}@champion", "--canary", f"models:/{model}/2",
                      "--name", model, "--auto", "--prometheus", prometheus.url, "--steps", "30,60",
                      "--step-seconds", "3", "--interval-seconds", "1", "--min-requests", "3", *flags,
                      env={"MLFLOW_TRACKING_URI": mlflow.uri})
    try:
        prometheus.scrape(int(url.rsplit(":", 1)[1]))
        with Traffic(url, model) as traffic:
            decision = wait_for(lambda: decided(tmp_path / "work"), "the promotion loop's decision", timeout_s=120,
                                proc=proc.proc, log=proc.log)
            # The registry follows the decision's record: its last tag is the signal that it has.
            wait_for(lambda: "serving.decided_at" in client.get_model_version(model, "2").tags,
                     "the registry's record of the decision", timeout_s=30, proc=proc.proc, log=proc.log)
        return decision, traffic, runs
    finally:
        proc.stop()


def test_a_canary_that_holds_its_slos_is_promoted_and_champion_follows(exports, mlflow, prometheus, tmp_path):
    decision, traffic, runs = canary_run(exports, mlflow, prometheus, tmp_path, "good", "--latency-ms", "20000",
                                         "--error-rate", "0.05")
    assert decision["action"] == "promote", decision
    assert decision["metrics"]["canary"]["requests"] >= 3 and decision["metrics"]["canary"]["errors"] == 0
    # Both steps were taken in turn before the promotion (decisions.jsonl: start, advance, promote).
    actions = [json.loads(line)["action"] for line in (tmp_path / "work" / "decisions.jsonl").read_text().splitlines()]
    assert actions == ["start", "advance", "promote"]
    assert {v for v, _ in traffic.seen} == {"1", "2"} and not any(s != 200 for _, s in traffic.seen)
    client = MlflowClient(mlflow.uri)
    assert client.get_registered_model("good").aliases == {"champion": "2"}
    tags = client.get_model_version("good", "2").tags
    assert tags["serving.decision"] == "promoted" and json.loads(tags["serving.metrics"])["canary"]["errors"] == 0
    assert client.get_model_version("good", "2").run_id == runs[1]
    assert "promoted" in (tmp_path / "serve.log").read_text()


def test_a_canary_that_answers_errors_is_rolled_back(exports, mlflow, prometheus, tmp_path):
    decision, traffic, _ = canary_run(exports, mlflow, prometheus, tmp_path, "errors", "--error-rate", "0.05",
                                      "--latency-ms", "20000", "--canary-inject-errors", "0.5")
    assert decision["action"] == "rollback" and decision["reason"].startswith("error rate "), decision
    canary = decision["metrics"]["canary"]
    assert canary["errors"] > 0 and canary["errorRate"] > 0.05
    assert traffic.seen.get(("2", 500), 0) > 0 and traffic.seen.get(("1", 500), 0) == 0
    client = MlflowClient(mlflow.uri)
    assert client.get_registered_model("errors").aliases == {"champion": "1"}  # the challenger alias went
    tags = client.get_model_version("errors", "2").tags
    assert tags["serving.decision"] == "rolled_back" and tags["serving.reason"] == decision["reason"]


def test_a_slow_canary_is_rolled_back_on_latency(exports, mlflow, prometheus, tmp_path):
    decision, _, _ = canary_run(exports, mlflow, prometheus, tmp_path, "slow", "--latency-ms", "300",
                                "--latency-percentile", "90", "--canary-inject-delay-ms", "600")
    assert decision["action"] == "rollback" and decision["reason"].startswith("p90 latency "), decision
    # The canary's p90 is at least its injected delay (histogram_quantile within the 0.5-0.75 s bucket or above).
    assert decision["metrics"]["canary"]["latencyMs"] > 500
    assert MlflowClient(mlflow.uri).get_registered_model("slow").aliases == {"champion": "1"}


def test_a_model_that_is_neither_a_directory_nor_registered_is_named(tmp_path):
    proc = subprocess.run([str(GPU_TRAIN), "serve", "--local", str(tmp_path / "nowhere")], capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is neither a directory nor a registered model" in proc.stderr
