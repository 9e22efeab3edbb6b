"""gpu-train-launch, the launcher: check the bundled trainer's inputs, wait for its dataset and the rendezvous
host, run torchrun with the job's command, and turn its end into the container's exit code.

Usage (the image's entrypoint, trainer/entrypoint.sh, runs `python -m trainer.launch "$@"`; every argument
is torchrun's, the job's command last: the bundled trainer's own arguments follow `-m trainer`):
    gpu-train-launch --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=JOB-worker-0-0.JOB:29400 \\
        --rdzv-id=JOB --max-restarts=3 --shutdown-timeout=285 -m trainer --preset gpt2-350m --run-dir DIR ...
    gpu-train-launch ... --max-restarts=3 --shutdown-timeout=285 train.py --lr 3e-4   # a team's own code

Environment:
    TRAINER_DATA_WAIT_S   seconds to wait for the dataset manifest to appear in an object store (s3://, gs://;
                          default 0: check once); a local dataset (file://, a path) is always checked once
    RDZV_DNS_TIMEOUT      seconds to wait for the rendezvous host's DNS name (default 600)

In order:
1. Preflight of the bundled trainer (trainer/preflight.py; a job of its own code checks its own inputs), before
   anything waits: the settings, the batch layout at every world
   size from MIN to MAX nodes times --nproc-per-node, the metrics ports, writable run and checkpoint
   directories, and the dataset (its manifest, the vocabulary, windows of model.context tokens). A missing
   manifest in an object store is waited for up to TRAINER_DATA_WAIT_S with one message naming the URI and how
   to upload it; a local one (file://, a path) fails at once, naming the path.
   Any failure: one line naming the setting, exit 2, torchrun never starts.
2. The rendezvous host: JobSet publishes a pod's DNS name only once the pod exists, and torchrun decides
   whether this pod hosts the c10d store by resolving the --rdzv-endpoint host and comparing it with its own
   addresses; if the name does not resolve yet, pod 0 wrongly thinks it is a client and every agent waits for
   a store nobody hosts. So wait for it (exit 1 naming the host when RDZV_DNS_TIMEOUT runs out).
3. torchrun as a child, with the rendezvous-store switch and the TORCH_NCCL_* settings that make NCCL's
   watchdog agree with the trainer's (both spelled once, in the launch builder gpu_train.jobs.launch, which the
   JobSet sets too; a value already in the environment wins for the NCCL ones), TRAINER_EXIT_FILE and TRAINER_LAUNCHER_PID
   (trainer/errors.py: how a worker's bad input stops torchrun's restarts), TRAINER_SHUTDOWN_TIMEOUT_S
   (torchrun's shutdown timeout, which the workers' final checkpoint after SIGTERM must fit in: they log how
   much of it they used), TRAINER_STOP_FILE (where the workers record how they stopped on a signal), and a
   parent-death signal so that the launcher killed takes torchrun and its workers with it. torchrun runs through
   trainer.torchrun (the torchrun on PATH, in this interpreter, without its traceback when a stop signal ends it)
   in a process group of its own, so that a terminal's Ctrl-C reaches the launcher only. SIGTERM, SIGINT and
   SIGHUP are forwarded to torchrun, once per signal received, which forwards them to the workers and kills them
   --shutdown-timeout seconds later (default 30, torch/distributed/run.py); the workers stop after a final
   checkpoint. A second SIGINT makes torchrun give up on them at once.
4. Exit: 2 if a worker recorded bad input (trainer.errors.stop_retries, which a team's code calls too; its
   message is printed again); after a forwarded signal N that ended
   torchrun unsuccessfully, one line saying which step's checkpoint the workers saved, and 128 + N (130 for
   SIGINT, 143 for SIGTERM); else torchrun's own exit code (0 when every worker completed). A Ctrl-C before
   torchrun starts: one line, 130.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from gpu_train.jobs.launch import nccl_env, run_forwarding
from gpu_train.spec import env as job_env
from trainer.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    BadInput,
    one_line,
)

PROG = "gpu-train-launch"
POLL_S = 5.0


class LaunchError(Exception):
    """Ends the launch with `code` and one line."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _seconds(name: str, default: str) -> int:
    raw = os.environ.get(name, default)
    if not raw.isdigit():
        raise LaunchError(f"{name} must be a whole number of seconds (got {raw!r})", EXIT_BAD_INPUT)
    return int(raw)


def _torchrun_args(argv: list[str]):
    """torchrun's own parse of the arguments (torch.distributed.run.get_args_parser); a bad one ends the launch
    the way torchrun would (argparse's usage line, exit 2)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG
    return parser.parse_args(argv)


def _local_world_size(nproc_per_node: str) -> int:
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(nproc_per_node)
    except ValueError as exc:
        raise LaunchError(f"--nproc-per-node {nproc_per_node}: {exc}", EXIT_BAD_INPUT) from None


def _wait_for_manifest(uri: str, endpoint: str | None, wait_s: int) -> None:
    """Poll for the dataset manifest up to wait_s seconds, saying once what is missing and how to fix it. A local
    dataset (file:// or a plain path) is checked once: nothing uploads into it while the launcher waits, so a
    missing manifest there is a mistyped path."""
    from gpu_train.storage import FileStore, open_store
    from trainer.data.errors import DataError
    from trainer.data.shards import split_manifest_uri

    root, key = split_manifest_uri(uri)
    try:
        store = open_store(root, endpoint_url=endpoint)
        if isinstance(store, FileStore):
            wait_s = 0
        deadline = time.monotonic() + wait_s
        told = False
        while not store.exists(key):
            left = deadline - time.monotonic()
            where = store.url_of(key)
            if left <= 0:
                raise LaunchError(
                    f"data.uri: dataset manifest {where} not found"
                    + (f" after waiting {wait_s}s" if wait_s else "")
                    + f"; prepare and upload the dataset first: python -m trainer.data prepare ... --out {root}",
                    EXIT_BAD_INPUT,
                )
            if not told:
                print(f"{PROG}: waiting up to {wait_s}s ({job_env.DATA_WAIT}) for dataset manifest {where}; upload it "
                      f"with: python -m trainer.data prepare ... --out {root}", file=sys.stderr, flush=True)
                told = True
            time.sleep(min(POLL_S, max(left, 0.1)))
    except DataError as exc:
        raise LaunchError(f"data.uri: {one_line(str(exc))}", EXIT_BAD_INPUT) from None


def preflight(args) -> None:
    """Check the trainer's settings and inputs for every world size this launch may run at."""
    from torch.distributed.run import parse_min_max_nnodes

    from gpu_train.spec.trainer_config import build_config
    from trainer.__main__ import parser as trainer_parser
    from trainer.preflight import check_inputs, data_endpoint

    targs = trainer_parser().parse_args(args.training_script_args)  # exits 2 itself on a bad option
    lo, hi = parse_min_max_nnodes(args.nnodes)
    local = _local_world_size(args.nproc_per_node)
    wait_s = _seconds(job_env.DATA_WAIT, "0")
    cfg = build_config(targs.preset, targs.config, targs.overrides)
    if cfg.data.uri != "synthetic":
        _wait_for_manifest(cfg.data.uri, data_endpoint(cfg), wait_s)
    ds = check_inputs(cfg, targs.run_dir, world_sizes=range(lo * local, hi * local + 1, local),
                      local_world_size=local)
    ds.close()


def wait_for_host(endpoint: str, timeout_s: int) -> None:
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
    host = host.strip("[]")
    if not host:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise LaunchError(f"rendezvous host '{host}' did not resolve within {timeout_s}s", EXIT_FAILED) from None
            time.sleep(2)


def _torchrun_child() -> None:
    """In the torchrun child: SIGKILL when the launcher dies (prctl(2), PR_SET_PDEATHSIG), and a process group of
    its own, so that a terminal's Ctrl-C (sent to the foreground process group) reaches the launcher alone, which
    forwards it once: torchrun stops its workers gracefully on the first signal and gives up on them on a second."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


def stop_line(signum: int, stop_file: Path) -> str:
    """The launcher's one line after torchrun ended on a forwarded stop signal, from what the workers recorded
    (trainer.errors.record_stop; the last record wins: a restarted group records again)."""
    name = signal.Signals(signum).name
    record = None
    with contextlib.suppress(OSError, ValueError):
        lines = stop_file.read_text().splitlines()
        record = json.loads(lines[-1]) if lines else None
    if not isinstance(record, dict):
        return f"{PROG}: stopped by {name}; the same command resumes from the newest checkpoint"
    step, saved = record.get("step"), record.get("saved")
    if saved is True:
        return f"{PROG}: stopped by {name}: the workers saved the checkpoint of step {step}; the same command resumes from it"
    if saved is False:
        return (f"{PROG}: stopped by {name}: the workers stopped at step {step} but could not save its checkpoint; "
                "the same command resumes from the newest one")
    return (f"{PROG}: stopped by {name} before the first step (at step {step}), nothing new to save; the same "
            "command resumes from the newest checkpoint")


def run_torchrun(argv: list[str], shutdown_timeout: int | None) -> int:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        raise LaunchError("torchrun is not on PATH", EXIT_FAILED)
    # What torchrun will use (torch/distributed/launcher/api.py, LaunchConfig.__post_init__), for the workers
    # to report how much of it their final checkpoint took.
    if shutdown_timeout is None:
        shutdown_timeout = _seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    with tempfile.TemporaryDirectory(prefix="gpu-train-launch-") as tmp:
        exit_file, stop_file = Path(tmp) / "bad-input", Path(tmp) / "stopped"
        # NCCL's watchdog settings (trainer/watchdog.py) unless the caller chose others; the JobSet sets the same.
        env = {**nccl_env(), **os.environ, job_env.STORE_SWITCH: "1", job_env.EXIT_FILE: str(exit_file),
               job_env.STOP_FILE: str(stop_file), job_env.LAUNCHER_PID: str(os.getpid()),
               job_env.SHUTDOWN: str(shutdown_timeout)}
        # trainer.torchrun: the torchrun on PATH, quiet when a stop signal ends it (its module docstring).
        code, stopped = run_forwarding([sys.executable, "-m", "trainer.torchrun", torchrun, *argv], env=env,
                                       preexec_fn=_torchrun_child)
        if exit_file.is_file():
            message = exit_file.read_text(errors="replace").strip()
            print(f"{PROG}: bad input, not retried: {message}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        if stopped and code != 0:
            print(stop_line(stopped[0], stop_file), file=sys.stderr, flush=True)
            return 128 + stopped[0]
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        dns_timeout = _seconds(job_env.DNS_TIMEOUT, "600")
        args = _torchrun_args(argv)
        is_trainer = args.module and args.training_script == "trainer"
        asks_help = any(a in ("-h", "--help") for a in args.training_script_args)
        if is_trainer and not asks_help:
            preflight(args)
        wait_for_host(args.rdzv_endpoint, dns_timeout)
        return run_torchrun(argv, args.shutdown_timeout)
    except LaunchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except BadInput as exc:
        print(f"{PROG}: error: {one_line(str(exc))}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C during the checks or the waits, before torchrun started
        print(f"{PROG}: interrupted (SIGINT) before torchrun started", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    from trainer.__main__ import exit_now

    exit_now(main())
