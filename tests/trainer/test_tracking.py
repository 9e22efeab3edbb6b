"""Tracker helpers and behaviour that need no server: `.venv/bin/pytest tests/trainer/test_tracking.py -q`.

The embedded SQLite store is exercised for real; the unreachable-server cases point the tracker at a port
nothing listens on.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpu_train.spec.trainer_config import TrackingConfig
from trainer.distributed import free_port
from trainer.tracking import (
    MAX_PARAM_VALUE,
    TAG_CHECKPOINT_URI,
    TAG_IMAGE_DIGEST,
    TAG_RUN_KEY,
    Tracker,
    TrackerOptions,
    clip,
    flatten,
    local_store,
    resolve_tracking_uri,
    ui_hint,
)

FAST = TrackerOptions(start_timeout_s=5, flush_timeout_s=30)


def test_uri_precedence_config_then_env_then_local_store(tmp_path):
    run_dir = tmp_path / "runs" / "exp1"
    env = {"MLFLOW_TRACKING_URI": "http://mlflow.mlflow.svc.cluster.local:5000"}
    assert resolve_tracking_uri("https://mlflow.example.org", run_dir, env) == "https://mlflow.example.org"
    assert resolve_tracking_uri("", run_dir, env) == env["MLFLOW_TRACKING_URI"]
    local = resolve_tracking_uri("", run_dir, {})
    assert local == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert local_store(run_dir).artifacts_dir == tmp_path / "runs" / "mlartifacts"


def test_bad_uri_names_its_source(tmp_path):
    with pytest.raises(ValueError, match=r"tracking\.uri 'mlflow\.db'"):
        resolve_tracking_uri("mlflow.db", tmp_path / "r", {})
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI 'ftp://x'"):
        resolve_tracking_uri("", tmp_path / "r", {"MLFLOW_TRACKING_URI": "ftp://x"})
    assert resolve_tracking_uri("postgresql+psycopg2://u@db/mlflow", tmp_path, {}).startswith("postgresql")


def test_flatten_and_clip():
    assert flatten({"train": {"lr": 3e-4, "opt": {"beta": 0.9}}, "seed": 1}) == {
        "train.lr": 3e-4, "train.opt.beta": 0.9, "seed": 1,
    }
    long = "x" * (MAX_PARAM_VALUE + 50)
    clipped = clip(long, MAX_PARAM_VALUE)
    assert len(clipped) == MAX_PARAM_VALUE and clipped.endswith("[truncated]")
    assert clip("short", MAX_PARAM_VALUE) == "short"


def test_ui_hint_tells_how_to_open_each_kind_of_store():
    local = ui_hint("sqlite:////data/runs/mlflow.db", experiment_id="1", run_id="abc")
    assert "mlflow ui --backend-store-uri sqlite:////data/runs/mlflow.db" in local
    assert "/data/runs/mlartifacts" in local and "#/experiments/1/runs/abc" in local
    cluster = ui_hint("http://mlflow.mlflow.svc.cluster.local:5000", experiment_id="2", run_id="r")
    assert "kubectl -n mlflow port-forward svc/mlflow 5000:5000" in cluster
    assert "http://mlflow.mlflow.svc.cluster.local:5000/#/experiments/2/runs/r" in cluster
    assert "port-forward" not in ui_hint("https://mlflow.example.org", run_id="r")


def test_disabled_tracker_ignores_calls_and_keeps_the_resumed_id(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    for tracker in (
        Tracker.create(TrackingConfig(), run_dir=run_dir, resume_run_id="abc", enabled=False),
        Tracker.create(TrackingConfig(enabled=False), run_dir=run_dir, resume_run_id="abc"),
    ):
        tracker.log_params({"a": 1})
        tracker.log_metrics({"loss": 1.0}, step=0)
        tracker.log_checkpoint(0, "file:///x")
        tracker.close()
        assert tracker.run_id == "abc" and not tracker.enabled and tracker.ui_hint() == ""
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # creates a real MLflow SQLite store (its migrations: 1.5 to 4 s)
def test_embedded_store_records_a_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRAINER_IMAGE_DIGEST", "sha256:" + "ab" * 32)
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    tracker = Tracker.create(TrackingConfig(experiment="unit"), run_dir=run_dir, options=FAST)
    tracker.log_params({"model": {"n_layer": 2}, "data.uri": "synthetic", "note": "y" * 7000})
    for step in range(5):
        tracker.log_metrics({"loss": 5.0 - step, "mfu": None}, step=step)
    (run_dir / "summary.json").write_text('{"step": 5}')
    tracker.log_artifact(run_dir / "summary.json")
    (run_dir / "summary.json").write_text('{"step": "rewritten after queueing"}')
    tracker.log_checkpoint(4, "file:///ckpt/step_4")
    tracker.close()

    store = local_store(run_dir)
    assert store.db_path.is_file()
    client = MlflowClient(store.tracking_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert run.data.params["model.n_layer"] == "2" and len(run.data.params["note"]) == MAX_PARAM_VALUE
    assert run.data.tags[TAG_IMAGE_DIGEST] == "sha256:" + "ab" * 32
    assert run.data.tags[TAG_CHECKPOINT_URI] == "file:///ckpt/step_4"
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [0, 1, 2, 3, 4]
    assert "mfu" not in run.data.metrics
    # Artifacts land under runs/mlartifacts; the uploaded summary is the one queued, not the rewrite.
    summary = Path(client.download_artifacts(tracker.run_id, "summary.json", str(tmp_path / "dl")))
    assert summary.read_text() == '{"step": 5}'
    assert str(store.artifacts_dir) in run.info.artifact_uri
    full = Path(client.download_artifacts(tracker.run_id, "params_full_values.json", str(tmp_path / "dl")))
    assert "y" * 7000 in full.read_text()
    assert tracker.run_id in tracker.ui_hint()


def test_unreachable_server_buffers_drops_oldest_and_warns_once(tmp_path, caplog):
    uri = f"http://127.0.0.1:{free_port()}"
    options = TrackerOptions(max_pending_metrics=10, start_timeout_s=5, flush_timeout_s=0.5)
    caplog.set_level(logging.INFO, logger="trainer.tracking")
    tracker = Tracker.create(TrackingConfig(uri=uri), run_dir=tmp_path / "r", options=options)
    assert tracker.run_id is None  # the server never answered; training goes on without an id
    for step in range(25):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert tracker.dropped_metrics == 15
    assert not tracker.flush(0.3)
    tracker.close()  # gives up after the bounded timeout, without raising
    tracker.close()  # twice is harmless
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(unreachable) == 1 and unreachable[0].levelno == logging.WARNING
    dropped = [r for r in caplog.records if "dropp" in r.getMessage()]
    assert dropped and "15" in dropped[-1].getMessage()
    assert any("gave up" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # creates a real MLflow SQLite store (its migrations: 1.5 to 4 s)
def test_unknown_resume_id_starts_a_new_run_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainer.tracking")
    uri = f"sqlite:///{tmp_path / 'other.db'}"
    tracker = Tracker.create(TrackingConfig(uri=uri), run_dir=tmp_path / "r", resume_run_id="f" * 32,
                             options=FAST)
    tracker.log_metrics({"loss": 1.0}, step=3)
    tracker.close()
    assert tracker.run_id and tracker.run_id != "f" * 32
    assert [m.step for m in MlflowClient(uri).get_metric_history(tracker.run_id, "loss")] == [3]
    assert any("f" * 32 in r.getMessage() and "new run" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # creates a real MLflow SQLite store (its migrations: 1.5 to 4 s)
def test_a_resumed_run_gets_exactly_the_steps_it_lacks(tmp_path):
    """MLflow's queue sends batches from several threads, so a killed process may leave step 7 stored and step 5
    not: the resumed tracker sends the replayed step 5 and no second copy of any stored step."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = Tracker.create(TrackingConfig(uri=uri), run_dir=tmp_path / "r", options=FAST)
    for step in (*range(5), 6, 7):
        first.log_metrics({"loss": float(step)}, step=step)
    first.close(status="KILLED")
    resumed = Tracker.create(TrackingConfig(uri=uri), run_dir=tmp_path / "r", resume_run_id=first.run_id,
                             options=FAST)
    for step in range(3, 10):  # the checkpoint was at step 3: steps 3.. are replayed, with other values
        resumed.log_metrics({"loss": 100.0 + step}, step=step)
    resumed.close()
    assert resumed.run_id == first.run_id
    history = MlflowClient(uri).get_metric_history(first.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(10))
    assert {m.step: m.value for m in history} == {**{s: float(s) for s in (0, 1, 2, 3, 4, 6, 7)},
                                                  5: 105.0, 8: 108.0, 9: 109.0}


@pytest.mark.slow  # creates a real MLflow SQLite store (its migrations: 1.5 to 4 s)
def test_a_checkpoint_saved_before_the_run_id_was_known_finds_its_run_by_the_key(tmp_path):
    """A slow store: the tracker returns before MLflow answered (start_timeout_s 0), so the first checkpoint holds
    the job's run key but no run id. The relaunch reopens the run tagged with that key, not another job's run and
    not a new one; a job with a key no run has gets a new run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrackingConfig(uri=uri, experiment="unit")
    first = Tracker.create(cfg, run_dir=tmp_path / "a", run_key="job-a", options=TrackerOptions(start_timeout_s=0))
    for step in range(4):
        first.log_metrics({"loss": float(step)}, step=step)
    first.close(status="KILLED")
    other = Tracker.create(cfg, run_dir=tmp_path / "b", run_key="job-b", options=FAST)  # the newer run
    other.close()
    resumed = Tracker.create(cfg, run_dir=tmp_path / "a", resume_run_id=None, run_key="job-a", options=FAST)
    for step in range(2, 6):  # replayed from the checkpoint at step 2
        resumed.log_metrics({"loss": 10.0 + step}, step=step)
    resumed.close()
    assert resumed.run_id == first.run_id and first.run_id != other.run_id
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(first.run_id, "loss")) == list(range(6))
    fresh = Tracker.create(cfg, run_dir=tmp_path / "c", run_key="job-c", options=FAST)
    fresh.close()
    assert fresh.run_id not in (first.run_id, other.run_id)
    assert MlflowClient(uri).get_run(first.run_id).data.tags[TAG_RUN_KEY] == "job-a"


@pytest.mark.slow  # creates a real MLflow SQLite store (its migrations: 1.5 to 4 s)
def test_points_a_lost_process_never_sent_are_carried_by_its_checkpoint_and_sent_once(tmp_path, caplog):
    """A process whose run never opened (its server unreachable) is lost after step 5 and its checkpoint at step 3:
    the checkpoint carries steps 0-3 (4 and 5 are replayed by the relaunch), and the relaunch's tracker sends
    them to its run. Carried into a run that holds some of them already, each step is stored once."""
    caplog.set_level(logging.INFO, logger="trainer.tracking")
    lost = Tracker.create(TrackingConfig(uri=f"http://127.0.0.1:{free_port()}"), run_dir=tmp_path / "r",
                          options=TrackerOptions(start_timeout_s=5, flush_timeout_s=0.2))
    for step in range(6):
        lost.log_metrics({"loss": float(step), "lr": 0.1}, step=step)
    carried = lost.unsent(3)
    lost.close(status="KILLED")
    assert sorted((k, s) for k, _, _, s in carried) == sorted((k, s) for k in ("loss", "lr") for s in range(4))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    relaunch = Tracker.create(TrackingConfig(uri=uri), run_dir=tmp_path / "r", carried=carried, options=FAST)
    for step in range(4, 7):
        relaunch.log_metrics({"loss": 10.0 + step}, step=step)
    assert relaunch.flush(30) and relaunch.unsent(6) == []  # everything stored: nothing left to carry
    relaunch.close(status="KILLED")
    history = MlflowClient(uri).get_metric_history(relaunch.run_id, "loss")
    assert {m.step: m.value for m in history} == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 14.0, 5: 15.0, 6: 16.0}
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(relaunch.run_id, "lr")) == [0, 1, 2, 3]
    assert any(r.getMessage().endswith("8 metric points the last process had not sent are sent now (steps 0-3)")
               for r in caplog.records)
    again = Tracker.create(TrackingConfig(uri=uri), run_dir=tmp_path / "r", resume_run_id=relaunch.run_id,
                           carried=[["loss", 99.0, 0, 2], ["loss", 99.0, 0, 7]], options=FAST)
    again.close()
    history = MlflowClient(uri).get_metric_history(relaunch.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(8)) and {m.step: m.value for m in history}[2] == 2.0


def test_a_checkpoint_carries_at_most_the_newest_unsent_points_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainer.tracking")
    tracker = Tracker.create(TrackingConfig(uri=f"http://127.0.0.1:{free_port()}"), run_dir=tmp_path / "r",
                             options=TrackerOptions(start_timeout_s=5, flush_timeout_s=0.2, max_carried_metrics=3))
    for step in range(6):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert [s for _, _, _, s in tracker.unsent(4)] == [2, 3, 4]
    assert [s for _, _, _, s in tracker.unsent(5)] == [3, 4, 5]
    tracker.close()
    said = [r.getMessage() for r in caplog.records if "a checkpoint carries the newest 3" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("MLflow tracking: 5 metric points are not sent yet")


def test_each_tracker_reports_its_own_outage(tmp_path, caplog):
    """Two trackers in one process, each pointed at a closed port (as a tracker whose close gave up keeps its
    thread in MLflow's retries): each one says once that its own server is unreachable."""
    caplog.set_level(logging.WARNING, logger="trainer.tracking")
    ports = {free_port()}
    while len(ports) < 2:
        ports.add(free_port())
    options = TrackerOptions(start_timeout_s=5, flush_timeout_s=0.2)
    trackers = [Tracker.create(TrackingConfig(uri=f"http://127.0.0.1:{port}"), run_dir=tmp_path / str(port),
                               options=options) for port in sorted(ports)]
    for tracker in trackers:
        tracker.close()
    lines = [r.getMessage() for r in caplog.records if "is unreachable" in r.getMessage()]
    for tracker in trackers:
        assert sum(f"server {tracker.tracking_uri} is unreachable" in m for m in lines) == 1, lines


@pytest.mark.slow  # creates a real MLflow SQLite store (its migrations: 1.5 to 4 s)
def test_an_embedded_store_is_created_whole_or_not_at_all(tmp_path, monkeypatch):
    """A process killed while MLflow creates its tables used to leave a database no client could open again ("table
    ... already exists"): the tables are made aside, so a creation cut short leaves no database, and the next one
    makes it whole."""
    from mlflow import MlflowClient
    from mlflow.store.db import utils as db_utils

    from trainer.tracking import ensure_sqlite_schema

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    real = db_utils._initialize_tables

    def cut_short(engine):  # the tables half made, then the process is gone
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE experiments (experiment_id INTEGER)")
        raise KeyboardInterrupt

    monkeypatch.setattr(db_utils, "_initialize_tables", cut_short)
    with pytest.raises(KeyboardInterrupt):
        ensure_sqlite_schema(uri)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(db_utils, "_initialize_tables", real)
    ensure_sqlite_schema(uri)
    ensure_sqlite_schema(uri)  # there already: left as it is
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("e")
    assert client.create_run(experiment).info.status == "RUNNING"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]
