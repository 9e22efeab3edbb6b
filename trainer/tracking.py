"""MLflow experiment tracking for the training loop; tracking trouble never stops or slows training.

Use from the training loop (only rank 0 does any work; on other ranks every call returns at once):

    from trainer.tracking import Tracker
    tracker = Tracker.create(cfg.tracking, run_dir=run_dir, resume_run_id=saved_run_id, enabled=rank == 0)
    tracker.log_params(flat_config)                   # dotted keys; over-long values are truncated
    tracker.set_tags({TAG_GIT_COMMIT: sha, TAG_DATASET_URI: cfg.data.uri})
    tracker.log_metrics({"loss": 2.31, "tokens_per_s": 1.2e5, "mfu": 0.41}, step=step)
    tracker.log_checkpoint(step, "s3://bucket/run/step_00000100")
    tracker.log_artifact(run_dir / "loss.png")
    tracker.register_model(model_dir, "gpt2-124m", {"dataset.uri": ..., "dataset.manifest_sha256": ...})
    tracker.close()
    print(tracker.ui_hint())                          # where the run is and how to open the UI

Where runs go: `tracking.uri`, else env MLFLOW_TRACKING_URI, else an embedded SQLite store beside the run
directory (`runs/mlflow.db`, artifacts in `runs/mlartifacts/` for `--run-dir runs/NAME`).

How it stays out of the way: every call only appends to a bounded in-memory queue and returns. One background
thread sends the queue in order (metrics coalesced into `log_batch` calls of up to 1000 points), retrying with
exponential backoff while the server is unreachable. The first failure logs one warning and the recovery one
info line; when the queue is full the oldest metric points are dropped and counted. `close()` waits a bounded
time for the queue to drain and never raises.

Resume: give the run id saved in the checkpoint as `resume_run_id`. The same MLflow run continues; for every
metric key, steps at or below the last step already stored for that key (read from the run's metric history)
are skipped, so re-running steps after a restart never duplicates points. See docs/tracking.md.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

_LOG = logging.getLogger(__name__)

# Tag names the loop and the registry share. `mlflow.source.git.commit` is the name the MLflow UI shows as the
# run's source version (https://mlflow.org/docs/latest/ml/tracking/tracking-api/#system-tags).
TAG_GIT_COMMIT = "mlflow.source.git.commit"
TAG_IMAGE_DIGEST = "trainer.image_digest"
TAG_DATASET_URI = "dataset.uri"
TAG_DATASET_MANIFEST = "dataset.manifest_sha256"
TAG_CHECKPOINT_URI = "checkpoint.latest_uri"
TAG_CHECKPOINT_STEP = "checkpoint.latest_step"
TAG_RESUMES = "trainer.resumes"
IMAGE_DIGEST_ENV = "TRAINER_IMAGE_DIGEST"

# MLflow's own limits (mlflow/utils/validation.py in 3.17): a longer value is rejected by the server, and a
# rejected log_batch loses every entry in it, so values are trimmed before they are queued.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
_TRUNCATED = "...[truncated]"

# Files up to this size are copied aside when queued, so a later overwrite (loss.png is redrawn) or delete
# cannot change what gets uploaded; bigger ones (model directories) are uploaded from where they are.
_SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024


class TrackingSettings(Protocol):
    """The fields of gpu_train.spec.trainer_config.TrackingConfig the tracker reads."""

    enabled: bool
    uri: str
    experiment: str


@dataclass(frozen=True, kw_only=True)
class TrackerOptions:
    """Knobs of the background sender; the defaults suit a real run, tests shorten the waits."""

    max_pending_metrics: int = 200_000  # metric points held while the server is unreachable (~35 MB)
    flush_timeout_s: float = 120.0  # close() waits at most this long for the queue (incl. model upload)
    start_timeout_s: float = 10.0  # create() waits at most this long for the run id on the first try
    initial_backoff_s: float = 0.5  # first retry delay after a failure; doubles per failure
    max_backoff_s: float = 30.0  # retry delay cap while the server stays unreachable
    request_timeout_s: float = 30.0  # per-request connect/read timeout (env MLFLOW_HTTP_REQUEST_TIMEOUT)

    def __post_init__(self) -> None:
        for name in ("max_pending_metrics", "flush_timeout_s", "initial_backoff_s", "max_backoff_s",
                     "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrackerOptions.{name} must be > 0 (got {getattr(self, name)})")
        if self.start_timeout_s < 0:
            raise ValueError(f"TrackerOptions.start_timeout_s must be >= 0 (got {self.start_timeout_s})")


# ------------------------------------------------------------------------------------------- pure helpers
@dataclass(frozen=True)
class LocalStore:
    """The embedded store used when no tracking URI is configured."""

    db_path: Path
    artifacts_dir: Path

    @property
    def tracking_uri(self) -> str:
        # Four slashes = absolute path; MLflow recommends SQLite over the ./mlruns file store for local use
        # (https://mlflow.org/docs/latest/self-hosting/architecture/backend-store/).
        return f"sqlite:///{self.db_path}"


def local_store(run_dir: Path) -> LocalStore:
    """The embedded store for a run directory: beside it, so every run under runs/ shares one UI."""
    base = Path(run_dir).resolve().parent
    return LocalStore(db_path=base / "mlflow.db", artifacts_dir=base / "mlartifacts")


_KNOWN_SCHEMES = {"http", "https", "sqlite", "postgresql", "mysql", "mssql", "file", "databricks"}


def resolve_tracking_uri(configured: str, run_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """`tracking.uri`, else env MLFLOW_TRACKING_URI, else the embedded SQLite store for run_dir."""
    env = os.environ if env is None else env
    uri = configured.strip() or env.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return local_store(run_dir).tracking_uri
    source = "tracking.uri" if configured.strip() else "MLFLOW_TRACKING_URI"
    scheme = urlparse(uri).scheme.split("+")[0]  # postgresql+psycopg2:// is a SQLAlchemy dialect
    if scheme not in _KNOWN_SCHEMES:
        raise ValueError(
            f"{source} {uri!r} is not a tracking URI MLflow understands: expected one of "
            f"{', '.join(sorted(s + '://' for s in _KNOWN_SCHEMES))}"
        )
    return uri


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys: {"train": {"lr": 3e-4}} -> {"train.lr": 3e-4}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def clip(value: str, limit: int) -> str:
    """A string MLflow accepts: over `limit` characters it is cut and ends with a visible marker."""
    return value if len(value) <= limit else value[: limit - len(_TRUNCATED)] + _TRUNCATED


def ui_hint(tracking_uri: str, *, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """Human text: where the run is stored and how to look at it."""
    scheme = urlparse(tracking_uri).scheme
    page = f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id and run_id else ""
    run = f"MLflow run {run_id}" if run_id else "MLflow runs"
    if scheme in ("http", "https"):
        base = tracking_uri.rstrip("/")
        text = f"{run}: {base}/{page}"
        host = urlparse(tracking_uri).hostname or ""
        if host.endswith(".svc.cluster.local"):
            # The in-cluster service has no ingress on purpose; a port-forward is the way in from a laptop.
            service, namespace = host.split(".")[:2]
            port = urlparse(tracking_uri).port or 80
            text += (
                f"\nFrom outside the cluster: kubectl -n {namespace} port-forward svc/{service} 5000:{port}"
                f"  then open http://127.0.0.1:5000/{page}"
            )
        return text
    if scheme == "sqlite":
        db = tracking_uri[len("sqlite:///"):]
        artifacts = Path(db).parent / "mlartifacts"
        return (
            f"{run} stored in {db} (artifacts in {artifacts}).\n"
            f"Open the UI: mlflow ui --backend-store-uri {tracking_uri} --port 5000"
            f"  then http://127.0.0.1:5000/{page}"
        )
    return f"{run} stored at {tracking_uri} (open it with: mlflow ui --backend-store-uri {tracking_uri})"


def git_commit(cwd: Path | None = None) -> str | None:
    """The commit of the source tree the trainer runs from, or None outside a git checkout (the image)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).resolve().parent,
            capture_output=True, text=True, timeout=5, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) == 40 else None


# ----------------------------------------------------------------------------------------- queued operations
@dataclass
class _Op:
    kind: str  # params | tags | text | checkpoint | artifact | register
    payload: Any
    progress: set[str] = field(default_factory=set)  # sub-steps already done, so a retry skips them


# One metric point as queued: key, value, wall-clock ms when logged, step.
_Point = tuple[str, float, int, int]


def _is_transient(exc: BaseException) -> bool:
    """True when retrying can help (connection refused, timeout, 5xx, 429); False for a rejected request."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import (
        INTERNAL_ERROR,
        REQUEST_LIMIT_EXCEEDED,
        TEMPORARILY_UNAVAILABLE,
        ErrorCode,
    )

    if isinstance(exc, RestException):
        status = exc.get_http_status_code()
        return status >= 500 or status in (408, 429)
    if isinstance(exc, MlflowException):
        # Connection errors and timeouts reach us as MlflowException with INTERNAL_ERROR
        # (mlflow/utils/rest_utils.py, http_request); validation errors carry INVALID_PARAMETER_VALUE.
        transient = {ErrorCode.Name(c) for c in (INTERNAL_ERROR, TEMPORARILY_UNAVAILABLE, REQUEST_LIMIT_EXCEEDED)}
        return exc.error_code in transient
    return isinstance(exc, ConnectionError | TimeoutError) or type(exc).__module__.startswith(
        ("requests", "urllib3")
    )


class _Sender(threading.Thread):
    """Owns the MLflow client; the only thread that talks to the server.

    Two queues: metric points (bounded, oldest dropped first) and everything else (params, tags, artifacts,
    checkpoints, registration: few and small, never dropped). Order between the two does not matter to
    MLflow; the run is opened before either is sent and marked terminated after both are empty.
    """

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, resume_run_id: str | None,
                 artifact_root: Path | None, options: TrackerOptions, initial_tags: dict[str, str]) -> None:
        super().__init__(name="mlflow-tracker", daemon=True)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.resume_run_id = resume_run_id
        self.artifact_root = artifact_root
        self.options = options
        self.initial_tags = initial_tags

        self.cond = threading.Condition()
        self.points: collections.deque[_Point] = collections.deque()
        self.ops: collections.deque[_Op] = collections.deque()
        self.in_flight = 0  # items taken from the queues and not yet sent
        self.dropped_metrics = 0
        self._drop_warned_at = 0
        self.terminate_status: str | None = None  # set by close(); sent once both queues are empty
        self.closing = False
        self.deadline: float | None = None
        self.first_attempt = threading.Event()

        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.reachable = True
        self._down_since = 0.0
        self._last_step: dict[str, int] = {}  # metric key -> last step already stored in a resumed run
        self._stored_params: dict[str, str] = {}
        self._param_conflicts_warned = False
        self._client: Any = None

    # ---- producer side (training thread) -----------------------------------------------------------------
    def put_points(self, points: list[_Point]) -> None:
        with self.cond:
            if self.closing:
                return
            self.points.extend(points)
            over = len(self.points) - self.options.max_pending_metrics
            if over > 0:
                for _ in range(over):
                    self.points.popleft()
                self.dropped_metrics += over
                # Counted, not per call: the first drop, then each time the total has doubled.
                if self.dropped_metrics >= 2 * self._drop_warned_at:
                    self._drop_warned_at = self.dropped_metrics
                    _LOG.warning(
                        "MLflow tracking queue is full (%d metric points pending): dropping the oldest, "
                        "%d dropped so far", self.options.max_pending_metrics, self.dropped_metrics,
                    )
            self.cond.notify_all()

    def put(self, op: _Op) -> None:
        with self.cond:
            if self.closing:
                return
            self.ops.append(op)
            self.cond.notify_all()

    def pending(self) -> int:
        with self.cond:
            return len(self.points) + len(self.ops) + self.in_flight + (self.terminate_status is not None)

    # ---- consumer side -------------------------------------------------------------------------------------
    def run(self) -> None:
        backoff = self.options.initial_backoff_s
        work: list[_Point] | _Op | str | None = None
        while not self._past_deadline():
            if self.run_id is None:
                ok = self._attempt_open()
                self.first_attempt.set()
                if not ok:
                    backoff = self._sleep(backoff)
                    continue
            if work is None:
                work = self._take()
                if work is None:
                    break  # closing and everything sent
            try:
                self._send(work)
            except Exception as exc:  # every failure is either retried or reported
                if _is_transient(exc):
                    self._mark_down(exc)
                    backoff = self._sleep(backoff)
                    continue
                self._mark_up()
                _LOG.warning("MLflow rejected %s (not retried): %s", _describe(work), _first_line(exc))
            else:
                self._mark_up()
            with self.cond:
                self.in_flight = 0
                if work == self.terminate_status:
                    self.terminate_status = None
                self.cond.notify_all()  # wakes flush()
            work = None
            backoff = self.options.initial_backoff_s
        self.first_attempt.set()

    def _take(self) -> list[_Point] | _Op | str | None:
        """Next work: an op, up to MAX_METRICS_PER_BATCH points, the final status, or None when done."""
        with self.cond:
            while True:
                if self.ops:
                    self.in_flight = 1
                    return self.ops.popleft()
                if self.points:
                    n = min(len(self.points), MAX_METRICS_PER_BATCH)
                    self.in_flight = n
                    return [self.points.popleft() for _ in range(n)]
                if self.terminate_status is not None:
                    return self.terminate_status
                if self.closing:
                    return None
                self.cond.wait()

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _sleep(self, backoff: float) -> float:
        """Wait before the next retry (woken early by close), and return the next, longer backoff."""
        delay = backoff * (0.5 + random.random())  # jitter: many jobs must not retry in lockstep
        with self.cond:
            if self.deadline is not None:
                delay = min(delay, max(0.0, self.deadline - time.monotonic()))
            self.cond.wait(timeout=delay)
        return min(backoff * 2, self.options.max_backoff_s)

    def _attempt_open(self) -> bool:
        try:
            self._open_run()
        except Exception as exc:
            if _is_transient(exc):
                self._mark_down(exc)
                return False
            # A permanent failure opening the run (bad experiment, no permission) will not heal by retrying:
            # stop tracking, keep training.
            _LOG.warning("MLflow tracking disabled: could not open a run at %s: %s",
                         self.tracking_uri, _first_line(exc))
            with self.cond:
                self.closing = True
                self.deadline = time.monotonic()
                self.ops.clear()
                self.points.clear()
                self.terminate_status = None
            return False
        self._mark_up()
        return True

    def _mark_down(self, exc: BaseException) -> None:
        if self.reachable:
            self.reachable = False
            self._down_since = time.monotonic()
            _LOG.warning(
                "MLflow tracking server %s is unreachable (%s); training continues, tracking data is "
                "buffered (up to %d metric points) and retried in the background",
                self.tracking_uri, _first_line(exc), self.options.max_pending_metrics,
            )

    def _mark_up(self) -> None:
        if not self.reachable:
            self.reachable = True
            _LOG.info(
                "MLflow tracking server %s is reachable again after %.0f s; sending buffered data "
                "(%d metric points dropped so far)",
                self.tracking_uri, time.monotonic() - self._down_since, self.dropped_metrics,
            )

    # ---- the MLflow calls ----------------------------------------------------------------------------------
    def _open_run(self) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        if self._client is None:
            # Inside the guarded attempt: with mlflow-skinny (the trainer image) a sqlite:// store fails here
            # on the missing SQLAlchemy, which must disable tracking, not kill the thread.
            self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        client = self._client
        if self.resume_run_id:
            try:
                run = client.get_run(self.resume_run_id)
            except MlflowException as exc:
                if _is_transient(exc):
                    raise
                _LOG.warning(
                    "MLflow run %s from the checkpoint is not in %s (%s); starting a new run",
                    self.resume_run_id, self.tracking_uri, _first_line(exc),
                )
            else:
                self._resume(run)
                return
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            location = (self.artifact_root / self.experiment).as_uri() if self.artifact_root else None
            try:
                experiment_id = client.create_experiment(self.experiment, artifact_location=location)
            except MlflowException as exc:
                if _is_transient(exc):
                    raise
                # Created meanwhile by another job; anything else surfaces on the lookup below.
                experiment_id = client.get_experiment_by_name(self.experiment).experiment_id
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.initial_tags)
        self.experiment_id = experiment_id
        self.run_id = run.info.run_id

    def _resume(self, run: Any) -> None:
        client = self._client
        run_id = run.info.run_id
        for key in run.data.metrics:
            history = client.get_metric_history(run_id, key)
            if history:
                self._last_step[key] = max(m.step for m in history)
        self._stored_params = dict(run.data.params)
        resumes = int(run.data.tags.get(TAG_RESUMES, "0")) + 1
        client.log_batch(run_id, tags=_tag_entities({**self.initial_tags, TAG_RESUMES: str(resumes)}),
                         synchronous=True)
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        self.experiment_id = run.info.experiment_id
        self.run_id = run_id
        _LOG.info(
            "MLflow run %s resumed (resume #%d); metric steps already stored are skipped (last: %s)",
            run_id, resumes, max(self._last_step.values(), default="none"),
        )

    def _send(self, work: list[_Point] | _Op | str) -> None:
        from mlflow.entities import Metric, Param

        client, run_id = self._client, self.run_id
        if isinstance(work, str):
            client.set_terminated(run_id, status=work)
            return
        if isinstance(work, list):
            metrics = [Metric(k, v, ts, step) for k, v, ts, step in work if step > self._last_step.get(k, -1)]
            if metrics:
                client.log_batch(run_id, metrics=metrics, synchronous=True)
            return
        op = work
        if op.kind == "params":
            params = self._new_params(op.payload)
            for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
                chunk = params[i: i + MAX_PARAMS_TAGS_PER_BATCH]
                client.log_batch(run_id, params=[Param(k, v) for k, v in chunk], synchronous=True)
                self._stored_params.update(chunk)
        elif op.kind == "tags":
            entities = _tag_entities(op.payload)
            for i in range(0, len(entities), MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(run_id, tags=entities[i: i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)
        elif op.kind == "text":
            text, artifact_file = op.payload
            client.log_text(run_id, text, artifact_file)
        elif op.kind == "checkpoint":
            step, uri, logged_at = op.payload
            if "record" not in op.progress:
                record = {"step": step, "uri": uri, "logged_at_unix": logged_at}
                client.log_text(run_id, json.dumps(record, indent=1) + "\n", f"checkpoints/step_{step:08d}.json")
                op.progress.add("record")
            client.log_batch(run_id, tags=_tag_entities({TAG_CHECKPOINT_URI: uri, TAG_CHECKPOINT_STEP: str(step)}),
                             synchronous=True)
        elif op.kind == "artifact":
            path, artifact_path, cleanup = op.payload
            if path.is_dir():
                client.log_artifacts(run_id, str(path), artifact_path)
            else:
                client.log_artifact(run_id, str(path), artifact_path)
            if cleanup:
                shutil.rmtree(path.parent, ignore_errors=True)
        elif op.kind == "register":
            self._register(op)
        else:
            raise ValueError(f"unknown tracking operation {op.kind!r}")

    def _new_params(self, params: dict[str, str]) -> list[tuple[str, str]]:
        """Params not yet in the run; a resumed run keeps its first value (MLflow params are immutable)."""
        fresh, conflicts = [], []
        for key, value in params.items():
            stored = self._stored_params.get(key)
            if stored is None:
                fresh.append((key, value))
            elif stored != value:
                conflicts.append(key)
        if conflicts and not self._param_conflicts_warned:
            self._param_conflicts_warned = True
            _LOG.warning(
                "MLflow run %s already has different values for %s; params are immutable, keeping the first "
                "(the resolved config of each restart is in its checkpoint)", self.run_id, ", ".join(conflicts),
            )
        return fresh

    def _register(self, op: _Op) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

        client, run_id = self._client, self.run_id
        model_dir, name, tags = op.payload
        if "upload" not in op.progress:
            client.log_artifacts(run_id, str(model_dir), "model")
            op.progress.add("upload")
        if "registered" not in op.progress:
            try:
                client.create_registered_model(name, tags={"trainer.source": "gpu-train"})
            except MlflowException as exc:
                if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                    raise
            op.progress.add("registered")
        version = client.create_model_version(name, source=f"runs:/{run_id}/model", run_id=run_id, tags=tags)
        _LOG.info("Registered model %s version %s from run %s", name, version.version, run_id)


def _tag_entities(tags: Mapping[str, str]) -> list[Any]:
    from mlflow.entities import RunTag

    return [RunTag(k, v) for k, v in tags.items()]


def _describe(work: list[_Point] | _Op | str) -> str:
    if isinstance(work, list):
        return f"{len(work)} metric points"
    if isinstance(work, str):
        return f"the final run status {work}"
    return f"a {work.kind} update"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------- Tracker
class Tracker:
    """Non-blocking MLflow logging for one training run; see the module docstring."""

    def __init__(self, sender: _Sender | None, *, resume_run_id: str | None = None,
                 tracking_uri: str = "") -> None:
        self._sender = sender
        self._resume_run_id = resume_run_id
        self.tracking_uri = tracking_uri
        self._staging: Path | None = None
        self._latest_checkpoint: str | None = None
        self._tags: dict[str, str] = {}
        self._closed = False

    @classmethod
    def create(cls, cfg: TrackingSettings, *, run_dir: Path, resume_run_id: str | None = None,
               enabled: bool = True, options: TrackerOptions | None = None) -> Tracker:
        """A tracker for this process: a working one on rank 0 with tracking.enabled, else one that ignores calls.

        Raises ValueError naming the key when the configured URI cannot be a tracking URI; everything that
        can go wrong at the server later is logged, not raised.
        """
        if not (enabled and cfg.enabled):
            return cls(None, resume_run_id=resume_run_id)
        options = options or TrackerOptions()
        if not cfg.experiment.strip():
            raise ValueError("tracking.experiment must not be empty")
        tracking_uri = resolve_tracking_uri(cfg.uri, run_dir)
        artifact_root = None
        if tracking_uri.startswith("sqlite:"):
            store = local_store(run_dir)
            if tracking_uri == store.tracking_uri:
                store.db_path.parent.mkdir(parents=True, exist_ok=True)
                artifact_root = store.artifacts_dir
        # MLflow's client retries each request itself for minutes by default; the sender has its own backoff
        # and must notice an outage quickly, so one try per request unless the user chose otherwise.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(options.request_timeout_s)))
        initial_tags = {}
        digest = os.environ.get(IMAGE_DIGEST_ENV, "").strip()
        if digest:
            initial_tags[TAG_IMAGE_DIGEST] = digest
        commit = git_commit()
        if commit:
            initial_tags[TAG_GIT_COMMIT] = commit
        sender = _Sender(
            tracking_uri=tracking_uri, experiment=cfg.experiment, run_name=Path(run_dir).resolve().name,
            resume_run_id=resume_run_id, artifact_root=artifact_root, options=options,
            initial_tags=initial_tags,
        )
        tracker = cls(sender, resume_run_id=resume_run_id, tracking_uri=tracking_uri)
        tracker._tags.update(initial_tags)
        sender.start()
        # Wait for the first attempt to open the run so the run id is in the first checkpoint; when the server
        # is down this returns at once and the id appears once the server answers.
        sender.first_attempt.wait(timeout=options.start_timeout_s)
        return tracker

    # ---- state -----------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._sender is not None

    @property
    def run_id(self) -> str | None:
        """The MLflow run id to save in checkpoints (the resumed id until a new run is known)."""
        if self._sender is None:
            return self._resume_run_id
        return self._sender.run_id or self._resume_run_id

    @property
    def experiment_id(self) -> str | None:
        return self._sender.experiment_id if self._sender else None

    @property
    def dropped_metrics(self) -> int:
        return self._sender.dropped_metrics if self._sender else 0

    # ---- logging (all non-blocking) -----------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Config values as params (nested mappings are flattened to dotted keys)."""
        if self._sender is None:
            return
        clean: dict[str, str] = {}
        full: dict[str, str] = {}
        for key, value in flatten(params).items():
            if len(key) > MAX_KEY:
                _LOG.warning("MLflow param key longer than %d characters not logged: %s...", MAX_KEY, key[:80])
                continue
            text = _param_text(value)
            clean[key] = clip(text, MAX_PARAM_VALUE)
            if clean[key] != text:
                full[key] = text
        self._sender.put(_Op("params", clean))
        if full:
            # The whole value still reaches the run, as an artifact next to the trimmed param.
            self._sender.put(_Op("text", (json.dumps(full, indent=1), "params_full_values.json")))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self._sender is None:
            return
        clean = {k: clip(str(v), MAX_TAG_VALUE) for k, v in tags.items() if len(k) <= MAX_KEY}
        self._tags.update(clean)
        self._sender.put(_Op("tags", clean))

    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        """One point per key at `step`; None values are skipped. Returns at once."""
        if self._sender is None:
            return
        now_ms = int(time.time() * 1000)
        points = [(k, float(v), now_ms, int(step)) for k, v in metrics.items() if v is not None]
        if points:
            self._sender.put_points(points)

    def log_checkpoint(self, step: int, uri: str) -> None:
        """Record a saved checkpoint: a small artifact per checkpoint plus the latest-checkpoint tags."""
        self._latest_checkpoint = uri
        if self._sender is not None:
            self._sender.put(_Op("checkpoint", (int(step), str(uri), time.time())))

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Upload a file or directory. Small files are copied now, so later rewrites do not race the upload."""
        if self._sender is None:
            return
        path = Path(path)
        if not path.exists():
            _LOG.warning("MLflow artifact %s does not exist; not logged", path)
            return
        cleanup = False
        if path.is_file() and path.stat().st_size <= _SNAPSHOT_MAX_BYTES:
            if self._staging is None:
                self._staging = Path(tempfile.mkdtemp(prefix="mlflow-staging-"))
            slot = Path(tempfile.mkdtemp(dir=self._staging))
            path = Path(shutil.copy2(path, slot / path.name))
            cleanup = True
        self._sender.put(_Op("artifact", (path, artifact_path, cleanup)))

    def register_model(self, model_dir: Path | str, name: str, tags: Mapping[str, Any]) -> None:
        """Upload model_dir as the run's `model` artifact and create a version of registered model `name`.

        The version carries lineage tags: the given ones (dataset URI and manifest hash, config, checkpoint)
        plus, unless given, the image digest, git commit and latest checkpoint this tracker knows.
        """
        if self._sender is None:
            return
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            _LOG.warning("Model directory %s does not exist; model %r not registered", model_dir, name)
            return
        if not name.strip():
            _LOG.warning("Empty registered model name (tracking.register_name); model not registered")
            return
        lineage: dict[str, str] = {}
        for key in (TAG_IMAGE_DIGEST, TAG_GIT_COMMIT):
            if key in self._tags:
                lineage[key] = self._tags[key]
        if self._latest_checkpoint:
            lineage[TAG_CHECKPOINT_URI] = self._latest_checkpoint
        lineage.update({k: str(v) for k, v in tags.items()})
        lineage = {k: clip(v, 100_000) for k, v in lineage.items() if len(k) <= MAX_KEY}
        self._sender.put(_Op("register", (model_dir, name, lineage)))

    def flush(self, timeout_s: float) -> bool:
        """Wait at most timeout_s until everything queued so far is sent; True when it was."""
        sender = self._sender
        if sender is None:
            return True
        deadline = time.monotonic() + timeout_s
        with sender.cond:
            while sender.is_alive() and (sender.points or sender.ops or sender.in_flight or sender.run_id is None):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                sender.cond.wait(timeout=min(left, 0.5))
        return sender.pending() == 0 and sender.run_id is not None

    def close(self, *, status: str = "FINISHED", timeout_s: float | None = None) -> None:
        """Mark the run `status`, wait at most timeout_s (default options.flush_timeout_s) to send what is
        queued, then give up with a warning. Never raises; calling it twice is harmless."""
        sender = self._sender
        if sender is None or self._closed:
            return
        self._closed = True
        try:
            timeout = sender.options.flush_timeout_s if timeout_s is None else timeout_s
            with sender.cond:
                if not sender.closing:  # not already shut down by a permanent failure
                    sender.terminate_status = status
                sender.closing = True
                sender.deadline = time.monotonic() + timeout
                sender.cond.notify_all()
            # A request in flight at the deadline is bounded by the HTTP timeout; the thread is a daemon, so
            # it never holds up interpreter exit.
            sender.join(timeout=timeout + 1.0)
            left = sender.pending()
            if left:
                _LOG.warning(
                    "MLflow tracking: gave up after %.1f s with %d updates not sent to %s (server unreachable)",
                    timeout, left, self.tracking_uri,
                )
            if sender.dropped_metrics:
                _LOG.warning("MLflow tracking dropped %d metric points in total (queue full while the server "
                             "was unreachable)", sender.dropped_metrics)
        except Exception as exc:  # close() is called from finally blocks and must not raise
            _LOG.warning("MLflow tracking close failed: %s", exc)
        finally:
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)

    def ui_hint(self) -> str:
        """Where this run is and how to open it (printed at the end of `make train`); "" when disabled."""
        if self._sender is None:
            return ""
        return ui_hint(self.tracking_uri, experiment_id=self.experiment_id, run_id=self.run_id)


def _param_text(value: Any) -> str:
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str)
    return str(value)
