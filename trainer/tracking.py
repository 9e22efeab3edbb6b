"""MLflow tracking for a training loop, over MLflow's own asynchronous logging and HTTP retries; tracking trouble
never stops or slows training.

Usage (only rank 0 does any work; on other ranks every call returns at once):
    from trainer import Tracker
    tracker = Tracker.start(experiment="my-model", run_name="run-1", tracking_uri=job.tracking_uri,
                            run_dir=job.run_dir, resume_run_id=saved_run_id, enabled=rank == 0)
    # the bundled trainer: Tracker.create(cfg.tracking, run_dir=run_dir, resume_run_id=..., enabled=rank == 0)
    tracker.log_params(flat_config)                   # dotted keys; over-long values are truncated
    tracker.log_dataset(cfg.data.uri, manifest_sha256)
    tracker.log_metrics({"loss": 2.31, "tokens_per_s": 1.2e5, "mfu": None}, step=step)   # None is left out
    tracker.log_checkpoint(step, "s3://bucket/run/step_000000100")
    tracker.log_artifact(run_dir / "loss.png")
    tracker.register_model(model_dir, "gpt2-124m", {"dataset.uri": ..., "dataset.manifest_sha256": ...})
    tracker.close(status="FINISHED")
    print(tracker.ui_hint())                          # where the run is and how to open the UI

A run with `tracking.parent_run_id` is created with the tag `mlflow.parentRunId`, which the MLflow UI reads to
nest it under that run (a sweep's trials under the sweep's run).

Where runs go: `tracking_uri` (the bundled trainer's `tracking.uri`), else env MLFLOW_TRACKING_URI, else an
embedded SQLite store beside the run directory (`runs/mlflow.db`, artifacts in `runs/mlartifacts/` for `--run-dir runs/NAME`). docs/tracking.md.

What MLflow does: metrics, the only frequent call, go straight into MLflow's asynchronous queue
(`MlflowClient.log_batch(..., synchronous=False)`: the call only enqueues, MLflow's threads send), and every
request is retried by MLflow's HTTP client with exponential backoff (MLFLOW_HTTP_REQUEST_MAX_RETRIES, 7 by
default, about 4 minutes; MLFLOW_HTTP_REQUEST_TIMEOUT; set them to change this).

What is written here, because MLflow 3.17 lacks it:
- The run is opened (or reopened) off the training thread. create_run and get_run have no asynchronous form,
  and with the server down they block for MLflow's whole retry window. One daemon thread opens the run, then
  makes the calls MLflow only offers synchronously (params, tags, artifact uploads, the checkpoint record,
  model registration, the final status), in order. A daemon thread, since a ThreadPoolExecutor's threads are
  joined at interpreter exit, which would hold the process open for the retries. `create` waits for the
  run id at most `start_timeout_s`, less when the server is found unreachable.
- Metric points logged before the run is open wait in a bounded buffer (`max_pending_metrics`, oldest dropped
  and counted); MLflow's own queue holds a batch until it is sent or its retries run out (then it is counted
  as lost).
- Resume: for every metric key, the steps already stored are not sent again (a restart replays the steps after
  its checkpoint), and only those: MLflow's queue sends batches from several threads, so a process killed while
  sending may leave a later step stored and an earlier one not, and the earlier one is sent by the replay.
  Params keep their first value (MLflow params are immutable).
- Points a lost process never sent: `unsent(step)` lists the points of steps up to a checkpoint that are not yet
  known to be stored (held before the run opened, still in MLflow's queue, or given up on by it); every
  checkpoint carries them (trainer/resume.py), and the relaunch's tracker sends those its run lacks (`carried`).
  A process killed before its run opened (a slow first start of a SQLite store) loses no step that way.
- One line per outage: MLflow's HTTP client logs a urllib3 warning for every retry of every request, and its
  queue an error for every lost batch. While the tracker runs, a filter on those two loggers turns the lines
  about its server and run into one warning when the server becomes unreachable and one line when it answers
  again.
- `close()` waits a bounded time (MLflow's own flush waits for as long as the retries take) and never raises.

Over 400 lines because of what MLflow lacks (listed above): the off-thread run opening, the pre-open buffer, resume
de-duplication and the outage filter share the tracker's state.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from gpu_train.spec import env as job_env

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
# A key the trainer makes at a job's first launch and keeps in its checkpoints: a relaunch whose checkpoint was
# saved before MLflow answered with the run id (a slow server) finds the run by it instead of opening a second one.
TAG_RUN_KEY = "trainer.run_key"
# The MLflow UI nests a run under the run this tag names: a sweep's trials under the sweep's run.
TAG_PARENT_RUN = "mlflow.parentRunId"

# MLflow's limits (mlflow/utils/validation.py in 3.17): a longer value is rejected with its whole batch.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
_TRUNCATED = "...[truncated]"
# Files up to this size are copied aside when queued, so a later rewrite (loss.png is redrawn) cannot change
# what gets uploaded; bigger ones (model directories) are uploaded from where they are.
_SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024
# The two loggers whose per-request lines become one line per outage (module docstring).
_RETRY_LOGGERS = ("urllib3.connectionpool", "mlflow.utils.async_logging.async_logging_queue")


class TrackingSettings(Protocol):
    """The fields of gpu_train.spec.trainer_config.TrackingConfig the tracker reads."""

    enabled: bool
    uri: str
    experiment: str


@dataclass(frozen=True, kw_only=True)
class TrackerOptions:
    max_pending_metrics: int = 200_000  # points held until the run is open (~35 MB)
    flush_timeout_s: float = 120.0  # close() waits at most this long (a model upload included)
    start_timeout_s: float = 10.0  # create() waits at most this long for the run id
    max_carried_metrics: int = 20_000  # unsent points a checkpoint carries at most (the newest; ~1.5 MB of JSON)


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


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, None for any other store."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri == "sqlite:///:memory:":
        return None
    return Path(tracking_uri[len("sqlite:///"):])


def ensure_sqlite_schema(tracking_uri: str) -> None:
    """Create a `sqlite:///` store's database whole or not at all. MLflow creates its tables in place, one migration
    after another, so a process killed meanwhile (a node lost in the first seconds of a run) would leave a database
    that every later client fails to open ("table ... already exists"). Here the tables are made in a file of its
    own beside it, which a hard link then puts in place only if no database is there yet."""
    path = sqlite_path(tracking_uri)
    if path is None or path.exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        store = SqlAlchemyStore(f"sqlite:///{draft}", default_artifact_root=str(path.parent / "mlartifacts"))
        store.engine.dispose()
        with contextlib.suppress(FileExistsError):  # another run made it first: that one is whole too
            os.link(draft, path)
    finally:
        draft.unlink(missing_ok=True)


_KNOWN_SCHEMES = {"http", "https", "sqlite", "postgresql", "mysql", "mssql", "file", "databricks"}


def resolve_tracking_uri(configured: str, run_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """`tracking.uri`, else env MLFLOW_TRACKING_URI, else the embedded SQLite store for run_dir."""
    env = os.environ if env is None else env
    uri = configured.strip() or env.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return local_store(run_dir).tracking_uri
    source = "tracking.uri" if configured.strip() else "MLFLOW_TRACKING_URI"
    if urlparse(uri).scheme.split("+")[0] not in _KNOWN_SCHEMES:  # postgresql+psycopg2:// is a SQLAlchemy dialect
        raise ValueError(f"{source} {uri!r} is not a tracking URI MLflow understands: expected one of "
                         f"{', '.join(sorted(s + '://' for s in _KNOWN_SCHEMES))}")
    return uri


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys: {"train": {"lr": 3e-4}} -> {"train.lr": 3e-4}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}.") if isinstance(value, Mapping) else {f"{prefix}{key}": value})
    return flat


def clip(value: str, limit: int) -> str:
    """A string MLflow accepts: over `limit` characters it is cut and ends with a visible marker."""
    return value if len(value) <= limit else value[: limit - len(_TRUNCATED)] + _TRUNCATED


def ui_hint(tracking_uri: str, *, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """Human text: where the run is stored and how to look at it."""
    url = urlparse(tracking_uri)
    page = f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id and run_id else ""
    run = f"MLflow run {run_id}" if run_id else "MLflow runs"
    if url.scheme in ("http", "https"):
        text = f"{run}: {tracking_uri.rstrip('/')}/{page}"
        if (url.hostname or "").endswith(".svc.cluster.local"):
            # The in-cluster service has no ingress on purpose; a port-forward is the way in from a laptop.
            service, namespace = url.hostname.split(".")[:2]
            text += (f"\nFrom outside the cluster: kubectl -n {namespace} port-forward svc/{service} "
                     f"5000:{url.port or 80}  then open http://127.0.0.1:5000/{page}")
        return text
    if url.scheme == "sqlite":
        db = tracking_uri[len("sqlite:///"):]
        return (f"{run} stored in {db} (artifacts in {Path(db).parent / 'mlartifacts'}).\nOpen the UI: mlflow ui "
                f"--backend-store-uri {tracking_uri} --port 5000  then http://127.0.0.1:5000/{page}")
    return f"{run} stored at {tracking_uri} (open it with: mlflow ui --backend-store-uri {tracking_uri})"


def git_commit(cwd: Path | None = None) -> str | None:
    """The commit of the source tree the trainer runs from, or None outside a git checkout (the image)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) == 40 else None


def _is_transient(exc: BaseException) -> bool:
    """True when the server was unreachable or overloaded; False for a request it rejected."""
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, RestException):
        return exc.get_http_status_code() >= 500 or exc.get_http_status_code() in (408, 429)
    if isinstance(exc, MlflowException):  # connection errors arrive as INTERNAL_ERROR (mlflow/utils/rest_utils.py)
        return exc.error_code in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")
    return isinstance(exc, ConnectionError | TimeoutError)


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class _OutageFilter(logging.Filter):
    """Swallows MLflow's per-retry and per-lost-batch lines about this tracker's server and run; the tracker says
    it once instead (module docstring). Lines about other servers or runs pass on."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker
        url = urlparse(tracker.tracking_uri)
        self.server = f"host='{url.hostname}', port={url.port or (443 if url.scheme == 'https' else 80)}"

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.name != "urllib3.connectionpool":  # the async queue's "Run Id <id>: Failed to log run data"
            return not (self.tracker._run_id and text.startswith(f"Run Id {self.tracker._run_id}:"))
        if not (text.startswith("Retrying") and self.server in text):
            return True
        # urllib3 logs a retry after its backoff sleep, so only a request's first retry (no sleep before it)
        # says the server is down now; later ones may describe a failure from before it came back.
        if len(getattr(record.args[0], "history", ())) <= 1:
            self.tracker._mark_down(text.split("broken by ", 1)[-1])
        return False


class Tracker:
    """Non-blocking MLflow logging for one training run (module docstring); build it with `create`."""

    def __init__(self, *, tracking_uri: str = "", resume_run_id: str | None = None,
                 options: TrackerOptions | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.options = options or TrackerOptions()
        self.enabled = bool(tracking_uri)
        self.experiment_id: str | None = None
        self.dropped_metrics = 0  # points not recorded: dropped while the run was not open, or lost by MLflow
        self._resume_run_id, self._run_id = resume_run_id, None
        self._client: Any = None
        self._lock = threading.Lock()
        self._held: collections.deque[Any] = collections.deque(maxlen=self.options.max_pending_metrics)
        self._unsettled: dict[int, tuple[Any, list[Any]]] = {}  # batch number -> (MLflow's future, its points)
        self._batches = itertools.count()
        self._lost: collections.deque[Any] = collections.deque(maxlen=self.options.max_pending_metrics)
        self._carry_warned = False
        self._logged: dict[str, int] = {}  # metric key -> the newest step logged by this process
        self._stored: dict[str, set[int]] = {}  # metric key -> the steps a resumed run already has
        self._stored_params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._latest_checkpoint: str | None = None
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], None]] | None] = queue.SimpleQueue()
        self._answered = threading.Event()  # the run is open, or the server is known to be unreachable
        self._down_since: float | None = None
        self._deadline: float | None = None  # set by close(): the thread stops trying to open the run then
        self._warned_at = 0  # dropped_metrics when it was last reported
        self._closed = False
        self._staging: Path | None = None
        self._thread: threading.Thread | None = None
        self._filter = _OutageFilter(self)
        self._levels: dict[str, int] = {}  # logger -> its own level, while the tracker raised it to WARNING

    @classmethod
    def start(cls, *, experiment: str, run_name: str, tracking_uri: str = "", run_dir: Path | str | None = None,
              resume_run_id: str | None = None, enabled: bool = True, options: TrackerOptions | None = None,
              parent_run_id: str = "", run_key: str = "", carried: Sequence[Sequence[Any]] = ()) -> Tracker:
        """A working tracker (or, with `enabled` False, e.g. on every rank but 0, one that ignores calls) logging to
        run `run_name` of `experiment`; `resume_run_id` reopens a run a checkpoint recorded, `parent_run_id` nests a
        new run under another; `run_key`, when no `resume_run_id` is known, reopens the run tagged with it.
        `carried` is a checkpoint's `unsent(...)`: sent first, but for the steps the run already holds.
        `tracking_uri` "" is env MLFLOW_TRACKING_URI, else the embedded SQLite store beside `run_dir` (default
        runs/<run_name>). ValueError names the problem when the URI cannot be a tracking URI; later trouble at the
        server is logged, not raised."""
        if not enabled:
            return cls(resume_run_id=resume_run_id)
        if not experiment.strip():
            raise ValueError("the MLflow experiment name must not be empty")
        run_dir = Path(run_dir) if run_dir is not None else Path("runs") / run_name
        tracker = cls(tracking_uri=resolve_tracking_uri(tracking_uri, run_dir), resume_run_id=resume_run_id,
                      options=options)
        # A SQLite store keeps a new experiment's artifacts beside its database (MLflow's default would be
        # ./mlruns in whatever directory the trainer was started from); ui_hint says so.
        db = sqlite_path(tracker.tracking_uri)
        artifacts = db.parent / "mlartifacts" if db else None
        if db:
            db.parent.mkdir(parents=True, exist_ok=True)
        tags = {TAG_IMAGE_DIGEST: os.environ.get(job_env.IMAGE_DIGEST, "").strip(), TAG_GIT_COMMIT: git_commit() or "",
                TAG_PARENT_RUN: parent_run_id.strip(), TAG_RUN_KEY: run_key.strip()}
        tracker._tags = {k: v for k, v in tags.items() if v}
        tracker._carry(carried)
        tracker._thread = threading.Thread(target=tracker._work, args=(experiment, run_name, artifacts),
                                           name="mlflow-tracker", daemon=True)
        tracker._thread.start()
        tracker._answered.wait(tracker.options.start_timeout_s)
        return tracker

    @classmethod
    def create(cls, cfg: TrackingSettings, *, run_dir: Path, resume_run_id: str | None = None, run_key: str = "",
               enabled: bool = True, options: TrackerOptions | None = None,
               carried: Sequence[Sequence[Any]] = ()) -> Tracker:
        """The bundled trainer's tracker from its `tracking` settings: `start` with tracking.uri and
        tracking.experiment, the run named after the run directory."""
        if not cfg.experiment.strip():
            raise ValueError("tracking.experiment must not be empty")
        return cls.start(experiment=cfg.experiment, run_name=Path(run_dir).resolve().name, tracking_uri=cfg.uri,
                         run_dir=run_dir, resume_run_id=resume_run_id, enabled=enabled and cfg.enabled,
                         options=options, parent_run_id=cfg.parent_run_id, run_key=run_key, carried=carried)

    def unsent(self, up_to_step: int, latest: Mapping[str, float] | None = None) -> list[list[Any]]:
        """The points of steps up to `up_to_step` not yet known to be stored, as [key, value, timestamp_ms, step]
        (JSON for a checkpoint; module docstring), the newest options.max_carried_metrics of them. `latest`: values
        of step `up_to_step` itself whose record is logged only after its checkpoint (the trainer's loss, lr and
        tokens), for the keys no point of that step has yet."""
        if not self.enabled:
            return []
        with self._lock:
            points = [*self._lost, *itertools.chain.from_iterable(p for _, p in self._unsettled.values()), *self._held]
        out = [[m.key, m.value, m.timestamp, m.step] for m in points if m.step <= up_to_step]
        have, now_ms = {(k, step) for k, _, _, step in out}, int(time.time() * 1000)
        out += [[k, float(v), now_ms, up_to_step] for k, v in (latest or {}).items()
                if (k, up_to_step) not in have and self._logged.get(k, -1) < up_to_step]
        limit = self.options.max_carried_metrics
        if len(out) > limit and not self._carry_warned:
            self._carry_warned = True
            _LOG.warning("MLflow tracking: %d metric points are not sent yet; a checkpoint carries the newest %d "
                         "(a relaunch sends those), the older are dropped if this process is lost", len(out), limit)
        return out[-limit:] if len(out) > limit else out

    def _carry(self, carried: Sequence[Sequence[Any]]) -> None:
        """A checkpoint's unsent points, held to go first when the run opens."""
        from mlflow.entities import Metric

        try:
            points = [Metric(str(k), float(v), int(ts), int(step)) for k, v, ts, step in carried]
        except (TypeError, ValueError) as exc:
            _LOG.warning("MLflow tracking: the checkpoint's unsent metric points are unreadable (%s); not sent", exc)
            return
        self._held.extend(points)
        if points:
            _LOG.info("MLflow tracking: %d metric points the last process had not sent are sent now (steps %d-%d)",
                      len(points), min(p.step for p in points), max(p.step for p in points))

    @property
    def run_id(self) -> str | None:
        """The MLflow run id to save in checkpoints (the resumed id until the run is open)."""
        return self._run_id or self._resume_run_id

    # ---- the calls of the training loop: none of them waits for the server ----------------------------------
    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        """One point per key at `step`; None values are skipped."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        points = [Metric(k, float(v), now_ms, int(step)) for k, v in metrics.items() if v is not None]
        with self._lock:
            self._logged.update((m.key, max(m.step, self._logged.get(m.key, -1))) for m in points)
            if self._run_id is None:  # held until the run is open; the oldest go first when the buffer is full
                self._count_dropped(max(0, len(self._held) + len(points) - self.options.max_pending_metrics),
                                    "the run is not open yet (server unreachable)")
                self._held.extend(points)
            else:
                self._send_metrics(points)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Config values as params (nested mappings are flattened to dotted keys, long values cut)."""
        if not self.enabled:
            return
        text = {k: json.dumps(v, default=str) if isinstance(v, list | tuple | dict) else str(v)
                for k, v in flatten(params).items() if len(k) <= MAX_KEY}
        clean = {k: clip(v, MAX_PARAM_VALUE) for k, v in text.items()}
        self._submit("params", self._write_params, clean)
        if clean != text:  # the whole values still reach the run, as an artifact next to the cut params
            full = json.dumps({k: v for k, v in text.items() if clean[k] != v}, indent=1)
            self._submit("params_full_values.json", self._client_call("log_text", full, "params_full_values.json"))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        clean = {k: clip(str(v), MAX_TAG_VALUE) for k, v in tags.items() if len(k) <= MAX_KEY}
        self._tags.update(clean)
        self._submit("tags", self._write_tags, clean)

    def log_dataset(self, uri: str, manifest_sha256: str) -> None:
        """Tag the run with the dataset it reads: its URI and its manifest's sha256 (the registry copies both)."""
        self.set_tags({TAG_DATASET_URI: uri, TAG_DATASET_MANIFEST: manifest_sha256})

    def log_checkpoint(self, step: int, uri: str) -> None:
        """Record a saved checkpoint: a small artifact per checkpoint plus the latest-checkpoint tags."""
        self._latest_checkpoint = uri
        record = json.dumps({"step": step, "uri": uri, "logged_at_unix": time.time()}, indent=1) + "\n"
        self._submit(f"checkpoint {step}", lambda: (
            self._client.log_text(self._run_id, record, f"checkpoints/step_{step:08d}.json"),
            self._write_tags({TAG_CHECKPOINT_URI: uri, TAG_CHECKPOINT_STEP: str(step)})))

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Upload a file or directory; small files are copied now, so later rewrites do not race the upload."""
        path = Path(path)
        if not self.enabled or not path.exists():
            if self.enabled:
                _LOG.warning("MLflow artifact %s does not exist; not logged", path)
            return
        if path.is_file() and path.stat().st_size <= _SNAPSHOT_MAX_BYTES:
            self._staging = self._staging or Path(tempfile.mkdtemp(prefix="mlflow-staging-"))
            path = Path(shutil.copy2(path, Path(tempfile.mkdtemp(dir=self._staging)) / path.name))
        upload = self._client_call("log_artifacts" if path.is_dir() else "log_artifact", str(path), artifact_path)
        self._submit(f"artifact {path.name}", upload)

    def register_model(self, model_dir: Path | str, name: str, tags: Mapping[str, Any]) -> None:
        """Upload model_dir as the run's `model` artifact and create a version of registered model `name`, tagged
        with the given lineage plus the image digest, git commit and latest checkpoint this tracker knows."""
        if not self.enabled:
            return
        if not (Path(model_dir).is_dir() and name.strip()):
            _LOG.warning("model %r not registered: no directory %s or an empty name", name, model_dir)
            return
        lineage = {k: v for k, v in self._tags.items() if k in (TAG_IMAGE_DIGEST, TAG_GIT_COMMIT)}
        lineage.update({TAG_CHECKPOINT_URI: self._latest_checkpoint} if self._latest_checkpoint else {})
        lineage.update({k: clip(str(v), 100_000) for k, v in tags.items() if len(k) <= MAX_KEY})
        self._submit(f"model {name}", partial(self._register, Path(model_dir), name, lineage))

    def flush(self, timeout_s: float) -> bool:
        """Wait at most timeout_s until everything logged so far is sent; True when it was."""
        if not self.enabled:
            return True
        done = threading.Event()
        self._submit("flush", self._settle_all_then, done.set)
        return done.wait(timeout_s) and self._run_id is not None

    def _settle_all_then(self, then: Callable[[], Any]) -> None:
        """Learn the outcome of every batch handed to MLflow so far, then `then()`: the held points the run's
        opening sent may queue their settling after a flush asked for before it opened."""
        with self._lock:
            batches = list(self._unsettled)
        for batch in batches:
            self._settle(batch)
        then()

    def close(self, *, status: str = "FINISHED", timeout_s: float | None = None) -> None:
        """Mark the run `status`, wait at most timeout_s (default options.flush_timeout_s) for what is queued,
        then give up with a warning. Never raises; calling it twice is harmless."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        timeout = self.options.flush_timeout_s if timeout_s is None else timeout_s
        try:
            self._deadline = time.monotonic() + timeout
            self._jobs.put(("the final status", lambda: self._client.set_terminated(self._run_id, status=status)))
            self._jobs.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._detach()
                _LOG.warning("MLflow tracking: gave up after %.1f s with %d updates not sent to %s", timeout,
                             self._jobs.qsize() + len(self._held), self.tracking_uri)
            if self.dropped_metrics:
                _LOG.warning("MLflow tracking dropped %d metric points in total", self.dropped_metrics)
        except Exception as exc:  # close() is called from finally blocks
            _LOG.warning("MLflow tracking close failed: %s", exc)
        finally:
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)

    def ui_hint(self) -> str:
        """Where this run is and how to open it (printed at the end of a run); "" when disabled."""
        return ui_hint(self.tracking_uri, experiment_id=self.experiment_id, run_id=self.run_id) if self.enabled else ""

    # ---- the tracker's thread ------------------------------------------------------------------------------
    def _submit(self, what: str, job: Callable[[], Any], *args: Any) -> None:
        if self.enabled and not self._closed:
            self._jobs.put((what, partial(job, *args)))

    def _client_call(self, method: str, *args: Any) -> Callable[[], Any]:
        return lambda: getattr(self._client, method)(self._run_id, *args)

    def _work(self, experiment: str, run_name: str, artifacts: Path | None) -> None:
        for logger in map(logging.getLogger, _RETRY_LOGGERS):
            logger.addFilter(self._filter)
            # The outage is seen through these loggers' warnings: one quieted elsewhere in the process (a client
            # that sets urllib3 to ERROR) would hide it. The filter keeps them off the console either way.
            if logger.getEffectiveLevel() > logging.WARNING:
                self._levels[logger.name] = logger.level
                logger.setLevel(logging.WARNING)
        try:
            if self._open(experiment, run_name, artifacts):
                while (job := self._jobs.get()) is not None:
                    self._run(*job)
        finally:
            self._detach()

    def _detach(self) -> None:
        """Stop filtering MLflow's lines: when the thread ends, or when close() gave up waiting for it."""
        for logger in map(logging.getLogger, _RETRY_LOGGERS):
            logger.removeFilter(self._filter)
            if logger.name in self._levels:
                logger.setLevel(self._levels.pop(logger.name))

    def _run(self, what: str, job: Callable[[], Any]) -> None:
        try:
            job()
        except Exception as exc:  # after MLflow's own retries: reported, never raised into training
            if _is_transient(exc):
                self._mark_down(exc)
            _LOG.warning("MLflow tracking: %s not recorded: %s", what, _first_line(exc))
        else:
            self._mark_up()

    def _open(self, experiment: str, run_name: str, artifacts: Path | None) -> bool:
        """Open (or reopen) the run, trying again after MLflow's retries ran out, until close()'s deadline."""
        while self._deadline is None or time.monotonic() < self._deadline:
            try:
                from mlflow import MlflowClient

                # Here, not in create(): with mlflow-skinny (the image) a sqlite:// store fails on the missing
                # SQLAlchemy, which must turn tracking off, not stop training.
                ensure_sqlite_schema(self.tracking_uri)
                self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
                run = self._resumed_run(experiment) or self._new_run(experiment, run_name, artifacts)
            except Exception as exc:
                if not _is_transient(exc):
                    _LOG.warning("MLflow tracking disabled: no run at %s: %s", self.tracking_uri, _first_line(exc))
                    self.enabled = False
                    self._answered.set()
                    return False
                self._mark_down(exc)
                time.sleep(1.0)
                continue
            with self._lock:
                self._run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
                self._send_metrics(list(self._held))
                self._held.clear()
            self._mark_up()
            self._answered.set()
            return True
        return False

    def _resumed_run(self, experiment: str) -> Any:
        """The run of `resume_run_id` (else the run tagged with this job's run key), set RUNNING again, with what it
        already holds; None if there is none."""
        from mlflow.exceptions import MlflowException

        run = self._keyed_run(experiment) if not self._resume_run_id else None
        if run is None and not self._resume_run_id:
            return None
        try:
            run = run or self._client.get_run(self._resume_run_id)
        except MlflowException as exc:
            if _is_transient(exc):
                raise
            _LOG.warning("MLflow run %s from the checkpoint is not in %s (%s); starting a new run",
                         self._resume_run_id, self.tracking_uri, _first_line(exc))
            return None
        run_id = run.info.run_id
        for key in run.data.metrics:
            self._stored[key] = {m.step for m in self._client.get_metric_history(run_id, key)}
        self._stored_params = dict(run.data.params)
        resumes = int(run.data.tags.get(TAG_RESUMES, "0")) + 1
        self._client.log_batch(run_id, tags=self._entities({**self._tags, TAG_RESUMES: str(resumes)}))
        if run.info.status != "RUNNING":
            self._client.update_run(run_id, status="RUNNING")
        _LOG.info("MLflow run %s resumed (resume #%d); metric steps already stored are skipped (last: %s)",
                  run_id, resumes, max((max(s) for s in self._stored.values() if s), default="none"))
        return run

    def _keyed_run(self, experiment: str) -> Any:
        """The run tagged with this job's run key, when a checkpoint carried the key but not the run id."""
        key = self._tags.get(TAG_RUN_KEY, "")
        found = self._client.get_experiment_by_name(experiment) if key else None
        if found is None:
            return None
        runs = self._client.search_runs([found.experiment_id], filter_string=f"tags.`{TAG_RUN_KEY}` = '{key}'",
                                        max_results=1)
        if runs:
            _LOG.info("MLflow run %s found by the checkpoint's run key (saved before the run id was known)",
                      runs[0].info.run_id)
        return runs[0] if runs else None

    def _new_run(self, experiment: str, run_name: str, artifacts: Path | None) -> Any:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(experiment)
        if found is None:
            try:
                location = (artifacts / experiment).as_uri() if artifacts else None
                found = self._client.get_experiment(self._client.create_experiment(experiment, location))
            except MlflowException as exc:
                if _is_transient(exc):
                    raise
                found = self._client.get_experiment_by_name(experiment)  # created meanwhile by another job
        return self._client.create_run(found.experiment_id, run_name=run_name, tags=self._tags)

    def _send_metrics(self, points: list[Any]) -> None:
        """Hand points to MLflow's asynchronous queue (caller holds the lock); the thread learns the outcome."""
        points = [m for m in points if m.step not in self._stored.get(m.key, ())]
        if points:
            sent = self._client.log_batch(self._run_id, metrics=points, synchronous=False)
            self._unsettled[batch := next(self._batches)] = (sent, points)
            self._jobs.put((f"{len(points)} metric points", partial(self._settle, batch)))

    def _settle(self, batch: int) -> None:
        """Wait for one batch's outcome (on the tracker's thread only); a batch a flush settled first is done."""
        from mlflow.exceptions import MlflowException

        with self._lock:
            if batch not in self._unsettled:
                return
            sent, points = self._unsettled[batch]
        try:
            sent.wait()
        except MlflowException as exc:
            with self._lock:
                del self._unsettled[batch]
                self._lost.extend(points)  # a checkpoint still carries them (unsent)
                self._count_dropped(len(points), f"MLflow gave up sending them: {_first_line(exc)}")
        else:
            with self._lock:
                del self._unsettled[batch]

    def _count_dropped(self, count: int, why: str) -> None:
        """Counted, not warned per call: the first drop, then each time the total has doubled."""
        self.dropped_metrics += count
        if count and self.dropped_metrics >= 2 * self._warned_at:
            self._warned_at = self.dropped_metrics
            _LOG.warning("MLflow tracking: %d metric points dropped so far (%s)", self.dropped_metrics, why)

    def _write_params(self, params: dict[str, str]) -> None:
        """Params not yet in the run; a resumed run keeps its first values, with one warning naming the rest."""
        from mlflow.entities import Param

        fresh = {k: v for k, v in params.items() if k not in self._stored_params}
        changed = sorted(k for k, v in params.items() if self._stored_params.get(k, v) != v)
        if changed:
            _LOG.warning("MLflow run %s already has other values for %s; params are immutable, keeping the first "
                         "(the resolved config of each restart is in its checkpoint)", self._run_id, ", ".join(changed))
        self._client.log_batch(self._run_id, params=[Param(k, v) for k, v in fresh.items()])
        self._stored_params.update(fresh)

    def _write_tags(self, tags: Mapping[str, str]) -> None:
        self._client.log_batch(self._run_id, tags=self._entities(tags))

    @staticmethod
    def _entities(tags: Mapping[str, str]) -> list[Any]:
        from mlflow.entities import RunTag

        return [RunTag(k, v) for k, v in tags.items()]

    def _register(self, model_dir: Path, name: str, tags: dict[str, str]) -> None:
        from mlflow.exceptions import MlflowException

        self._client.log_artifacts(self._run_id, str(model_dir), "model")
        try:
            self._client.create_registered_model(name, tags={"trainer.source": "gpu-train"})
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = self._client.create_model_version(name, source=f"runs:/{self._run_id}/model",
                                                    run_id=self._run_id, tags=tags)
        _LOG.info("Registered model %s version %s from run %s", name, version.version, self._run_id)

    def _mark_down(self, reason: BaseException | str) -> None:
        with self._lock:
            first, self._down_since = self._down_since is None, self._down_since or time.monotonic()
        self._answered.set()  # create() stops waiting: training starts, the run id comes later
        if first:
            _LOG.warning("MLflow tracking server %s is unreachable (%s); training continues, MLflow retries in the "
                         "background", self.tracking_uri, _first_line(reason))

    def _mark_up(self) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            _LOG.info("MLflow tracking server %s is reachable again after %.0f s", self.tracking_uri,
                      time.monotonic() - since)
