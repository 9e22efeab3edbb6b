"""`gpu-train serve`: a registered model as a team's service, a canary that promotes or rolls back by itself, and
the same API on this machine.

Usage (docs/serving.md walks through each):
    gpu-train serve --local runs/make-train/export                       # this machine, port 8000
    gpu-train serve --local models:/tiny@champion --canary models:/tiny/2 --canary-weight 10 --auto \\
        --prometheus http://127.0.0.1:9090                               # a canary on this machine
    gpu-train serve deploy tiny:3 --team research --name chat [--dry-run]
    gpu-train serve canary tiny:4 --team research --name chat --traffic 10 --auto [--latency-ms 500 ...]
    gpu-train serve promote|rollback|status --team research --name chat
    gpu-train serve bench --url http://127.0.0.1:8000 --requests 200 --concurrency 4

Arguments only: the service spec is gpu_train.spec.serving's (a --spec file, with flags on top), the operations
are gpu_train.serving.client's, the local mode gpu_train.serving.local's. Cluster commands need the `serve`
extra (MLflow's client), --local the `serve-local` extra (torch and transformers); without them one line says
which to install.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpu_train.cli.service_spec import LOCAL_EXTRA, build_spec, registry
from gpu_train.client.errors import ClientError


def _canary_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("canary schedule and objectives (the spec's `canary` settings; docs/serving.md)")
    g.add_argument("--steps", help="traffic percentages in turn, e.g. 10,50 (canary.steps)")
    g.add_argument("--step-seconds", help="how long each step lasts and the SLO window (canary.stepSeconds)")
    g.add_argument("--interval-seconds", help="how often Prometheus is read (canary.intervalSeconds)")
    g.add_argument("--min-requests", help="canary requests a window needs to be judged (canary.minRequests)")
    g.add_argument("--timeout-seconds", help="give up a canary short of traffic after this (canary.timeoutSeconds)")
    g.add_argument("--max-reaction-seconds", help="the longest a breach may go unanswered (canary.maxReactionSeconds)")
    g.add_argument("--latency-percentile", help="which percentile latency-ms holds, e.g. 99 (canary.slo)")
    g.add_argument("--latency-ms", help="the canary's latency at that percentile may not exceed this (canary.slo)")
    g.add_argument("--error-rate", help="the canary's 5xx share may not exceed this, e.g. 0.01 (canary.slo)")
    g.add_argument("--max-latency-regression", help="nor its latency exceed the stable's by this fraction (canary.slo)")
    g.add_argument("--quality", metavar="FILE", help="YAML of the quality check: prompts [{prompt, expect}], "
                                                     "minScore, maxRegression, maxTokens (canary.quality)")


def _service_flags(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        p.add_argument("model", help="registered model: NAME:VERSION, NAME@ALIAS or NAME (its newest version)")
    p.add_argument("--name", required=True, help="the service's name (a DNS label)")
    p.add_argument("--spec", metavar="FILE", help="service spec file (YAML); flags override its values")
    p.add_argument("--tracking-uri", default=None, help="MLflow (default $MLFLOW_TRACKING_URI; the platform's "
                                                       "in-cluster server through kubectl port-forward)")


def add_parser(sub: Any, common: Any) -> None:
    """The `serve` subcommand and its actions; `common` adds the cluster flags (--kubeconfig, --team, ...)."""
    s = sub.add_parser("serve", help="serve a registered model: deploy, canary, promote, rollback, status, --local",
                       description="Serve registered models as your team's services on the cluster (KServe, a "
                                   "weighted route, an automatic canary), or an exported model on this machine "
                                   "with --local.")
    s.add_argument("--local", metavar="MODEL", help="serve on this machine: an exported directory or a registered "
                                                    "model (models:/NAME/VERSION, models:/NAME@ALIAS)")
    s.add_argument("--canary", metavar="MODEL", help="--local: a second version beside the first, behind the route")
    s.add_argument("--canary-weight", type=int, default=10, help="--local: the canary's share of requests (percent)")
    s.add_argument("--port", type=int, default=8000, help="--local: the route's port (default 8000)")
    s.add_argument("--name", dest="local_name", default="", metavar="NAME",
                   help="--local: the model's name in the API (default: from the model)")
    s.add_argument("--auto", dest="local_auto", action="store_true", help="--local: run the promotion loop")
    s.add_argument("--prometheus", dest="local_prometheus", default="", metavar="URL",
                   help="--local --auto: a Prometheus that scrapes the route's /metrics")
    s.add_argument("--spec", dest="local_spec", metavar="FILE", help="--local: service spec file (YAML)")
    s.add_argument("--threads", type=int, default=0, help="--local: torch threads per model server (0: default)")
    s.add_argument("--workdir", default="runs/serve", help="--local: downloads and decisions.jsonl")
    s.add_argument("--canary-inject-errors", type=float, default=0.0, metavar="FRACTION",
                   help="--local: the canary answers this share of completions with HTTP 500 (rehearse a rollback)")
    s.add_argument("--canary-inject-delay-ms", type=int, default=0, metavar="MS",
                   help="--local: the canary delays every completion (rehearse a rollback)")
    s.add_argument("--tracking-uri", dest="local_tracking_uri", default=None, metavar="URI",
                   help="--local: MLflow, for models:/ (default $MLFLOW_TRACKING_URI)")
    _canary_flags(s)
    actions = s.add_subparsers(dest="action", metavar="ACTION")

    d = actions.add_parser("deploy", help="serve one version of a registered model as a service (all traffic)")
    _service_flags(d)
    d.add_argument("--pool", default=None, help="a serving GPU pool (default: the cluster's CPU nodes)")
    d.add_argument("--runtime", choices=("auto", "vllm", "huggingface"), default=None)
    d.add_argument("--replicas", type=int, default=None, help="replicas always running")
    d.add_argument("--dry-run", action="store_true", help="print the manifests instead of applying them")
    common(d)

    c = actions.add_parser("canary", help="try a new version beside the stable one; --auto promotes or rolls back")
    _service_flags(c)
    c.add_argument("--traffic", type=int, required=True, help="the canary's (first) share of requests, percent")
    c.add_argument("--auto", action="store_true", help="hand the canary to the namespace's promotion loop")
    c.add_argument("--here", action="store_true", help="with --auto: run the promotion loop in this terminal")
    c.add_argument("--prometheus", default="", help="with --here: a Prometheus this machine reaches")
    c.add_argument("--stable", type=int, default=None, help="with --dry-run and no cluster: the version serving now")
    c.add_argument("--dry-run", action="store_true", help="print the manifests instead of applying them")
    _canary_flags(c)
    common(c)

    for name, text in (("promote", "give the canary all traffic and remove the stable version"),
                       ("rollback", "remove the canary; the stable version takes all traffic"),
                       ("status", "the service's versions, weights, canary and last decisions")):
        a = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        a.add_argument("--name", required=True, help="the service's name")
        a.add_argument("--tracking-uri", default=None, help="MLflow (default $MLFLOW_TRACKING_URI)")
        common(a)

    b = actions.add_parser("bench", help="a bounded load test: latency percentiles and throughput")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="the service (or a port-forward to it)")
    b.add_argument("--model", default="", help="the model's name in the API (default: the server's only model)")
    # Read as text and checked in run_bench, so a bad value is one line naming the flag.
    b.add_argument("--requests", default="200", help="completions to send (default 200)")
    b.add_argument("--concurrency", default="4", help="at most this many in flight (default 4)")
    b.add_argument("--max-tokens", default="16", help="tokens per completion (default 16)")
    b.add_argument("--prompt", default="def ")
    b.add_argument("--json", action="store_true", help="print the summary as JSON")


# --------------------------------------------------------------------------------------------- commands


def _log_serving() -> None:
    """The serving programs' log lines (route changes, decisions) on stderr, as the command's own lines."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gpu-train: %(message)s"))
    log = logging.getLogger("gpu_train.serving")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.propagate = False


def run_local(args: argparse.Namespace) -> int:
    import importlib.util

    for module in ("torch", "transformers", "aiohttp", "fastapi", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            raise ClientError(f"`gpu-train serve --local` runs the model on this machine and needs {module}: {LOCAL_EXTRA}")
    from gpu_train.serving.local import LocalError, LocalOptions, parse_model, serve_local

    try:
        found = parse_model(args.local)
        registered = [m for m in (args.local, args.canary) if m and not isinstance(parse_model(m), Path)]
    except LocalError as exc:
        raise ClientError(str(exc)) from None
    # A registered model needs a tracking server: asked for before anything runs or is written.
    mlflow = registry(args.local_tracking_uri, True) if registered else None
    name = args.local_name or found.name
    name = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:32] or "model"
    spec = build_spec(args, spec_file=args.local_spec, name=name, team="local",
                      model=f"{name}:1" if isinstance(found, Path) else str(found))
    if args.local_auto and not (args.canary and args.local_prometheus):
        raise ClientError("--auto needs --canary MODEL and --prometheus URL (a Prometheus scraping the route)")
    if not 1 <= args.canary_weight <= 99:
        raise ClientError(f"--canary-weight {args.canary_weight} must be 1..99")
    opts = LocalOptions(port=args.port, canary_weight=args.canary_weight, threads=args.threads,
                        workdir=Path(args.workdir), canary_inject_errors=args.canary_inject_errors,
                        canary_inject_delay_ms=args.canary_inject_delay_ms,
                        prometheus=args.local_prometheus if args.local_auto else "")
    _log_serving()
    try:
        return serve_local(spec, args.local, args.canary, opts, lambda: mlflow)
    except LocalError as exc:
        raise ClientError(str(exc), code=exc.code) from None


def _positive(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ClientError(f"{flag} {text!r} is not a whole number") from None
    if value < 1:
        raise ClientError(f"{flag} {value} must be >= 1")
    return value


def _service_url(text: str) -> str:
    """An http(s) URL with a host and a valid port: what the bench can send completions to."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ClientError(f"--url {text!r} is not a usable URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ClientError(f"--url {text!r} is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000)")
    return text.rstrip("/")


def run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import urllib.request

    from gpu_train.serving.bench import format_summary, load

    requests = _positive("--requests", args.requests)
    concurrency = _positive("--concurrency", args.concurrency)
    max_tokens = _positive("--max-tokens", args.max_tokens)
    url = _service_url(args.url)
    model = args.model
    if not model:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
                model = json.load(resp)["data"][0]["id"]
        except OSError as exc:
            raise ClientError(f"no model list at {url}/v1/models ({exc}): is the service up?", code=1) from None
        except (ValueError, KeyError, IndexError, TypeError):
            raise ClientError(f"{url}/v1/models did not answer a model list: is it a gpu-train or KServe "
                              "service?", code=1) from None
    summary = asyncio.run(load(url, model=model, requests=requests, concurrency=concurrency,
                               max_tokens=max_tokens, prompt=args.prompt)).summary()
    print(json.dumps(summary, sort_keys=True) if args.json else format_summary(summary))
    return 0 if summary["ok"] else 1


def run_serve(args: argparse.Namespace) -> int:
    if args.local:
        return run_local(args)
    if args.action is None:
        raise ClientError("gpu-train serve needs an action (deploy, canary, promote, rollback, status, bench) or --local")
    if args.action == "bench":
        return run_bench(args)
    from gpu_train.cli import serve_cluster

    return serve_cluster.run(args)
