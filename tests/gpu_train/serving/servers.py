"""Real servers on localhost for the serving tests: an MLflow tracking server (SQLite, proxied artifacts), a
Prometheus scraping the routes every second, and tiny exported models to serve.

Usage:
    with LocalMlflow(tmp) as mlflow: register(mlflow.uri, "tiny", [dir_a, dir_b])   # versions 1 and 2
    with LocalPrometheus(tmp) as prom: prom.scrape(8000, service="chat")            # returns once it is up
    export_tiny(dir, seed=0)                                                         # a random tiny GPT, exported

Every wait is on an explicit signal (a health endpoint answering, a target reported up), with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

MLFLOW = Path(sys.executable).with_name("mlflow")
# Tiny: two layers of 32, a 64-token context: a completion of a few tokens takes milliseconds on one CPU thread.
TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "context": 64, "vocab_size": 264}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check, what: str, timeout_s: float = 90.0, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll `check` until it returns a truthy value; fail naming `what` (and the process's log) at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode})"
                                 + (f":\n{log.read_text()[-3000:]}" if log and log.exists() else ""))
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def export_tiny(out: Path, seed: int) -> Path:
    """A randomly initialised tiny GPT written by trainer.export in Hugging Face's layout (byte-level tokenizer)."""
    import torch

    from gpu_train.spec.trainer_config import ModelConfig
    from trainer.export import TokenizerSpec, write_model_dir
    from trainer.model import GPT

    torch.manual_seed(seed)
    cfg = ModelConfig(**TINY)
    model = GPT(cfg)
    with torch.no_grad():  # off the initial values, so the next token is rarely a near tie
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    assert write_model_dir(model.state_dict(), cfg, TokenizerSpec(), out, origin={"seed": seed}) == "hf-gpt2"
    return out


class Process:
    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        out = open(log, "ab")  # noqa: SIM115 - the child's log
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


class LocalMlflow:
    """`mlflow server` on 127.0.0.1: SQLite backend, artifacts proxied from a directory (as the platform's server
    proxies its bucket)."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalMlflow:
        self.process = Process([str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                                "--artifacts-destination", str(self.root / "artifacts"), "--serve-artifacts",
                                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                               self.root / "mlflow.log")
        wait_for(lambda: urllib.request.urlopen(f"{self.uri}/health", timeout=2).status == 200, "mlflow server",
                 proc=self.process.proc, log=self.process.log)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.process.stop()


def register(uri: str, name: str, exports: list[Path]) -> list[str]:
    """Each export as the `model` artifact of a run and a version of registered model `name`; the run ids.
    The runs carry the lineage tags the trainer writes (trainer/tracking.py)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.create_experiment(f"serve-{name}")
    client.create_registered_model(name)
    runs = []
    for i, export in enumerate(exports):
        run = client.create_run(experiment, tags={"dataset.uri": f"file:///data/{name}", "mlflow.source.git.commit":
                                                  f"{i:040x}"})
        client.log_param(run.info.run_id, "train.steps", str(100 * (i + 1)))
        client.log_artifacts(run.info.run_id, str(export), "model")
        client.set_terminated(run.info.run_id)
        client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
        runs.append(run.info.run_id)
    return runs


class LocalPrometheus:
    """Prometheus on 127.0.0.1 scraping file-discovered targets every second."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = root / "targets.json"

    def __enter__(self) -> LocalPrometheus:
        self.targets.write_text("[]")
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "scrape_configs": [{"job_name": "routes", "file_sd_configs": [
                      {"files": [str(self.targets)], "refresh_interval": "1s"}]}]}
        (self.root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = Process(["prometheus", f"--config.file={self.root / 'prometheus.yml'}",
                                f"--storage.tsdb.path={self.root / 'data'}",
                                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                               self.root / "prometheus.log")
        wait_for(lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200, "prometheus",
                 proc=self.process.proc, log=self.process.log)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.process.stop()

    def scrape(self, port: int, **labels: str) -> None:
        """Scrape 127.0.0.1:port (and only it) from now on; returns once Prometheus reports it up."""
        target = f"127.0.0.1:{port}"
        self.targets.write_text(json.dumps([{"targets": [target], "labels": labels}]))

        def up() -> bool:
            active = get_json(f"{self.url}/api/v1/targets?state=active")["data"]["activeTargets"]
            return any(t["labels"].get("instance") == target and t["health"] == "up" for t in active)

        wait_for(up, f"prometheus scraping {target}", log=self.process.log)
