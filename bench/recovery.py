"""Recovery: seconds from a lost worker, a hung worker or a lost node to the first completed step after every
rank resumed from the newest checkpoint, on one node and on two emulated nodes.

Usage: `python -m bench --only recovery`.
- one node: two CPU workers under one torchrun (--max-restarts=1); rank 1 kills itself (SIGKILL) at step
  KILL_AT through a step callback of the fault entry bench/faults.py (TRAINER_TEST_KILL_AT_STEP),
  which runs the normal trainer; the checkpoint directory is shared.
- one node, hung worker: the same, but rank 1 goes to sleep inside step KILL_AT's all-reduce
  (TRAINER_TEST_HANG_AT_STEP), which rank 0 waits in; the watchdog (trainer/watchdog.py, floor
  HANG_FLOOR_S) ends both, torchrun restarts the group. Measured from the moment the sleep began (the fault
  writes it into its marker file) to the watchdog's first line (detection) and to the first step logged after
  the restart (detection to resume).
- two nodes, worker killed: two torchrun agents (one CPU worker each) through the launcher on one c10d
  rendezvous, node-local checkpoint directories and a local S3 server (moto) as the remote store; rank 1
  kills itself at step KILL_AT; both agents restart and the group resumes from the store.
- two nodes, node lost: the same, but node 1's launcher is SIGKILLed after step KILL_AT (its torchrun and
  worker die with it) and a replacement node with an empty directory is started at once, as the Job
  controller would recreate the pod; measured from the SIGKILL.
The worker-kill figures run from the last step logged before the restart to the first step logged after
it (so they include the lost part of the killed step); the node-loss figure from the kill itself.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Figure, free_port, local_s3, node_events, start_agent
from bench.faults import FAULTS
from bench.overhead import SMALL
from bench.runs import run_trainer, summary

KILL_AT = 12
STEPS = 20
# Two micro batches of 6 sequences per step, so one or two workers train the same numbers.
NODES = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.context=32",
         "train.global_batch_tokens=384", "train.micro_batch_size=6", f"train.steps={STEPS}",
         "checkpoint.every_steps=5", "metrics.log_every=1", "tracking.enabled=false"]


def _gap(events: list[dict]) -> float:
    """Last step logged before the second start record -> first step logged after it."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    restart = starts[1]
    before = [e for e in events[:restart] if e.get("event") == "step"][-1]
    after = next(e for e in events[restart:] if e.get("event") == "step")
    return after["time"] - before["time"]


def _single_node(overrides: list[str]) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        events = run_trainer(run_dir, "tiny", [*overrides, f"train.steps={STEPS}", "checkpoint.every_steps=5",
                                               "metrics.log_every=1"],
                             nproc=2, max_restarts=1, module=FAULTS,
                             env={"TRAINER_TEST_KILL_AT_STEP": str(KILL_AT),
                                  "TRAINER_TEST_KILL_RANK": "1"})
        assert summary(run_dir)["restarts"] == 1, "the worker was not killed and restarted"
        resumed = [e["resumed_from"] for e in events if e.get("event") == "start"][1]
        return _gap(events), Path(resumed).name


# The tiny preset's steps take well under a second here, so the watchdog's bound is its floor.
HANG_FLOOR_S = 5
HANG = ["watchdog.floor_s=5", "watchdog.startup_s=120", "eval.sample_tokens=0"]
_WATCHDOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \[rank\d+\] CRITICAL trainer\.watchdog: "
                            r".*: ([\d.]+)s, bound ([\d.]+)s")


def _hung_worker() -> tuple[float, float, float, str]:
    """(hang -> watchdog fires, hang -> first step after resume, the bound, checkpoint resumed from)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, marker, log = Path(tmp) / "run", Path(tmp) / "hang.json", Path(tmp) / "run.log"
        events = run_trainer(run_dir, "tiny", [f"train.steps={STEPS}", "checkpoint.every_steps=5",
                                               "metrics.log_every=1", *HANG],
                             nproc=2, max_restarts=1, log=log, module=FAULTS,
                             env={"TRAINER_TEST_HANG_AT_STEP": str(KILL_AT), "TRAINER_TEST_HANG_RANK": "1",
                                  "TRAINER_TEST_HANG_MARKER": str(marker), "TRAINER_TEST_HANG_S": "600"})
        assert summary(run_dir)["restarts"] == 1, "the hung worker was not ended and restarted"
        hung_at = json.loads(marker.read_text())["time"]
        fired = []
        for line in log.read_text().splitlines():
            m = _WATCHDOG_LINE.match(line)
            if m:
                stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
                fired.append((stamp, float(m.group(4))))
        if not fired:
            raise RuntimeError(f"no watchdog line in the trainer's output; see {log}")
        restart = [i for i, e in enumerate(events) if e.get("event") == "start"][1]
        first = next(e for e in events[restart:] if e.get("event") == "step")
        resumed = Path(events[restart]["resumed_from"]).name
        return min(t for t, _ in fired) - hung_at, first["time"] - hung_at, fired[0][1], resumed


def _two_nodes(endpoint: str, bucket: str, *, lose_node: bool) -> tuple[float, str]:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        port = free_port()
        overrides = [*NODES, f"checkpoint.remote_uri=s3://{bucket}/run", f"checkpoint.endpoint_url={endpoint}"]
        env = {} if lose_node else {"TRAINER_TEST_KILL_AT_STEP": str(KILL_AT), "TRAINER_TEST_KILL_RANK": "1",
                                    "TRAINER_TEST_KILL_MARKER": str(root / "killed")}
        common = {"port": port, "nnodes": "2:2", "overrides": overrides, "env": env, "max_restarts": 2,
                  "module": "trainer" if lose_node else FAULTS}
        agents = [start_agent(0, root, **common), start_agent(1, root, **common)]
        killed_at = None
        try:
            if lose_node:
                deadline = time.monotonic() + 300
                while not any(e.get("step", 0) >= KILL_AT for e in node_events(root) if e.get("event") == "step"):
                    if time.monotonic() > deadline or agents[0].poll() is not None:
                        raise RuntimeError(f"no step {KILL_AT} within 300 s; see {root}/node*.log")
                    time.sleep(0.05)
                agents[1].send_signal(signal.SIGKILL)
                killed_at = time.time()
                agents[1].wait()
                agents.append(start_agent(2, root, **common))
            codes = [a.wait(timeout=600) for a in (agents[0], agents[-1])]
            if codes != [0, 0]:
                raise RuntimeError(f"agents exited {codes}; see the logs under {root}")
            events = node_events(root)
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                    a.wait()
        resumed = [e["resumed_from"] for e in events if e.get("event") == "start"][1]
        if killed_at is None:
            return _gap(events), Path(resumed).name
        restart = [i for i, e in enumerate(events) if e.get("event") == "start"][1]
        first = next(e for e in events[restart:] if e.get("event") == "step")
        return first["time"] - killed_at, Path(resumed).name


def run(quick: bool = False) -> list[Figure]:
    repeats = 1 if quick else 3
    figures = []
    for label, overrides in (("tiny preset", []), ("small GPT (4x128, ctx 128)", SMALL)):
        seconds, resumed = [], ""
        for _ in range(repeats):
            s, resumed = _single_node(overrides)
            seconds.append(s)
        figures.append(Figure("recovery", f"one node, worker kill -9 -> first step after resume ({label})",
                              statistics.median(seconds), "s",
                              notes=f"2 CPU workers, one torchrun, killed at step {KILL_AT}, resumed from "
                                    f"{resumed}, median of {repeats}"))
    single = figures[0].value
    detect, resume, bound, resumed = [], [], 0.0, ""
    for _ in range(repeats):
        d, r, bound, resumed = _hung_worker()
        detect.append(d)
        resume.append(r)
    figures.append(Figure(
        "recovery", "one node, hang (rank 1 asleep in the step's all-reduce) -> watchdog fires (tiny)",
        statistics.median(detect), "s", bound, "the watchdog's bound", statistics.median(detect) / bound,
        notes=f"2 CPU workers, watchdog.floor_s={HANG_FLOOR_S}, hung in step {KILL_AT + 1}, median of {repeats}"))
    figures.append(Figure(
        "recovery", "one node, hang -> watchdog fires -> first step after resume (tiny)",
        statistics.median(resume), "s", single, "one node, worker kill -9",
        statistics.median(resume) / single if single else None,
        notes=f"detection to resume: the bound ({bound:g} s here) plus torchrun's restart and the resume from "
              f"{resumed}; median of {repeats}"))
    with local_s3() as endpoint:
        for lose_node, label in ((False, "worker kill -9"), (True, "node lost (launcher SIGKILLed), replaced")):
            seconds, resumed = [], ""
            for i in range(repeats):
                s, resumed = _two_nodes(endpoint, f"recovery-{int(lose_node)}-{i}", lose_node=lose_node)
                seconds.append(s)
            value = statistics.median(seconds)
            figures.append(Figure(
                "recovery", f"two nodes, {label} -> first step after resume (tiny)", value, "s", single,
                "one node, worker kill", value / single if single else None,
                notes=f"2 torchrun agents x 1 CPU worker, node-local checkpoints + local S3, killed at step "
                      f"{KILL_AT}, resumed from {resumed} (fetched from S3), median of {repeats}"))
    return figures
