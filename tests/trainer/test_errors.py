"""How a worker's bad input stops torchrun's restarts: the exit file and the agent killed, only under the
launcher that asked for it.

Run: .venv/bin/pytest tests/trainer/test_errors.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

from gpu_train.spec import env as job_env
from tests.trainer.launch import ROOT, child_env
from trainer.errors import one_line

# Stands in for torchrun: starts one "worker" and waits for it; exits 0 if it is not killed first.
AGENT = """
import subprocess, sys
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1]]).returncode and 0)
"""
WORKER = """
import sys
from trainer.errors import stop_retries
print(stop_retries("data.uri: dataset\\nmanifest missing"), flush=True)
"""


def _agent(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AGENT, WORKER], cwd=ROOT, env=child_env(env), capture_output=True,
                          text=True, timeout=60)


def test_bad_input_kills_the_agent_and_leaves_the_message_for_the_launcher(tmp_path):
    exit_file = tmp_path / "bad-input"
    proc = _agent({job_env.EXIT_FILE: str(exit_file), job_env.LAUNCHER_PID: str(os.getpid())})  # we are the launcher
    assert proc.returncode == -9  # the agent was SIGKILLed before it could see its worker fail
    assert exit_file.read_text() == "data.uri: dataset manifest missing\n"


def test_a_second_worker_leaves_the_message_to_the_launcher_and_prints_nothing(tmp_path):
    """Another worker of the node recorded its message first: this one kills nothing and is told (True) that the
    launcher prints it, so the message stays one line."""
    exit_file = tmp_path / "bad-input"
    exit_file.write_text("data.uri: the first worker's message\n")
    proc = _agent({job_env.EXIT_FILE: str(exit_file), job_env.LAUNCHER_PID: str(os.getpid())})
    assert proc.returncode == 0 and proc.stdout.strip() == "True"
    assert exit_file.read_text() == "data.uri: the first worker's message\n"


def test_without_the_launcher_nothing_is_killed(tmp_path):
    exit_file = tmp_path / "bad-input"
    not_ours = _agent({job_env.EXIT_FILE: str(exit_file), job_env.LAUNCHER_PID: "1"})  # the agent's parent is not pid 1
    assert not_ours.returncode == 0 and not_ours.stdout.strip() == "False"
    plain = _agent({})
    assert plain.returncode == 0 and plain.stdout.strip() == "False"
    assert not exit_file.exists()


def test_messages_are_one_line():
    assert one_line("a\n  b\tc\r\n") == "a b c"
