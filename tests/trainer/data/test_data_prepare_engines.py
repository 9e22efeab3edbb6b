"""prepare on Ray and on Spark gives the same bytes as on local processes: the same task function, only scheduled
elsewhere. One Ray and one Spark driver per module (their start-up is most of the cost).

Run: ``.venv/bin/pytest tests/trainer/data/test_data_prepare_engines.py -q`` (needs ``.[prep]``: ray, pyspark, and
Java 17 for Spark's local[N]).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.data.prepare_corpus import SHARD_TOKENS, TASKS, tree_sha
from trainer.data.__main__ import main as cli
from trainer.data.inputs import PrepareStats
from trainer.data.prepare import prepare

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]


def _run(corpus: Path, out: Path, **kw) -> PrepareStats:
    stats = PrepareStats()
    prepare([corpus], f"file://{out}", shard_tokens=SHARD_TOKENS, tasks=TASKS, val_fraction=0.1, stats=stats, **kw)
    return stats


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_with_1_and_3_workers_gives_the_local_bytes(ray_session, corpus, reference, tmp_path):
    for workers in (1, 3):
        stats = _run(corpus, tmp_path / f"ray{workers}", engine="ray", workers=workers)
        assert tree_sha(tmp_path / f"ray{workers}") == reference, workers
        assert stats.tasks_run == TASKS


def test_spark_local_1_and_3_give_the_local_bytes(corpus, reference, tmp_path, monkeypatch, capsys):
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    for cores in (1, 3):
        spark = (SparkSession.builder.master(f"local[{cores}]").config("spark.ui.enabled", "false")
                 .config("spark.task.maxFailures", "1").getOrCreate())  # fmt: skip
        try:
            assert spark.sparkContext.defaultParallelism == cores
            _run(corpus, tmp_path / f"spark{cores}", engine="spark")  # runs on the active session
        finally:
            spark.stop()
        assert tree_sha(tmp_path / f"spark{cores}") == reference, cores
    # Without an active session the runner starts its own on --master, and stops it afterwards.
    assert cli(["prepare", str(corpus), "--out", f"file://{tmp_path}/cli", "--shard-tokens", str(SHARD_TOKENS),
                "--tasks", str(TASKS), "--val-fraction", "0.1", "--engine", "spark", "--master", "local[2]"]) == 0
    assert f"{TASKS} tasks ({TASKS} run now)" in capsys.readouterr().out
    assert tree_sha(tmp_path / "cli") == reference
    assert SparkSession.getActiveSession() is None
    assert os.environ["PYTHONPATH"] == str(ROOT)
