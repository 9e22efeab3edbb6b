"""`gpu-train` job commands without a cluster: an API server that cannot be reached, and the progress line from
the trainer's metrics text. Everything they read from a cluster (Kueue's Workload, its visibility API, pods, the
pod proxy) and `list`, `pause`, `resume`, `cancel` are tested against the real control plane:
tests/cluster/test_cli_jobs.py and tests/cluster/test_status_logs.py.

Run: .venv/bin/pytest tests/gpu_train/cli/test_jobs.py -q
"""

from __future__ import annotations

import socket

import yaml

from gpu_train.client import status as jobs
from tests.gpu_train.cli.conftest import only_error_lines

METRICS = """# HELP trainer_step Last completed optimizer step
# TYPE trainer_step gauge
trainer_step 120.0
# HELP trainer_loss Training loss of the last step (mean over the global batch)
# TYPE trainer_loss gauge
trainer_loss 3.41234
# HELP trainer_tokens_per_second Global training throughput in tokens per second
# TYPE trainer_tokens_per_second gauge
trainer_tokens_per_second 16384.0
# HELP trainer_tokens_total Tokens trained on since this process started (global)
# TYPE trainer_tokens_total counter
trainer_tokens_total 7.86432e+06
"""


def test_an_unreachable_api_server(tmp_path, cli):
    """A kubeconfig whose server is a loopback port nothing listens on: the connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"https://127.0.0.1:{port}"
    kubeconfig = tmp_path / "gone.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "gone", "namespace": "team-research"}}],
        "users": [{"name": "gone", "user": {"token": "unused"}}]}))
    code, _, err = cli("list", "--kubeconfig", kubeconfig)
    assert code == 1 and only_error_lines(err)
    assert f"cannot reach the Kubernetes API server at {server} to list jobsets: [Errno " in err
    assert "Connection refused" in err


def test_progress_and_metrics_parsing():
    metrics = jobs.read_metrics(METRICS)
    assert metrics == {"trainer_step": 120.0, "trainer_loss": 3.41234, "trainer_tokens_per_second": 16384.0}
    assert jobs.progress(metrics, 200, 65536) == "step 120/200  loss 3.4123  tokens/s 16,384  ETA 0:05:20"
    assert jobs.progress({}, 200, 65536) == "no step yet"
    assert jobs.progress({"trainer_step": 5.0, "trainer_loss": float("nan")}, None, None) == "step 5"
