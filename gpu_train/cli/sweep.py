"""`gpu-train sweep`: hyperparameter sweeps whose trials are ordinary jobs (docs/sweeps.md).

Usage:
    gpu-train sweep run --local [examples/sweep-tiny.yaml]   # trials as local torchrun jobs, controlled here
    gpu-train sweep run SPEC                                 # trials as JobSets in the team's queue, controlled here
    gpu-train sweep run SPEC --dry-run                       # the first trials' JobSets, as the cluster would get them
    gpu-train sweep submit SPEC [--dry-run]                  # the controller in the cluster, in the team's namespace
    gpu-train sweep status SPEC [--cluster]                  # the table and the plot's path
    gpu-train sweep stop SPEC [--cluster]                    # stop the controller running here [in the cluster]
    gpu-train sweep replay SPEC                              # every decision of the journal, taken again

The sweep's state (its journal, Optuna's journal, the plot, the trials' run directories) lives in
runs/<sweep name>/ (--runs); a cluster sweep's journal is also copied to the checkpoints bucket after every record,
so `sweep run SPEC` here and `sweep submit SPEC` continue each other. Running the same command again after the
controller was stopped or killed continues the same sweep. run, submit, replay and the --cluster commands need the
sweeps extra (Optuna), run --local the trainer as well; status and stop here read the journal and need only the cli
extra (status draws its plot where matplotlib is installed, and says so where it is not).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gpu_train.client.errors import ClientError
from gpu_train.spec.install import install_hint
from gpu_train.sweeps.journal import CONTROLLER_PID

DEFAULT_SOURCE = "the embedded default sweep"
# The sweep `gpu-train sweep run --local` runs without a spec: examples/sweep-tiny.yaml, which says why each value
# (a test keeps the two the same).
DEFAULT_SWEEP: dict[str, Any] = {
    "name": "sweep-tiny",
    "trialTemplate": {"name": "sweep-tiny", "team": "local", "pool": "local", "preset": "tiny", "nodes": "1:1",
                      "steps": 40, "globalBatchTokens": 4096, "checkpointEvery": 1000, "maxRestarts": 0,
                      "overrides": {"eval.batches": 4, "eval.sample_tokens": 0, "train.warmup_steps": 4}},
    "searchSpace": {"train.lr": {"distribution": "logUniform", "min": 3.0e-4, "max": 3.0e-2},
                    "model.norm": {"distribution": "choice", "values": ["layernorm", "rmsnorm"]}},
    "objectives": [{"metric": "val_loss", "direction": "minimize"}],
    "algorithm": {"name": "tpe", "seed": 7, "earlyStopping": {"name": "asha", "minTokens": 20480,
                                                               "reductionFactor": 2}},
    "trialConfig": {"numTrials": 8, "parallelTrials": 2, "maxTokensPerTrial": 163840},
}


def register(sub: Any, common: Any) -> None:
    """The `sweep` command and its subcommands, on the main parser's subparsers."""
    sw = sub.add_parser("sweep", help="hyperparameter sweeps: ASHA that pauses and promotes trials, within the "
                                      "team's quota", description="Run, watch, stop and replay a hyperparameter "
                                      "sweep (docs/sweeps.md).")
    ss = sw.add_subparsers(dest="sweep_command", required=True, metavar="SUBCOMMAND")
    r = ss.add_parser("run", help="run a sweep: its controller in this process",
                      description="Run a sweep spec: trials as JobSets in the team's queue, as local torchrun jobs "
                                  "(--local), or print the JobSets of its first trials (--dry-run). Run it again to "
                                  "continue a stopped sweep.")
    r.add_argument("spec", nargs="?", help="sweep spec file (YAML); --local: default the embedded one (ASHA over the "
                                           "tiny preset, examples/sweep-tiny.yaml)")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="trials on this machine under local torchrun")
    mode.add_argument("--dry-run", action="store_true", help="print the first trials' JobSets (the one renderer, "
                                                             "the team's queue, the sweep priority class)")
    r.add_argument("--nproc", type=int, default=1, help="--local: workers per trial (default 1)")
    r.add_argument("--data", default="", help="--local: dataset manifest URI (default: the template's file:// "
                                              "one, else synthetic)")
    r.add_argument("--runs", default="runs", help="parent of the sweep's directory (default ./runs)")
    r.add_argument("--workdir", default=None, help="--local, a template with its own command: where it runs "
                                                   "(default: the sweep spec's folder)")
    common(r, team=False)
    s = ss.add_parser("submit", help="run a sweep's controller in the cluster, in the team's namespace",
                      description="Start the sweep's controller as a Deployment in the team's namespace (its spec in its "
                                  "environment), running as the namespace's sweep-controller account; submitting again "
                                  "replaces it and continues the same sweep.")
    s.add_argument("spec", help="sweep spec file (YAML)")
    s.add_argument("--dry-run", action="store_true", help="print the Deployment instead")
    s.add_argument("--runs", default="runs", help="parent of the sweep's local directory (default ./runs)")
    common(s, team=False)
    for name, text in (("status", "the sweep's trials: parameters, rung, tokens, best loss, state; and its plot"),
                       ("stop", "stop the sweep's controller running on this machine (--local trials save a "
                                "checkpoint and stop), or in the cluster (--cluster: its trials are paused); the "
                                "same `sweep run` or `sweep submit` continues it"),
                       ("replay", "take every decision of the sweep's journal again and compare")):
        c = ss.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        c.add_argument("spec", nargs="?", help="sweep spec file (YAML; default the embedded one)")
        c.add_argument("--runs", default="runs", help="parent of the sweep's directory (default ./runs)")
        if name != "replay":
            c.add_argument("--cluster", action="store_true", help="the sweep's controller in the cluster (`sweep "
                                                                  "submit`): its journal's copy in the object store")
            common(c, team=False)


def _need_optuna(command: str) -> None:
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ClientError(f"`gpu-train sweep {command}` needs Optuna: {install_hint('cli', 'sweeps')}") from None


def load(spec: str | None):
    from gpu_train.spec.errors import SettingsError
    from gpu_train.spec.sweep import load_sweep, parse_sweep

    try:
        return load_sweep(spec) if spec else parse_sweep(DEFAULT_SWEEP, DEFAULT_SOURCE)
    except SettingsError as exc:
        raise ClientError("\n".join(exc.problems)) from None


def run(args: argparse.Namespace) -> int:
    cmd = args.sweep_command
    cluster = cmd == "submit" or getattr(args, "cluster", False) or (cmd == "run" and not args.local)
    if cmd in ("run", "submit", "replay") or cluster:
        _need_optuna(cmd)  # its decisions (run, replay) or the cluster's trials; status and stop only read
    sweep = load(args.spec)
    sweep_dir = Path(args.runs) / sweep.name
    if cmd == "replay" or (cmd in ("status", "stop") and not cluster):
        return {"status": status, "replay": replay, "stop": stop}[cmd](
            sweep, sweep_dir if cmd == "stop" else _journaled(sweep, sweep_dir))
    if cmd == "run" and args.local:
        workdir = Path(args.workdir or (Path(args.spec).resolve().parent if args.spec else Path.cwd()))
        if not sweep.template.bundled and not workdir.is_dir():
            raise ClientError(f"--workdir {workdir}: no such directory")
        return run_local(sweep, args.spec or DEFAULT_SOURCE, runs=Path(args.runs), data=args.data, nproc=args.nproc,
                         workdir=workdir)
    if not args.spec:
        raise ClientError("a sweep on the cluster needs a spec file (the embedded default is for --local)")
    from gpu_train.cli import sweep_cluster
    from gpu_train.client.cluster import connect, load_contract

    dry = getattr(args, "dry_run", False)
    offline = (dry and args.platform) or (cmd == "status" and args.platform)
    session = None if offline else connect(args.kubeconfig, args.context)
    contract = load_contract(session, sweep.template.team, args.platform)
    if cmd == "status":
        sweep_cluster.pull_state(contract, sweep, sweep_dir)
        return status(sweep, sweep_dir)
    if cmd == "stop":
        return sweep_cluster.stop(session, sweep, sweep_dir, contract)
    if cmd == "submit":
        return sweep_cluster.submit(session, contract, sweep, args.spec, dry_run_only=dry)
    if dry:
        return sweep_cluster.dry_run(contract, sweep, args.spec)
    return run_cluster(session, contract, sweep, args.spec, runs=Path(args.runs))


def run_cluster(session, contract, sweep, source: str, *, runs: Path) -> int:
    """The controller in this process, the trials as JobSets in the team's queue (gpu_train.sweeps.cluster)."""
    from gpu_train.sweeps.cluster import cluster_controller, trial_jobsets
    from gpu_train.sweeps.run import drive
    from gpu_train.sweeps.tracking import SweepTracker

    trial_jobsets(contract, sweep, source)  # every bound checked as `gpu-train submit` checks a job
    sweep_dir = runs.resolve() / sweep.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    tracker = SweepTracker.open(tracking_uri) if tracking_uri else None
    if not tracking_uri:
        print("gpu-train: no MLflow parent run for this sweep (set MLFLOW_TRACKING_URI to the server its trials "
              "log to)", file=sys.stderr)
    controller, backend = cluster_controller(session, contract, sweep, source, sweep_dir, tracking_uri=tracking_uri,
                                             tracker=tracker)
    team = contract.team(sweep.template.team)
    print(f"gpu-train: sweep {sweep.name!r}: {sweep.trial_config.num_trials} trials, "
          f"{sweep.trial_config.parallel_trials} at a time, as JobSets in {team.namespace} (queue {team.local_queue}); "
          f"journal in {sweep_dir}", file=sys.stderr)
    return drive(controller, backend.shutdown, sweep, sweep_dir,
                 stopped="its trials go on in the cluster; the same command takes them up again")


def _journaled(sweep, directory: Path) -> Path:
    if not (directory / "journal.jsonl").exists():
        raise ClientError(f"sweep {sweep.name!r} has no journal in {directory} (run it first: gpu-train sweep run ...)")
    return directory


def _check_trials(sweep, source: str, nproc: int) -> None:
    """The template and its extreme trials (each bound, each choice) through `run --local`'s own job checks."""
    from gpu_train.client.local import local_problems
    from gpu_train.spec.sweep import bound_trials, trial_job, trial_name

    for params in bound_trials(sweep):
        problems = local_problems(trial_job(sweep, trial_name(sweep, 0), params, {}), nproc, key="trialTemplate")
        if problems:
            where = ", ".join(f"{k}={v}" for k, v in params.items())
            raise ClientError("\n".join(f"{source}: {p} (trial with {where})" for p in problems))


def run_local(sweep, source: str, *, runs: Path, data: str, nproc: int, workdir: Path | None = None) -> int:
    from gpu_train.sweeps.controller import Controller
    from gpu_train.sweeps.local import LocalBackend
    from gpu_train.sweeps.run import drive
    from gpu_train.sweeps.tracking import SweepTracker, default_tracking_uri

    if nproc < 1:
        raise ClientError(f"--nproc {nproc} must be >= 1")
    if importlib.util.find_spec("torch") is None:
        raise ClientError("`gpu-train sweep run --local` runs the trainer on this machine and needs it installed: "
                          + install_hint("trainer", "cli", "sweeps"))
    _check_trials(sweep, source, nproc)
    template = sweep.template
    data_uri = data or (template.dataset_uri if template.dataset_uri.startswith("file://") else "synthetic")
    sweep_dir = runs.resolve() / sweep.name
    tracking_uri = default_tracking_uri(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    backend = LocalBackend(sweep, runs=runs, data_uri=data_uri, nproc=nproc, tracking_uri=tracking_uri,
                           workdir=workdir)
    controller = Controller(sweep, sweep_dir, backend, tracker=SweepTracker.open(tracking_uri))
    backend.parent_run_id = controller.parent_run_id
    print(f"gpu-train: sweep {sweep.name!r}: {sweep.trial_config.num_trials} trials, {sweep.trial_config.parallel_trials}"
          f" at a time, {nproc} local worker(s) each, on {data_uri}; directory {sweep_dir}", file=sys.stderr)
    return drive(controller, backend.shutdown, sweep, sweep_dir)


def status(sweep, sweep_dir: Path) -> int:
    """The table from the journal alone: no Optuna (the `cli` extra has none); the plot where matplotlib is."""
    from gpu_train.sweeps.journal import SweepState, read_journal
    from gpu_train.sweeps.report import PLOT, plot_sweep, status_table

    state = SweepState.replay(read_journal(sweep_dir / "journal.jsonl"))
    print(status_table(sweep, state))
    try:
        print(f"plot      {plot_sweep(sweep, state, sweep_dir / PLOT)}")
    except ImportError:
        print(f"plot      not drawn: it needs matplotlib ({install_hint('sweeps')})")
    parent = (state.start or {}).get("mlflow_parent_run_id")
    if parent:
        print(f"mlflow    parent run {parent}")
    return 0


def replay(sweep, sweep_dir: Path) -> int:
    from gpu_train.sweeps.journal import read_journal
    from gpu_train.sweeps.replay import replay as replay_journal

    records = read_journal(sweep_dir / "journal.jsonl")
    checked, differences = replay_journal(sweep, records)
    for line in differences:
        print(f"differs: {line}")
    print(f"replayed {len(records)} records of sweep {sweep.name!r}: {checked} decisions checked, "
          f"{len(differences)} differ")
    return 1 if differences else 0


def _controller_pid(sweep_dir: Path) -> int | None:
    """The pid of the controller running the sweep in `sweep_dir`, if one runs (its pid file names a live
    `gpu-train sweep run` process)."""
    try:
        pid = int((sweep_dir / CONTROLLER_PID).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"sweep" in cmdline and b"run" in cmdline else None


def stop(sweep, sweep_dir: Path, timeout_s: float = 360.0) -> int:
    """SIGTERM to the sweep's controller, then wait until it has exited (its trials checkpointed and stopped)."""
    pid = _controller_pid(sweep_dir)
    if pid is None:
        raise ClientError(f"no controller of sweep {sweep.name!r} runs on this machine ({sweep_dir / CONTROLLER_PID})",
                       code=1)
    os.kill(pid, signal.SIGTERM)
    print(f"gpu-train: stopping sweep {sweep.name!r} (controller pid {pid}): its trials save a checkpoint and stop",
          file=sys.stderr)
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise ClientError(f"the controller (pid {pid}) did not stop within {timeout_s:.0f} s", code=1)
        time.sleep(0.2)
    print(f"gpu-train: sweep {sweep.name!r} stopped; the same `gpu-train sweep run --local` continues it",
          file=sys.stderr)
    return 0
