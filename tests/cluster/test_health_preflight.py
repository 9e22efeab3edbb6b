"""The GPU pre-flight results server on the real control plane: the server and the pools table exactly as the stack
stores them (its `gpu-preflight` ConfigMap), run as a process with a token the API server issues to the stack's
`gpu-preflight` service account (TokenRequest), read the node it runs on (a kwok node of a pool, labelled as the
contract says) with only that account's ClusterRole, write the node's expectations, and answer per check the way
the node readiness reporter reads it; with the check script (infra/k8s/gpu-preflight.sh, under dash, against the
stand-in tools of tests/infra/k8s/test_health_preflight.py) a missing GPU becomes a failing endpoint.

The pod's service-account directory (/var/run/secrets/kubernetes.io/serviceaccount) is the one thing moved: the
test loads the stored server as a module and points its SA_DIR at a folder holding the issued token and the
plane's CA.

Run: .venv/bin/pytest tests/cluster/test_health_preflight.py -q   (needs dash: /usr/bin/dash)
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infra.k8s import health
from tests.cluster.conftest import wait_for
from tests.infra.k8s.test_health_preflight import DASH, _sysfs, node  # noqa: F401 - `node` is a fixture
from tools.cluster.plane import free_port

POOL = "l4-spot"
RUN_SERVER = ("import importlib.util, pathlib, sys\n"
              "spec = importlib.util.spec_from_file_location('preflight_server', sys.argv[1])\n"
              "server = importlib.util.module_from_spec(spec); spec.loader.exec_module(server)\n"
              "server.SA_DIR = pathlib.Path(sys.argv[2])\n"
              "sys.exit(server.main())\n")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture()
def server(platform, tmp_path):
    """The stack's stored results server as a process on a node of POOL; yields (port, results dir, that pool's
    GPUs per node as the contract has them)."""
    stored = next(o for o in platform.stored if o["kind"] == "ConfigMap"
                  and o["metadata"]["name"] == health.PREFLIGHT_NAME)
    ns = stored["metadata"]["namespace"]
    files = tmp_path / "configmap"
    files.mkdir()
    for key, text in stored["data"].items():
        (files / key).write_text(text)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    token = platform.core().create_namespaced_service_account_token(
        health.PREFLIGHT_NAME, ns, {"spec": {"expirationSeconds": 3600}}).status.token
    (account / "token").write_text(token)
    (account / "ca.crt").write_bytes(platform.plane.ca.cert.read_bytes())
    node_name = next(n["metadata"]["name"] for n in platform.nodes
                     if n["metadata"]["labels"].get("gpu-train.io/pool") == POOL)
    results_dir = tmp_path / "served"
    results_dir.mkdir()
    port = free_port()
    env = {**os.environ, "NODE_NAME": node_name, "RESULTS_DIR": str(results_dir),
           "POOLS_FILE": str(files / "pools.json"), "KUBERNETES_API": platform.plane.server, "PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-c", RUN_SERVER, str(files / "preflight_server.py"), str(account)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the server's expectations", lambda: proc.poll() is not None or (results_dir / "expected.env").exists(),
                 timeout=30, every=0.05)
        assert proc.poll() is None, proc.stderr.read()
        gpus = next(p["gpusPerNode"] for p in platform.contract["pools"] if p["name"] == POOL)
        yield port, results_dir, gpus
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_server_reads_its_node_with_its_own_account_and_answers_per_check(server):
    port, results_dir, gpus = server
    expected = (results_dir / "expected.env").read_text()
    assert expected.startswith(f"EXPECTED_GPUS={gpus}\n"), expected
    assert "EXPECTATION_ERROR" not in expected
    base = f"http://127.0.0.1:{port}"
    assert _get(f"{base}/healthz") == (200, "ok\n")
    assert _get(f"{base}/gpus") == (503, "gpus: pending (the check has not finished)\n")
    (results_dir / "gpus.ok").write_text(f"{gpus} of {gpus} GPUs\n")
    (results_dir / "ecc.fail").write_text("GPU 0: row remapping failed\n")
    assert _get(f"{base}/gpus") == (200, f"{gpus} of {gpus} GPUs\n")
    assert _get(f"{base}/ecc") == (503, "GPU 0: row remapping failed\n")
    assert _get(f"{base}/nope")[0] == 404


def _check(stand_ins: dict[str, Path], results_dir: Path, gpus_seen: int) -> None:
    """The check script once, on the stand-ins' node with `gpus_seen` GPUs."""
    _sysfs(stand_ins["sys"])
    env = {"PATH": f"{stand_ins['bin']}:/usr/bin:/bin", "RESULTS_DIR": str(results_dir),
           "SYSFS": str(stand_ins["sys"]), "STAY": "0", "FAKE_LOG_DIR": str(stand_ins["logs"]),
           "FAKE_GPUS": str(gpus_seen)}
    subprocess.run([DASH, str(health.PREFLIGHT_SCRIPT)], env=env, check=True, capture_output=True, timeout=60)


def test_script_and_server_together_pass_a_healthy_node(server, node):  # noqa: F811
    """The whole pod minus the reporters: the server writes the node's expectations, the check script reads them and
    writes its results, and every endpoint answers 200."""
    port, results_dir, gpus = server
    _check(node, results_dir, gpus)
    for check in ("gpus", "ecc", "dcgm", "fabric"):
        assert _get(f"http://127.0.0.1:{port}/{check}")[0] == 200, check


def test_script_and_server_together_turn_a_missing_gpu_into_a_failing_endpoint(server, node):  # noqa: F811
    port, results_dir, gpus = server
    _check(node, results_dir, gpus - 1)
    base = f"http://127.0.0.1:{port}"
    assert _get(f"{base}/gpus") == (503, f"nvidia-smi sees {gpus - 1} GPUs, the node's pool has {gpus}\n")
    assert _get(f"{base}/fabric")[0] == 200  # the pool's fabric does not depend on the GPUs
