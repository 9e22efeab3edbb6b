"""`gpu-train serve deploy | canary | promote | rollback | status`: the cluster side of `gpu-train serve`.

Usage: gpu_train/cli/serve.py hands these actions here with the parsed arguments; the operations are
gpu_train.serving.client's, run with the user's kubeconfig (gpu_train.client.cluster) and, for the registry, MLflow
at --tracking-uri (or MLFLOW_TRACKING_URI). Manifests print as YAML documents with --dry-run; with --dry-run and
--platform FILE nothing is read from the cluster, and a spec that pins its version (NAME:VERSION with `source`
and `runId`) needs no MLflow either.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from gpu_train.cli.service_spec import SERVE_EXTRA, build_spec, registry
from gpu_train.client.cluster import connect, load_contract, resolve_team
from gpu_train.client.errors import ClientError


def _client(args: argparse.Namespace, team: str, *, need_cluster: bool):
    try:
        from gpu_train.serving.client import ServingClient
        from gpu_train.serving.cluster import ServingCluster
    except ImportError as exc:
        raise ClientError(f"`gpu-train serve` needs {exc.name}: {SERVE_EXTRA}") from None
    session = connect(args.kubeconfig, args.context) if need_cluster else None
    contract = load_contract(session, team, args.platform)
    cluster = ServingCluster(session.api, contract.team(team).namespace) if session is not None else None
    progress = lambda line: print(f"gpu-train: {line}", file=sys.stderr, flush=True)  # noqa: E731
    return ServingClient(contract, cluster=cluster, registry=None, progress=progress), session


def _fail(exc: Exception, doing: str, namespace: str, team: str, server: str = "") -> ClientError:
    """Any failure of an operation as one line: the user's to fix (2) or the cluster's or registry's (1)."""
    from gpu_train.client.cluster import api_error
    from gpu_train.jobs.serving import ServingError as RenderError
    from gpu_train.serving.client import ServingError

    if isinstance(exc, ServingError | RenderError):
        return ClientError(str(exc), code=2)
    if type(exc).__name__ in ("RegistryError", "LookupError", "PrometheusError"):
        return ClientError(str(exc), code=1)
    return api_error(exc, doing=doing, namespace=namespace, team=team, server=server)


def run(args: argparse.Namespace) -> int:
    team = args.team or ""
    if args.action in ("deploy", "canary") and args.dry_run and args.platform:
        if not team:
            raise ClientError("--dry-run --platform needs --team (no cluster to read the team from)")
        client, session = _client(args, team, need_cluster=False)
    else:
        session = connect(args.kubeconfig, args.context)
        team = resolve_team(args.team, session)
        client, session = _client(args, team, need_cluster=True)
    namespace = client.contract.team(team).namespace
    # MLflow when one is named (--tracking-uri, MLFLOW_TRACKING_URI): versions resolve there and aliases move.
    client.registry = registry(args.tracking_uri, required=False)
    try:
        return _act(args, client, team)
    except ClientError:
        raise
    except Exception as exc:  # API, registry and Prometheus failures, said in one line
        raise _fail(exc, f"serve {args.action} {args.name}", namespace, team,
                    session.server if session else "") from None


def _act(args: argparse.Namespace, client, team: str) -> int:
    if args.action == "deploy":
        spec = build_spec(args, spec_file=args.spec, name=args.name, team=team, model=args.model,
                          extra={"pool": args.pool, "runtime": args.runtime,
                                 "replicas": {"min": args.replicas, "max": args.replicas} if args.replicas else None})
        objects = client.deploy(spec, dry_run=args.dry_run)
        if args.dry_run:
            sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
            return 0
        isvc = objects[0]["metadata"]
        print(f"deployed {isvc['annotations']['gpu-train.io/model']}:{isvc['annotations']['gpu-train.io/model-version']}"
              f" as service {args.name} in {isvc['namespace']} (run {isvc['annotations']['gpu-train.io/mlflow-run-id']})"
              f"\n  kubectl -n {isvc['namespace']} port-forward svc/{args.name} 8000:80   then "
              "curl localhost:8000/v1/completions")
        return 0
    if args.action == "canary":
        return _canary(args, client, team)
    if args.action in ("promote", "rollback"):
        decision = client.decide(args.name, args.action)
        print(f"{args.name}: {decision.reason}")
        return 0
    status = client.status(args.name)
    print(yaml.safe_dump(status, sort_keys=False), end="")
    return 0


def _canary(args: argparse.Namespace, client, team: str) -> int:
    if args.here and not (args.auto and args.prometheus):
        raise ClientError("--here runs the promotion loop in this terminal: it needs --auto and --prometheus URL (for "
                       "example a kubectl port-forward to the platform's Prometheus)")
    if not 1 <= args.traffic <= 99:
        raise ClientError(f"--traffic {args.traffic} must be 1..99 percent")
    spec = build_spec(args, spec_file=args.spec, name=args.name, team=team, model=args.model)
    driver = ("cli" if args.here else "cluster") if args.auto else "manual"
    objects, state = client.canary(spec, traffic=args.traffic, driver=driver, dry_run=args.dry_run,
                                   stable=args.stable)
    if args.dry_run:
        sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
        return 0
    if driver == "manual":
        print(f"canary {state.model}:{state.canary} takes {args.traffic}% of {args.name}; gpu-train serve promote "
              f"--name {args.name} or rollback --name {args.name} decides")
        return 0
    if driver == "cluster":
        print(f"canary {state.model}:{state.canary} of {args.name} handed to the promotion loop of "
              f"{client.cluster.namespace} (steps {state.policy['steps']}); gpu-train serve status --name {args.name}")
        return 0
    decision = client.run_here(spec, state, args.prometheus)
    print(json.dumps({"action": decision.action, "reason": decision.reason, "metrics": decision.metrics},
                     sort_keys=True))
    return 0 if decision.action == "promote" else 1
