"""The worker's process-level guards: the shared-store refusal and dying with its torchrun agent.

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

from tests.trainer.launch import ROOT, child_env
from trainer.distributed import STORE_SWITCH, check_store_mode
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
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(worker.pid, flush=True)
time.sleep(120)
"""
WORKER = """
import time
from trainer.distributed import bind_to_agent
bind_to_agent()
time.sleep(120)
"""


def test_a_worker_dies_with_its_agent():
    """torchrun starts workers in sessions of their own; killing the agent must still take them down."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER], cwd=ROOT,
                             env=child_env({"TORCHELASTIC_RUN_ID": "test"}), stdout=subprocess.PIPE, text=True)
    try:
        worker = int(agent.stdout.readline())
        time.sleep(1.5)  # the worker has imported the trainer and asked for the signal
        assert _alive(worker)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        agent.kill()
        agent.wait()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
