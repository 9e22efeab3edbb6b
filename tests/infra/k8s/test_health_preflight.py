"""The GPU pre-flight check for real: infra/k8s/gpu-preflight.sh run by dash (the DCGM image's /bin/sh) against
stand-ins for nvidia-smi, dcgmi and nv-hostengine and a fake sysfs tree, and the expectations
infra/k8s/preflight_server.py derives for a node. The server as a process, reading its node from a real API server
and answering the way the node readiness reporter reads it, is tests/cluster/test_health_preflight.py (which uses
this module's stand-ins).

Usage: .venv/bin/pytest tests/infra/k8s/test_health_preflight.py -q   (needs dash: /usr/bin/dash)

The stand-ins print what the real tools print for the queries the script makes (nvidia-smi's CSV query output:
`nvidia-smi --help-query-gpu`; "[N/A]" where a GPU has no such counter) and exit with their status codes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_train.spec import naming
from infra.k8s import health, preflight_server
from tests.infra.k8s.test_health import _pool

DASH = shutil.which("dash") or "/usr/bin/dash"

FAKE_NVIDIA_SMI = """#!/bin/sh
# Stand-in for nvidia-smi: FAKE_GPUS GPUs; FAKE_ECC holds the ECC query's rows (one per line) when set.
case "$*" in
  *"--query-gpu=index "*|*"--query-gpu=index --format"*)
    [ -n "${FAKE_SMI_FAIL:-}" ] && { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." ; exit 9; }
    i=0; while [ "$i" -lt "${FAKE_GPUS:-8}" ]; do echo "$i"; i=$((i + 1)); done ;;
  *"--query-gpu=index,ecc"*)
    if [ -n "${FAKE_ECC:-}" ]; then printf '%s\\n' "$FAKE_ECC"
    else i=0; while [ "$i" -lt "${FAKE_GPUS:-8}" ]; do echo "$i, 0, No, No"; i=$((i + 1)); done; fi ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
"""
FAKE_DCGMI = """#!/bin/sh
case "$1" in
  # As the real one: discovery answers once the host engine is up (here: once it has recorded its arguments).
  discovery) [ -f "$FAKE_LOG_DIR/hostengine-args" ] || exit 1; exit 0 ;;
  diag)
    echo "+---------------------------+------------------------------------------------+"
    echo "| Diagnostic                | Result                                         |"
    if [ "${FAKE_DIAG_RC:-0}" -eq 0 ]; then echo "| Deployment                | Pass                                           |"
    else echo "| Persistence Mode          | Fail - GPU 3 persistence mode is off           |"; fi
    echo "+---------------------------+------------------------------------------------+"
    echo "$*" > "$FAKE_LOG_DIR/dcgmi-args"
    exit "${FAKE_DIAG_RC:-0}" ;;
esac
exit 2
"""
FAKE_HOSTENGINE = """#!/bin/sh
echo "$*" > "$FAKE_LOG_DIR/hostengine-args"
exec sleep 60
"""


def _sysfs(root: Path, efa: int = 0, mlx: int = 0, gvnic: int = 0, other_nics: int = 2) -> None:
    """A sysfs tree with the devices the fabric probes count, plus unrelated devices that must not count."""
    def rdma(name: str, vendor: str) -> None:
        d = root / "class" / "infiniband" / name / "device"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
    for i in range(efa):
        rdma(f"rdmap{i}s0", "0x1d0f")
    for i in range(mlx):
        rdma(f"mlx5_{i}", "0x15b3")
    def pci(addr: str, vendor: str, device: str) -> None:
        d = root / "bus" / "pci" / "devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    for i in range(gvnic):
        pci(f"0000:00:{i + 4:02x}.0", "0x1ae0", "0x0042")
    for i in range(other_nics):
        pci(f"0000:01:{i:02x}.0", "0x8086", "0x1572")  # an Intel NIC
    pci("0000:00:03.0", "0x1ae0", "0x0058")  # a Google device that is not a gVNIC


@pytest.fixture()
def node(tmp_path):
    bin_dir, results, sysfs, logs = (tmp_path / d for d in ("bin", "results", "sys", "logs"))
    for d in (bin_dir, results, sysfs, logs):
        d.mkdir()
    for name, text in (("nvidia-smi", FAKE_NVIDIA_SMI), ("dcgmi", FAKE_DCGMI), ("nv-hostengine", FAKE_HOSTENGINE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"bin": bin_dir, "results": results, "sys": sysfs, "logs": logs}


def run_check(node, expected: str, **env) -> subprocess.CompletedProcess:
    (node["results"] / "expected.env").write_text(expected)
    full = {"PATH": f"{node['bin']}:/usr/bin:/bin", "RESULTS_DIR": str(node["results"]), "SYSFS": str(node["sys"]),
            "STAY": "0", "FAKE_LOG_DIR": str(node["logs"]), "DCGM_DIAG_LEVEL": "1", **env}
    return subprocess.run([DASH, str(health.PREFLIGHT_SCRIPT)], env=full, capture_output=True, text=True, timeout=60)


def results(node) -> dict[str, tuple[str, str]]:
    out = {}
    for f in node["results"].iterdir():
        if f.suffix in (".ok", ".fail"):
            out[f.stem] = (f.suffix[1:], f.read_text().strip())
    return out


def test_a_healthy_efa_node_passes_every_check(node):
    _sysfs(node["sys"], efa=32)
    proc = run_check(node, "EXPECTED_GPUS=8\nFABRIC_PROBE=efa\nEXPECTED_FABRIC=32\n")
    assert proc.returncode == 0, proc.stderr
    assert results(node) == {"gpus": ("ok", "8 of 8 GPUs"),
                             "ecc": ("ok", "no uncorrectable ECC errors or row-remap faults on 8 GPUs"),
                             "dcgm": ("ok", "dcgmi diag -r 1 passed"), "fabric": ("ok", "32 of 32 EFA devices")}
    # The diagnostics ran against the host engine the script started, on its own port.
    assert (node["logs"] / "hostengine-args").read_text().split() == ["-n", "-p", "5557", "-b", "127.0.0.1"]
    assert (node["logs"] / "dcgmi-args").read_text().split() == ["diag", "--host", "127.0.0.1:5557", "-r", "1"]


def test_a_missing_gpu_fails_the_gpu_check_naming_both_counts(node):
    _sysfs(node["sys"])
    run_check(node, "EXPECTED_GPUS=8\nFABRIC_PROBE=none\nEXPECTED_FABRIC=0\n", FAKE_GPUS="7")
    r = results(node)
    assert r["gpus"] == ("fail", "nvidia-smi sees 7 GPUs, the node's pool has 8")
    assert r["fabric"] == ("ok", "this pool has no GPU fabric")


def test_a_broken_driver_fails_the_gpu_check_with_nvidia_smis_words(node):
    _sysfs(node["sys"])
    run_check(node, "EXPECTED_GPUS=1\nFABRIC_PROBE=none\nEXPECTED_FABRIC=0\n", FAKE_SMI_FAIL="1")
    status, detail = results(node)["gpus"]
    assert status == "fail" and "couldn't communicate with the NVIDIA driver" in detail


@pytest.mark.parametrize(("rows", "expected"), [
    ("0, 0, No, No\n1, 2, No, No", "GPU 1: 2 uncorrectable ECC errors"),
    ("0, 0, Yes, No\n1, 0, No, No", "GPU 0: row remap pending (reset needed)"),
    ("0, 0, No, No\n1, 0, No, Yes", "GPU 1: row remapping failed"),
])
def test_ecc_faults_fail_the_ecc_check_naming_the_gpu(node, rows, expected):
    _sysfs(node["sys"])
    run_check(node, "EXPECTED_GPUS=2\nFABRIC_PROBE=none\nEXPECTED_FABRIC=0\n", FAKE_GPUS="2", FAKE_ECC=rows)
    assert results(node)["ecc"] == ("fail", expected)


def test_gpus_without_ecc_counters_pass(node):
    """'[N/A]' (a GPU without row remapping or ECC counters) is not a fault."""
    _sysfs(node["sys"])
    run_check(node, "EXPECTED_GPUS=1\nFABRIC_PROBE=none\nEXPECTED_FABRIC=0\n", FAKE_GPUS="1",
              FAKE_ECC="0, [N/A], [N/A], [N/A]")
    assert results(node)["ecc"][0] == "ok"


def test_a_failed_diagnostic_fails_the_dcgm_check_with_the_failing_test(node):
    _sysfs(node["sys"])
    run_check(node, "EXPECTED_GPUS=8\nFABRIC_PROBE=none\nEXPECTED_FABRIC=0\n", FAKE_DIAG_RC="226")
    status, detail = results(node)["dcgm"]
    assert status == "fail"
    assert detail.startswith("dcgmi diag -r 1 exited 226:") and "persistence mode is off" in detail


@pytest.mark.parametrize(("probe", "devices", "expected", "detail"), [
    ("efa", {"efa": 31}, 32, "found 31 EFA devices, the node's pool has 32"),
    ("mlx", {"mlx": 7, "efa": 1}, 8, "found 7 RDMA NICs (ConnectX), the node's pool has 8"),
    ("gvnic", {"gvnic": 8}, 9, "found 8 gVNIC NICs, the node's pool has 9"),
])
def test_a_missing_fabric_device_fails_the_fabric_check(node, probe, devices, expected, detail):
    _sysfs(node["sys"], **devices)
    run_check(node, f"EXPECTED_GPUS=8\nFABRIC_PROBE={probe}\nEXPECTED_FABRIC={expected}\n")
    assert results(node)["fabric"] == ("fail", detail)


def test_gvnic_and_mlx_counts_pass_when_complete(node):
    _sysfs(node["sys"], mlx=8, gvnic=9)
    run_check(node, "EXPECTED_GPUS=8\nFABRIC_PROBE=gvnic\nEXPECTED_FABRIC=9\n")
    assert results(node)["fabric"] == ("ok", "9 of 9 gVNIC NICs")
    run_check(node, "EXPECTED_GPUS=8\nFABRIC_PROBE=mlx\nEXPECTED_FABRIC=8\n")
    assert results(node)["fabric"] == ("ok", "8 of 8 RDMA NICs (ConnectX)")


def test_no_expectations_fails_every_check_with_the_reason(node):
    proc = run_check(node, "EXPECTATION_ERROR='pool x of node n is not in the pre-flight table'\n")
    assert proc.returncode == 1
    assert results(node) == {c: ("fail", "pool x of node n is not in the pre-flight table")
                             for c in ("gpus", "ecc", "dcgm", "fabric")}


# ------------------------------------------------------------------------------------------- the server


def test_expectations_name_the_problem_when_the_node_cannot_be_matched():
    pools = health.pool_expectations([_pool("p")], {})
    assert preflight_server.expectations_env(pools, "p", "n1") == (
        "EXPECTED_GPUS=8\nFABRIC_PROBE=none\nEXPECTED_FABRIC=0\n")
    assert "has no gpu-train.io/pool label" in preflight_server.expectations_env(pools, None, "n1")
    assert "pool q of node n1 is not in the pre-flight table" in preflight_server.expectations_env(pools, "q", "n1")
    assert "malformed" in preflight_server.expectations_env({"p": {"gpus": 0}}, "p", "n1")
    assert preflight_server.POOL_LABEL == naming.POOL_LABEL
