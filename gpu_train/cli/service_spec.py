"""The service spec `gpu-train serve` works on: a --spec file with the flags on top, read by the one service
model (gpu_train.spec.serving); and the model registry the cluster commands and --local use.

Usage: `spec = build_spec(args, spec_file=..., name=..., team=..., model=...)`; `registry(uri, required=True)`.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from gpu_train.client.errors import ClientError
from gpu_train.spec import yamlfile
from gpu_train.spec.install import install_hint

SERVE_EXTRA = install_hint("serve")
LOCAL_EXTRA = install_hint("serve-local")
# Flags that set the service spec's canary schedule and objectives: flag -> (spec key path, type).
CANARY_FLAGS = {
    "steps": (("canary", "steps"), lambda v: [int(x) for x in v.split(",")]),
    "step_seconds": (("canary", "stepSeconds"), int),
    "interval_seconds": (("canary", "intervalSeconds"), int),
    "min_requests": (("canary", "minRequests"), int),
    "timeout_seconds": (("canary", "timeoutSeconds"), int),
    "max_reaction_seconds": (("canary", "maxReactionSeconds"), int),
    "latency_percentile": (("canary", "slo", "latencyPercentile"), float),
    "latency_ms": (("canary", "slo", "latencyMs"), float),
    "error_rate": (("canary", "slo", "errorRate"), float),
    "max_latency_regression": (("canary", "slo", "maxLatencyRegression"), float),
}


def _read_yaml(path_text: str, flag: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ClientError(f"{flag} {path_text}: no such file")
    try:
        return yamlfile.load(path.read_text())
    except yaml.YAMLError as exc:
        raise ClientError(f"{path_text}: not valid YAML: {str(exc).splitlines()[0]}") from None


def _flag_value(flag: str, value: str, kind: Any) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = kind.__name__ if kind in (int, float) else "a list of percentages like 10,50"
        raise ClientError(f"--{flag.replace('_', '-')} {value!r} is not {what}") from None


def build_spec(args: argparse.Namespace, *, spec_file: str | None, name: str, team: str, model: str,
               extra: dict[str, Any] | None = None):
    """The service spec: the file, then the flags; problems name the key (and so the flag that set it)."""
    from gpu_train.spec.errors import SettingsError
    from gpu_train.spec.serving import read_service

    raw = _read_yaml(spec_file, "--spec") if spec_file else {}
    if not isinstance(raw, dict):
        raise ClientError(f"{spec_file}: a service spec is a mapping (name, team, model, canary, ...)")
    raw.update({"name": name or raw.get("name", ""), "team": team or raw.get("team", ""),
                "model": model or raw.get("model", "")})
    raw.update({k: v for k, v in (extra or {}).items() if v is not None})
    for flag, (path_keys, kind) in CANARY_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        node = raw
        for key in path_keys[:-1]:
            node = node.setdefault(key, {})
        node[path_keys[-1]] = _flag_value(flag, value, kind)
    if getattr(args, "quality", None):
        raw.setdefault("canary", {})["quality"] = _read_yaml(args.quality, "--quality")
    try:
        return read_service(raw, key="service")
    except SettingsError as exc:
        raise ClientError("\n".join(exc.problems)) from None


def registry(uri: str | None, required: bool):
    """MLflow at `uri`, else $MLFLOW_TRACKING_URI; None when neither is set and the caller can do without. Never
    MLflow's own default, which would create ./mlflow.db in the working directory."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        if not required:
            return None
        raise ClientError("a registered model needs MLflow: give --tracking-uri URI or set MLFLOW_TRACKING_URI")
    try:
        from gpu_train.serving.registry import MlflowRegistry
    except ImportError:
        raise ClientError(f"the model registry needs MLflow's client: {SERVE_EXTRA}") from None
    # MLflow's own INFO lines (a new SQLite store's migrations) are not the command's: its output stays its own lines.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    return MlflowRegistry(uri)
