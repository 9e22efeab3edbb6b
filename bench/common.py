"""Shared pieces of the benchmarks: a local S3 server, free ports, timers, several torchrun agents as nodes,
and the results table.

Usage: imported by the bench sections; `with local_s3() as endpoint: ...` starts a moto server on
localhost (the same stand-in for object storage the tests use) and stops it afterwards;
`start_agent(node, root, ...)` starts one emulated node (the launcher, python -m trainer.launch) of a
multi-node rendezvous on localhost, and `node_events(root)` reads rank 0's metrics from whichever node wrote them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

from gpu_train.jobs import launch
from gpu_train.spec.job import JobSpec
from trainer.distributed import free_port

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def local_s3(bucket: str = "bench") -> Iterator[str]:
    """A moto S3 server on localhost with one bucket; yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Figure:
    """One measured figure, its reference measured in the same run, and the ratio of the two."""

    section: str
    name: str
    value: float | None
    unit: str
    reference: float | None = None
    reference_name: str = ""
    ratio: float | None = None
    target: str = ""
    meets_target: bool | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def preset_flops_per_token(preset: str) -> float:
    """Training FLOPs per token (6N + 12·L·H·Q·T, N with the tied lm_head) of a trainer preset; the model
    is built on the meta device, so no memory is allocated."""
    import torch

    from gpu_train.spec import trainer_config as tcfg
    from trainer.flops import flops_per_token
    from trainer.model import GPT

    m = tcfg.PRESETS[preset]().model
    with torch.device("meta"):
        n = GPT(m).num_params(non_embedding=True)
    return flops_per_token(n, m.n_layer, m.n_head, m.d_model // m.n_head, m.context,
                           lm_head_params=m.vocab_size * m.d_model)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


ROOT = Path(__file__).resolve().parent.parent
# A loop run by itself in a subprocess (the bare loop): one thread, this tree's modules, nothing else inherited.
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
# Fast failure detection on localhost: a dead agent's heartbeat expires after 1 s x 3.
RDZV_CONF = ["last_call_timeout=1", "close_timeout=10", "keep_alive_interval=1", "keep_alive_max_attempt=3"]


def run_json(module: str, args: list[str], env: dict[str, str] = ONE_THREAD_ENV) -> dict:
    """`python -m <module> args...` from the repository root, by default on one thread (ONE_THREAD_ENV); the JSON
    line it prints last. CalledProcessError when it fails."""
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def launch_local(run_dir: Path, preset: str, overrides: list[str], *, port: int, nproc: int = 1,
                 nnodes: str = "1:1", max_restarts: int = 0, rdzv_conf: Sequence[str] = (),
                 module: str = "trainer", env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment for `python -m <module> --preset P --run-dir D overrides...`
    on this machine, through the one local launch (gpu_train.jobs.launch.local) as a job of its own command, so the
    arguments stay exactly these. Workers get one thread unless OMP_NUM_THREADS is set; `env` wins over all."""
    job = JobSpec(name=f"bench-{port}", team="bench", pool="local", max_restarts=max_restarts,
                  nodes=nnodes, rendezvous_timeout_minutes=2,
                  command=["python", "-m", module, "--preset", preset, "--run-dir", str(run_dir), *overrides])
    caller = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
    argv, full_env = launch.local(job, launch.Site(run_dir=str(run_dir), dataset_uri="synthetic"), nproc,
                                  environ=caller, nodes=job.nodes, rdzv_conf=rdzv_conf, port=port)
    return argv, {**full_env, **(env or {})}


def start_agent(node: int, root: Path, *, port: int, nnodes: str, overrides: list[str], env: dict[str, str],
                max_restarts: int, module: str = "trainer") -> subprocess.Popen:
    """One emulated node: the launcher and torchrun with one CPU worker, its own run (and checkpoint) directory
    root/node<N>/run; node 0 hosts the c10d rendezvous. `module` is the workers' entry (bench/faults.py)."""
    run_dir = root / f"node{node}" / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd, full_env = launch_local(run_dir, "tiny", overrides, port=port, nnodes=nnodes, max_restarts=max_restarts,
                                 rdzv_conf=[f"is_host={int(node == 0)}", *RDZV_CONF], module=module,
                                 env={"PET_MONITOR_INTERVAL": "0.2", **env})  # torchrun's --monitor-interval
    log = (root / f"node{node}.log").open("ab")
    with log:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def node_events(root: Path) -> list[dict]:
    """metrics.jsonl of every node under root, in time order (rank 0 may have moved between nodes)."""
    events = []
    for path in root.glob("node*/run/metrics.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["time"])
