"""The worker's process-level guards: the shared-store refusal and dying with its torchrun agent, also when the
agent died before the worker asked to.

Run: .venv/bin/pytest tests/trainer/test_distributed.py -q
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_train.spec.env import STORE_SWITCH
from tests.trainer.launch import ROOT, child_env
from trainer.distributed import check_store_mode
from trainer.errors import BadInput


def test_the_agents_shared_store_is_refused_when_the_group_may_restart(monkeypatch, caplog):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(BadInput) as err:
        check_store_mode()
    assert STORE_SWITCH in str(err.value) and "--max-restarts=3" in str(err.value)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    with caplog.at_level(logging.WARNING, logger="trainer.distributed"):
        check_store_mode()  # no restarts: allowed, with a warning
    assert STORE_SWITCH in caplog.text
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what the switch makes torchrun set
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    check_store_mode()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


AGENT = """
import os, subprocess, sys
if sys.argv[2] == "agent-pid":  # what trainer.torchrun hands down under the launcher
    os.environ["TRAINER_AGENT_PID"] = str(os.getpid())
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[3:]], start_new_session=True)
print("worker", worker.pid, flush=True)
if sys.argv[2] != "exit":
    sys.stdin.read()  # until the test closes it, or kills this agent
"""
# A worker: optionally waits for a file to appear (the test's go-ahead), binds to its agent, says so, and waits.
WORKER = """
import os, sys, time
if len(sys.argv) > 1:
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
from trainer.distributed import bind_to_agent
bind_to_agent()
print("bound", flush=True)
time.sleep(120)
"""


def _agent(mode: str, *worker_args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", AGENT, WORKER, mode, *worker_args], cwd=ROOT,
                            env=child_env({"TORCHELASTIC_RUN_ID": "test"}), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["agent-pid", "plain"])
def test_a_worker_dies_with_its_agent(mode):
    """torchrun starts workers in sessions of their own; killing the agent must still take them down. The worker
    says when it has asked for the signal: no sleep stands in for that."""
    agent = _agent(mode)
    worker = None
    try:
        worker = int(agent.stdout.readline().split()[1])
        assert agent.stdout.readline().strip() == "bound"
        assert _alive(worker)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        assert _gone_within(worker, 10)
    finally:
        agent.kill()
        agent.wait()
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["agent-pid", "plain"])
def test_a_worker_whose_agent_died_while_it_started_dies_too(tmp_path, mode):
    """The agent is gone before the worker asks for the parent-death signal (it was still importing torch): the
    worker must notice, since Linux will never send the signal now. Under the launcher the worker knows its
    agent's pid; without it, an orphan adopted by pid 1 knows too (skipped where a subreaper adopts orphans)."""
    go = tmp_path / "go"
    agent = _agent("exit" if mode == "plain" else "agent-pid", str(go))
    worker = int(agent.stdout.readline().split()[1])
    try:
        if mode == "agent-pid":
            agent.stdin.close()  # the agent exits
        assert agent.wait(timeout=30) == 0
        assert not _alive(agent.pid)
        if mode == "plain" and _parent_of(worker) != 1:
            pytest.skip(f"orphans are adopted by a subreaper here (pid {_parent_of(worker)}), not by pid 1")
        go.touch()  # only now does the worker bind to its (dead) agent
        assert _gone_within(worker, 60), "the worker outlived its agent"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_shutdown_leaves_the_groups_but_frees_none_of_them_before_the_process_ends(tmp_path):
    """shutdown() leaves torch.distributed, and no group's destructor runs afterwards when the last object that held
    the group (here DDP's reducer) goes: a gloo group freed right after a collective can deadlock (its worker thread
    needs the GIL to free the collective's tensors while it holds the lock the destructor waits for)."""
    code = """
import gc, json, os, weakref
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from trainer.distributed import shutdown
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
sub = dist.new_group(backend="gloo")
model = DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
t = torch.ones(3); dist.all_reduce(t); dist.all_reduce(t, group=sub)
groups = [weakref.ref(dist.group.WORLD), weakref.ref(sub)]
shutdown()
del model, sub
gc.collect()
runloops = sum(open(f"/proc/self/task/{x}/comm").read().strip() == "pt_gloo_runloop" for x in os.listdir("/proc/self/task"))
print(json.dumps({"initialized": dist.is_initialized(), "alive": [g() is not None for g in groups],
                  "runloops": runloops}))
"""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env({"PORT": str(port)}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Two gloo groups with their worker threads (two each), alive and idle until the process ends.
    assert got == {"initialized": False, "alive": [True, True], "runloops": 4}
