"""Start the trainer as real processes (plain `python -m trainer`, torchrun with gloo workers, or several
torchrun agents through the launcher standing in for nodes) for tests.

Usage:
    res = run_trainer(run_dir, nproc=2, overrides=SMALL + ["train.steps=6"], max_restarts=1, env={...})
    res = run_trainer(run_dir, 2, overrides, module=FAULTS, env={"TRAINER_TEST_KILL_AT_STEP": "5"})  # a fault
    res.returncode, res.output, summary(run_dir), step_records(run_dir)

    nodes = Nodes(tmp_path, overrides=[...], nnodes="1:2", max_restarts=2, env={...})
    a, b = nodes.start(0), nodes.start(1)          # agent 0 hosts the c10d rendezvous (is_host=1)
    nodes.wait_for_step(3); b.kill(); ...; nodes.wait_all(timeout=180)
    nodes.summary(), nodes.step_records()          # rank 0's outputs, on whichever node rank 0 ran last

Every launch runs in its own session and is killed when it ends or times out. torchrun starts each worker in
a session of its own, so killing a launch's process group does not reach the workers: they die with their
torchrun agent instead (the trainer asks for SIGKILL on its parent's death, trainer.distributed.bind_to_agent),
and the launcher's torchrun dies with the launcher the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.trainer.faults import FAULTS
from trainer.distributed import free_port

__all__ = ["FAULTS", "SMALL", "Nodes", "free_port", "kill_group", "run_trainer", "start", "step_records", "summary",
           "wait_for_status"]

ROOT = Path(__file__).resolve().parents[2]

# A model and batch small enough for seconds per run on a busy 2-core machine. 12 sequences per step divide
# into micro batches of 2 for 1, 2 and 3 workers (6, 3 and 2 micro batches per worker).
SMALL = [
    "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.context=32",
    "train.global_batch_tokens=384", "train.micro_batch_size=2", "train.warmup_steps=2",
    "tracking.enabled=false", "metrics.log_every=1",
]


def wait_for_status(status: Path, state: str, proc: subprocess.Popen, timeout: float = 240) -> dict:
    """Wait for a run's own signal, its status.json (a token budget's, trainer/budget.py) in `state`; fails at once
    when the run exits first (with its output, when it was piped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            doc = json.loads(status.read_text())
        except (OSError, ValueError):
            doc = {}
        if doc.get("state") == state:
            return doc
        if proc.poll() is not None:
            out = proc.communicate()[0] if proc.stdout is not None else ""
            raise AssertionError(f"the run exited {proc.returncode} before status {state!r}: {(out or '')[-3000:]}")
        assert time.monotonic() < deadline, f"no status {state!r} in {status}: {doc}"
        time.sleep(0.1)


@dataclass
class Result:
    returncode: int
    output: str


def command(run_dir: Path, nproc: int | None, overrides: list[str], max_restarts: int = 0,
            module: str = "trainer") -> list[str]:
    """`module` is the trainer's entry: `trainer`, or FAULTS (tests/trainer/faults.py) to inject a fault."""
    trainer = ["-m", module, "--preset", "tiny", "--run-dir", str(run_dir), *overrides]
    if nproc is None:
        return [sys.executable, *trainer]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5", *trainer,
    ]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRAINER_METRICS_PORT"}
           and not k.startswith(("TORCHELASTIC_", "TRAINER_TEST_"))}
    # The switch the launcher sets for torchrun (trainer/distributed.py says why the trainer needs it).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    env.update(extra or {})
    return env


def start(run_dir: Path, nproc: int | None, overrides: list[str], *, max_restarts: int = 0,
          env: dict[str, str] | None = None, log_path: Path | None = None, module: str = "trainer") -> subprocess.Popen:
    log_path = log_path or run_dir.with_name(run_dir.name + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command(run_dir, nproc, overrides, max_restarts, module), cwd=ROOT, env=child_env(env), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_trainer(run_dir: Path, nproc: int | None, overrides: list[str], *, max_restarts: int = 0,
                env: dict[str, str] | None = None, timeout: float = 240, module: str = "trainer") -> Result:
    log_path = run_dir.with_name(run_dir.name + ".log")
    proc = start(run_dir, nproc, overrides, max_restarts=max_restarts, env=env, log_path=log_path, module=module)
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_group(proc)
    return Result(proc.returncode, log_path.read_text(errors="replace"))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def step_records(run_dir: Path) -> dict[int, dict]:
    """The last metrics.jsonl record per step (a redone step after a restart replaces the first attempt)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "step":
            out[rec["step"]] = rec
    return out


# ---------------------------------------------------------------------------------------------- nodes
# Fast failure detection for tests: a dead agent's heartbeat expires after 1 s x 3, and a round closes 1 s after
# the minimum number of nodes joined (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, create_handler).
RDZV_CONF = "join_timeout=120,last_call_timeout=1,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class Agent:
    """One emulated node: the launcher (python -m trainer.launch), its torchrun and their workers."""

    node: int
    proc: subprocess.Popen
    log_path: Path
    run_dir: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """The node is lost: SIGKILL the launcher; torchrun and the workers die with it."""
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


class Nodes:
    """Several torchrun agents on localhost, one per emulated node, sharing one c10d rendezvous; each has its
    own run directory (and so its own node-local checkpoint directory)."""

    def __init__(self, root: Path, *, overrides: list[str], nnodes: str = "2", max_restarts: int = 0,
                 env: dict[str, str] | None = None, nproc: int = 1, name: str = "launch",
                 module: str = "trainer") -> None:
        self.root = root
        self.module = module  # the workers' entry: `trainer`, or FAULTS to inject a fault (the launcher then
        # skips its own preflight, which it runs for `-m trainer` only; every worker still checks its inputs)
        self.name = name  # logs are ROOT/<name>-node<N>.log, so several launches over the same nodes stay apart
        self.overrides = overrides
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.env = env or {}
        self.nproc = nproc
        self.port = free_port()
        self.rdzv_id = f"test-{self.port}"
        self.agents: list[Agent] = []

    def run_dir(self, node: int) -> Path:
        return self.root / f"node{node}" / "run"

    def start(self, node: int, *, env: dict[str, str] | None = None, overrides: list[str] | None = None,
              nnodes: str | None = None, max_restarts: int | None = None) -> Agent:
        run_dir = self.run_dir(node)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"{self.name}-node{node}.log"
        cmd = [
            sys.executable, "-m", "trainer.launch", f"--nnodes={nnodes or self.nnodes}",
            f"--nproc-per-node={self.nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.rdzv_id}", f"--rdzv-conf=is_host={int(node == 0)},{RDZV_CONF}",
            f"--max-restarts={self.max_restarts if max_restarts is None else max_restarts}",
            "--monitor-interval=0.2", "--shutdown-timeout=60",
            "-m", self.module, "--preset", "tiny", "--run-dir", str(run_dir), *self.overrides, *(overrides or []),
        ]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env({**self.env, **(env or {})}), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        agent = Agent(node, proc, log_path, run_dir)
        self.agents.append(agent)
        return agent

    def _rank0_file(self, name: str) -> Path:
        found = [p for p in (self.root.glob(f"node*/run/{name}")) if p.is_file()]
        assert found, f"no node wrote {name}"
        return max(found, key=lambda p: p.stat().st_mtime)

    def summary(self) -> dict:
        return json.loads(self._rank0_file("summary.json").read_text())

    def events(self) -> list[dict]:
        """metrics.jsonl of every node, in time order (rank 0 may have run on either node)."""
        out = []
        for path in self.root.glob("node*/run/metrics.jsonl"):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return sorted(out, key=lambda e: e["time"])

    def step_records(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for rec in self.events():
            if rec.get("event") == "step":
                out[rec["step"]] = rec
        return out

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}\n" + self.logs())
            time.sleep(0.1)

    def last_step(self) -> int:
        steps = [e["step"] for e in self.events() if e.get("event") == "step"]
        return max(steps, default=0)

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agents still running after {timeout}s\n" + self.logs()) from None
        return codes

    def logs(self) -> str:
        return "\n".join(f"===== node{a.node} (pid {a.proc.pid})\n{a.output()[-6000:]}" for a in self.agents)

    def close(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.kill()
