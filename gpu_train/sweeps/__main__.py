"""The in-cluster sweep controller, which `gpu-train sweep submit` starts as a Deployment in the team's namespace
(gpu_train/jobs/sweep_platform.py) from the platform's trainer image.

Usage:
    GPU_TRAIN_SWEEP_SPEC="$(cat sweep.yaml)" python -m gpu_train.sweeps --namespace team-research \
        [--state /tmp/sweeps] [--heartbeat /tmp/heartbeat] [--kubeconfig FILE] [--spec FILE]

The sweep spec is the YAML in GPU_TRAIN_SWEEP_SPEC (the Deployment's environment), or the file --spec names. It
reaches the API server with its pod's service account (`sweep-controller`; a kubeconfig instead with
--kubeconfig), reads the platform contract from the namespace's ConfigMap, takes the sweep's journal from the
object store (gpu_train.sweeps.mirror) and runs the sweep to its end exactly as `gpu-train sweep run SPEC` does on a
laptop. MLflow: MLFLOW_TRACKING_URI, else the platform's tracking endpoint. When the sweep is done the process
stays up, idle (a Deployment would restart a program that exits), until `gpu-train sweep stop SPEC --cluster`
deletes it; a restarted pod reads the journal, finds the sweep done and idles again. SIGTERM before the end stops it
with exit 130; the trials go on in the cluster and the next controller takes them up.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import yaml

from gpu_train.client.cluster import Session, connect, load_contract
from gpu_train.client.errors import ClientError
from gpu_train.jobs.sweep_platform import SPEC_ENV
from gpu_train.spec import naming, yamlfile
from gpu_train.spec.errors import SettingsError


def in_cluster_session(namespace: str) -> Session:
    from kubernetes import client, config

    config.load_incluster_config()
    api = client.ApiClient()
    return Session(kubeconfig=Path(), context="in-cluster", namespace=namespace, server=api.configuration.host,
                   api=api)


def idle(heartbeat: Path | None) -> None:
    """Until SIGTERM, the heartbeat kept fresh."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    while not done.is_set():
        if heartbeat:
            heartbeat.touch()
        done.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_train.sweeps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="", help=f"the sweep spec file (default: the YAML in ${SPEC_ENV})")
    parser.add_argument("--namespace", required=True, help="the team namespace the controller runs in")
    parser.add_argument("--state", default="/tmp/sweeps", help="working copy of the sweep's directory")
    parser.add_argument("--heartbeat", default="", help="a file touched at every pass (the liveness probe's)")
    parser.add_argument("--kubeconfig", default="", help="reach the API server with this kubeconfig, not the pod's "
                                                         "service account")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (ClientError, SettingsError) as exc:
        lines = exc.problems if isinstance(exc, SettingsError) else [str(exc)]
        for line in lines:
            print(f"gpu_train.sweeps: {line}", file=sys.stderr)
        return getattr(exc, "code", 2)


def run(args: argparse.Namespace) -> int:
    from gpu_train.spec.sweep import load_sweep, parse_sweep
    from gpu_train.sweeps.cluster import cluster_controller, trial_jobsets
    from gpu_train.sweeps.run import drive
    from gpu_train.sweeps.tracking import SweepTracker

    if args.spec:
        sweep, source = load_sweep(args.spec), args.spec
    else:
        text, source = os.environ.get(SPEC_ENV, ""), f"${SPEC_ENV}"
        if not text.strip():
            raise ClientError(f"no sweep spec: set {SPEC_ENV} to its YAML or pass --spec FILE")
        try:
            raw = yamlfile.load(text)
        except yaml.YAMLError as exc:
            raise ClientError(f"{source}: not valid YAML: {str(exc).splitlines()[0]}") from None
        sweep = parse_sweep(raw, source)
    team = sweep.template.team
    if naming.team_namespace(team) != args.namespace:
        raise ClientError(f"{source}: trialTemplate.team {team!r} runs in namespace {naming.team_namespace(team)}, "
                          f"not in {args.namespace}, where this controller runs")
    session = connect(args.kubeconfig) if args.kubeconfig else in_cluster_session(args.namespace)
    contract = load_contract(session, team)
    trial_jobsets(contract, sweep, source)  # the platform may have changed since the sweep was submitted
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip() or contract.endpoints.tracking
    tracker = SweepTracker.open(tracking_uri) if tracking_uri else None
    sweep_dir = Path(args.state) / sweep.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    heartbeat = Path(args.heartbeat) if args.heartbeat else None
    controller, backend = cluster_controller(session, contract, sweep, source, sweep_dir,
                                             tracking_uri=tracking_uri, tracker=tracker, heartbeat=heartbeat)
    print(f"gpu_train.sweeps: sweep {sweep.name!r}: {sweep.trial_config.num_trials} trials, "
          f"{sweep.trial_config.parallel_trials} at a time, in {args.namespace}", file=sys.stderr, flush=True)
    status = drive(controller, backend.shutdown, sweep, sweep_dir,
                   stopped="its trials go on in the cluster; the next controller takes them up")
    if status == 0:
        print(f"gpu_train.sweeps: sweep {sweep.name!r} is done; this controller idles until `gpu-train sweep stop "
              f"SPEC --cluster` removes it", file=sys.stderr, flush=True)
        idle(heartbeat)
    return status


if __name__ == "__main__":
    sys.exit(main())
