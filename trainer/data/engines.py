"""Runners for `prepare`'s tasks: local processes, Ray, Spark. Each only schedules ``trainer.data.tasks.attempt``
calls and reports their outcomes; the task function, its bytes and the retries are the driver's
(``run_tasks``), so the dataset never depends on which runner made it or with how many workers.

Use::

    engine = LocalEngine(workers=8)                       # --engine local (default): a process pool
    engine = RayEngine(workers=8, address=None)           # --engine ray: a Ray started here, or --address ray://...
    engine = SparkEngine(master="local[8]")               # --engine spark --master spark://host:7077 (or yarn, k8s://)
    for outcome in engine.run(plan_json, [0, 1, 5], out_uri, endpoint_url): ...

An outcome is ``attempt``'s dict: ``{"index", "ok", "commit" | "error", "retryable"}``. A worker that dies
(SIGKILL, out of memory) is reported as a retryable failure of the tasks it held.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from trainer.data.errors import DataError
from trainer.data.tasks import attempt

ENGINES = ("local", "ray", "spark")
Outcome = dict[str, Any]


def _died(index: int, why: str) -> Outcome:
    return {"index": index, "ok": False, "error": f"the worker running it died ({why})", "retryable": True}


def _adopt_env(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


class LocalEngine:
    """Worker processes on this machine (a fork server, so each starts from a clean, already-imported parent).
    One worker runs the tasks in this process."""

    name = "local"

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)

    def run(self, plan_json: bytes, indices: Sequence[int], out_uri: str, endpoint_url: str | None) -> Iterator[Outcome]:
        if self.workers == 1 or len(indices) == 1:
            for i in indices:
                yield attempt(plan_json, i, out_uri, endpoint_url)
            return
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["trainer.data.tasks"])
        # The fork server keeps the environment of its start; each worker takes the driver's as it is now
        # (credentials, endpoints).
        pool = ProcessPoolExecutor(min(self.workers, len(indices)), mp_context=ctx, initializer=_adopt_env,
                                   initargs=(dict(os.environ),))
        try:
            pending = {pool.submit(attempt, plan_json, i, out_uri, endpoint_url): i for i in indices}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        yield fut.result()
                    except BrokenProcessPool as exc:
                        yield _died(i, str(exc) or "process pool broken")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class RayEngine:
    """Ray tasks: on a Ray started in this process (``num_cpus=workers``), on the one already initialised, or on an
    existing cluster at ``address`` (its workers need this package installed: the cluster's image, or a
    ``runtime_env``). At most ``workers`` tasks are in flight, so a shared cluster is not flooded."""

    name = "ray"

    def __init__(self, workers: int, address: str | None = None) -> None:
        self.workers = max(1, workers)
        self.address = address

    def run(self, plan_json: bytes, indices: Sequence[int], out_uri: str, endpoint_url: str | None) -> Iterator[Outcome]:
        import ray

        started = False
        if not ray.is_initialized():
            env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "TRAINER_", "PYTHONPATH", "GOOGLE_"))}
            if self.address:
                ray.init(address=self.address, runtime_env={"env_vars": env}, log_to_driver=False)
            else:
                ray.init(num_cpus=self.workers, include_dashboard=False, runtime_env={"env_vars": env},
                         log_to_driver=False)  # fmt: skip
            started = True
        try:
            remote = ray.remote(num_cpus=1, max_retries=0)(attempt)
            plan_ref = ray.put(plan_json)
            todo = list(indices)
            running: dict[Any, int] = {}
            while todo or running:
                while todo and len(running) < self.workers:
                    i = todo.pop(0)
                    running[remote.remote(plan_ref, i, out_uri, endpoint_url)] = i
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    i = running.pop(ref)
                    try:
                        yield ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        yield _died(i, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            if started:
                ray.shutdown()


class SparkEngine:
    """A Spark job with one partition per task on ``master`` (``local[N]``, ``spark://host:7077``, ``yarn``,
    ``k8s://...``), or on the SparkSession already active in this process (a notebook, ``spark-submit``). Spark's
    own task retries are off (``spark.task.maxFailures=1``): the driver's bounded attempts are the one retry.
    Outcomes arrive when the job ends."""

    name = "spark"

    def __init__(self, master: str | None = None) -> None:
        self.master = master

    def run(self, plan_json: bytes, indices: Sequence[int], out_uri: str, endpoint_url: str | None) -> Iterator[Outcome]:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        started = spark is None
        if spark is None:
            if not self.master:
                raise DataError("--engine spark needs --master (local[N], spark://host:7077, yarn, k8s://...)")
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers run this interpreter
            spark = (SparkSession.builder.master(self.master).appName("gpu-train prepare")
                     .config("spark.task.maxFailures", "1").config("spark.pyspark.python", sys.executable)
                     .config("spark.ui.enabled", "false").getOrCreate())  # fmt: skip
        try:
            sc = spark.sparkContext
            plan = sc.broadcast(plan_json)
            rdd = sc.parallelize(list(indices), numSlices=max(1, len(indices)))
            try:
                results = rdd.map(lambda i: attempt(plan.value, i, out_uri, endpoint_url)).collect()
            except Exception as exc:  # noqa: BLE001 (py4j's error: a worker died; every task of the job is redone)
                lines = [line.strip() for line in str(exc).splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
                results = [_died(i, (lines[-1] if lines else type(exc).__name__)[:300]) for i in indices]
            yield from results
        finally:
            if started:
                spark.stop()


def make_engine(name: str, workers: int, *, address: str | None = None, master: str | None = None) -> Any:
    """The runner a command line asks for; a bad combination is one line naming the flag."""
    if name == "local":
        if address or master:
            raise DataError("--address is for --engine ray and --master for --engine spark")
        return LocalEngine(workers)
    if name == "ray":
        if master:
            raise DataError("--master is for --engine spark; Ray takes --address")
        return RayEngine(workers, address)
    if name == "spark":
        if address:
            raise DataError("--address is for --engine ray; Spark takes --master")
        return SparkEngine(master or f"local[{workers}]")
    raise DataError(f"--engine must be one of {', '.join(ENGINES)} (got {name!r})")
