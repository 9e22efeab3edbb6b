"""prepare's task contract on the local runner: byte-identical output for any worker count, relaunches that run only
uncommitted tasks, refused resumes, racing attempts, bounded retries, a worker killed mid-upload, and S3 throttling.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_prepare_tasks.py -q``. The corpus (about 60 uneven inputs) is
made by tests/trainer/data/prepare_corpus.py; the S3 tests use the session's moto server behind the fault proxy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest

from gpu_train.storage import open_store
from tests.trainer.data.prepare_corpus import SHARD_TOKENS, TASKS, tree_sha
from trainer.data import DataError
from trainer.data import tasks as tasks_mod
from trainer.data.__main__ import main as cli
from trainer.data.inputs import PrepareStats
from trainer.data.plan import PLAN_KEY, commit_key, default_tasks, task_bounds
from trainer.data.prepare import Progress, prepare
from trainer.data.tasks import attempt

ROOT = Path(__file__).resolve().parents[3]


def _prepare(corpus: Path, out: str, **kw) -> tuple[object, PrepareStats]:
    stats = PrepareStats()
    kw = {"shard_tokens": SHARD_TOKENS, "tasks": TASKS, "val_fraction": 0.1, "workers": 1, **kw}
    return prepare([corpus], out, stats=stats, **kw), stats


def test_tasks_are_cut_by_input_bytes_and_the_default_count_ignores_workers():
    assert task_bounds([10, 10, 10, 10], 2) == (0, 2, 4)
    assert task_bounds([100, 1, 1], 3) == (0, 1, 1, 3)  # a unit bigger than a share: the next task is empty
    assert task_bounds([5], 4) == (0, 1, 1, 1, 1)
    assert default_tasks(0) == 1 and default_tasks(100 << 20) == 13 and default_tasks(1 << 50) == 4096
    with pytest.raises(DataError, match="--tasks must be >= 1"):
        task_bounds([1], 0)


def test_create_only_writes_on_a_file_system_and_on_gcs(tmp_path):
    """The primitive every shard and commit goes through: exclusive create on a file system; on gs:// S3's
    `If-None-Match: *` is rewritten to GCS's `x-goog-if-generation-match: 0` before signing."""
    from botocore.awsrequest import AWSRequest

    from gpu_train.storage import gcs_create_only

    store = open_store(f"file://{tmp_path}")
    assert store.put_if_absent("a/b.json", b"one") and not store.put_if_absent("a/b.json", b"two")
    (tmp_path / "src").write_bytes(b"three")
    assert store.put_if_absent("c.bin", tmp_path / "src") and not store.put_if_absent("c.bin", tmp_path / "src")
    assert (tmp_path / "a" / "b.json").read_bytes() == b"one" and (tmp_path / "c.bin").read_bytes() == b"three"
    assert not list(tmp_path.rglob("*.part"))
    create = AWSRequest(method="PUT", url="https://storage.googleapis.com/b/k", headers={"If-None-Match": "*"})
    gcs_create_only(create)
    assert "If-None-Match" not in create.headers and create.headers["x-goog-if-generation-match"] == "0"
    plain = AWSRequest(method="PUT", url="https://storage.googleapis.com/b/k", headers={})
    gcs_create_only(plain)
    assert "x-goog-if-generation-match" not in plain.headers


@pytest.mark.slow
def test_local_runs_are_byte_identical_for_1_3_and_8_workers(corpus, reference, tmp_path, capsys):
    """Same task count, 1, 3 and 8 worker processes: every shard, index, commit, the plan and the manifest equal."""
    for workers in (3, 8):
        _prepare(corpus, f"file://{tmp_path}/w{workers}", workers=workers, progress=Progress(every_s=1e9))
        assert tree_sha(tmp_path / f"w{workers}") == reference, workers
    err = capsys.readouterr().err
    manifest = json.loads((tmp_path / "w8" / "manifest.json").read_text())
    assert manifest["source"]["tasks"] == TASKS and len(reference) > 3 * TASKS
    shards = manifest["shards"] + manifest["val"]["shards"]
    assert any(s["tokens"] == SHARD_TOKENS for s in shards)  # big.txt fills whole shards
    # Each bad input has its line, the undecodable ones once per run: never dropped silently.
    for name in ("empty-0.txt", "empty-2.txt", "empty.jsonl"):
        assert err.count(f"prepare: skipped {corpus / name}: empty") == 2, name
    assert err.count(f"{corpus / 'broken.txt'}: not valid UTF-8 at byte 12 (invalid start byte): kept as raw") == 2
    assert err.count(f"{corpus / 'latin1.txt'}: not valid UTF-8 at byte 3") == 2
    assert err.count(f"prepare: {TASKS}/{TASKS} tasks, ") == 2  # one progress line for the whole job, at its end


def test_a_relaunch_runs_only_tasks_without_a_commit(corpus, reference, tmp_path):
    out = tmp_path / "ds"
    _prepare(corpus, f"file://{out}")
    # An interrupted job: no manifest; tasks 2 and 5 never committed, 5 died after uploading one shard, 2 mid-upload.
    (out / "manifest.json").unlink()
    for i in (2, 5):
        (out / commit_key(i)).unlink()
    next(out.glob("shard-000002-*.bin")).unlink()
    (out / ".shard-000002-000000.bin.123.abcd.part").write_bytes(b"half")
    first, stats = _prepare(corpus, f"file://{out}")
    assert (stats.tasks, stats.tasks_run) == (TASKS, 2)
    (out / ".shard-000002-000000.bin.123.abcd.part").unlink()
    assert tree_sha(out) == reference
    _, again = _prepare(corpus, f"file://{out}")
    assert again.reused and again.tasks_run == 0


def test_a_resume_with_another_task_count_or_tokenizer_is_refused_in_one_line(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    _prepare(corpus, f"file://{out}")
    (out / "manifest.json").unlink()
    (out / commit_key(3)).unlink()
    base = ["prepare", str(corpus), "--out", f"file://{out}", "--shard-tokens", str(SHARD_TOKENS),
            "--val-fraction", "0.1", "--workers", "1"]  # fmt: skip
    for extra, says in ((["--tasks", "5"], f"--tasks {TASKS} then, 5 now"),
                        (["--tasks", str(TASKS), "--tokenizer", "bpe", "--vocab-size", "300"],
                         "--tokenizer 'byte' then, 'bpe' now")):  # fmt: skip
        assert cli(base + extra) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("prepare: skipped")]
        assert len(err) == 1 and err[0].startswith(f"error: file://{out}/prepare/plan.json: refusing to resume")
        assert says in err[0] and "--force" in err[0]
    assert not (out / "manifest.json").exists() and not (out / commit_key(3)).exists()  # nothing was touched
    assert cli(base + ["--tasks", "5", "--force"]) == 0  # starting over is allowed ...
    assert "5 tasks (5 run now)" in capsys.readouterr().out
    assert cli(base + ["--tasks", "4"]) == 0  # ... and a finished dataset is simply remade
    assert not (out / commit_key(4)).exists() and (out / commit_key(3)).exists()


def test_two_attempts_at_one_task_leave_one_commit_and_equal_bytes(corpus, reference, tmp_path):
    out = tmp_path / "ds"
    _prepare(corpus, f"file://{out}")
    plan_json = (out / PLAN_KEY).read_bytes()
    for p in [out / commit_key(3), *out.glob("shard-000003-*"), *out.glob("val-shard-000003-*")]:
        p.unlink()
    start = threading.Barrier(2)
    results: list[dict] = []

    def racer() -> None:
        start.wait()
        results.append(attempt(plan_json, 3, f"file://{out}"))

    threads = [threading.Thread(target=racer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["ok"] for r in results] == [True, True] and results[0]["commit"] == results[1]["commit"]
    assert len(list(out.glob("prepare/task-000003*"))) == 1
    assert tree_sha(out) == reference
    # A committed task is verified and left alone: nothing is rewritten.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert attempt(plan_json, 3, f"file://{out}")["ok"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # An uncommitted task meeting a shard with other bytes stops, names it, and leaves it as it is.
    (out / commit_key(4)).unlink()
    victim = next(out.glob("shard-000004-*.bin"))
    victim.write_bytes(b"\0" * victim.stat().st_size)
    bad = attempt(plan_json, 4, f"file://{out}")
    assert not bad["ok"] and not bad["retryable"]
    assert f"file://{victim} already holds other bytes" in bad["error"]
    assert victim.read_bytes() == b"\0" * victim.stat().st_size and not (out / commit_key(4)).exists()


def test_a_failing_task_is_retried_a_bounded_number_of_times_and_named(corpus, tmp_path, monkeypatch, capsys):
    real = tasks_mod.run_task
    failures = {1: 1, 4: 99}  # task 1 fails once, task 4 always

    def flaky(plan, index, store, tok, endpoint_url=None):
        if failures.get(index, 0) > 0:
            failures[index] -= 1
            raise OSError(f"injected failure of task {index}")
        return real(plan, index, store, tok, endpoint_url)

    monkeypatch.setattr(tasks_mod, "run_task", flaky)
    with pytest.raises(DataError) as info:
        _prepare(corpus, f"file://{tmp_path}/ds", attempts=3, progress=Progress(every_s=1e9))
    units = json.loads((tmp_path / "ds" / PLAN_KEY).read_text())
    assert f"task 4 (input from {corpus}/" in str(info.value) and "failed after 3 attempts" in str(info.value)
    assert "OSError: injected failure of task 4" in str(info.value) and units["tasks"] == TASKS
    err = capsys.readouterr().err
    assert "task 1 (input from" in err and "failed (attempt 1 of 3), will retry" in err
    assert (tmp_path / "ds" / commit_key(1)).exists() and not (tmp_path / "ds" / commit_key(4)).exists()
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_parquet_file_without_the_text_field_fails_its_task_at_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("fine\n")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "in" / "b.parquet")
    with pytest.raises(DataError, match=r"task 0 \(input from .*a.txt\) failed: .*b.parquet: cannot read column 'text'"):
        prepare([tmp_path / "in"], f"file://{tmp_path}/ds", tasks=1, attempts=3)


# -- against the local S3 server --------------------------------------------------------------------------
def _s3_tree(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    keys = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
            for o in p.get("Contents", [])]  # fmt: skip
    return {k[len(prefix) + 1 :]: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


@pytest.mark.slow
def test_s3_throttling_is_retried_and_the_bytes_equal_a_local_run(corpus, reference, bucket, proxy, moto_endpoint):
    proxy.fail_next(4, status=503, match="/shard-")  # SlowDown on shard uploads
    proxy.fail_next(2, status=503, match="/prepare/task-")  # and on commits
    _prepare(corpus, f"s3://{bucket}/ds", endpoint_url=proxy.endpoint, workers=2)
    tree = _s3_tree(moto_endpoint, bucket, "ds")
    import hashlib

    assert {k: hashlib.sha256(v).hexdigest() for k, v in tree.items()} == reference
    assert len([r for r in proxy.records if r.status == 503]) == 6
    puts = [r for r in proxy.records if r.method == "PUT" and "/shard-" in r.path and r.status == 200]
    assert puts and all(r.headers.get("If-None-Match") == "*" for r in puts)  # create-only uploads


@pytest.mark.slow
def test_a_job_killed_mid_upload_resumes_with_only_its_unfinished_tasks(corpus, reference, bucket, proxy,
                                                                        moto_endpoint, tmp_path):
    """SIGKILL the whole job (driver and its worker processes) while one shard upload hangs: no manifest, no commit
    for that task; the relaunch runs exactly the tasks without a commit, and the bytes equal a clean run's."""
    proxy.stall_next(1, seconds=60, match="/shard-000003-000000.bin")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen(
        [sys.executable, "-m", "trainer.data", "--endpoint-url", proxy.endpoint, "prepare", str(corpus), "--out",
         f"s3://{bucket}/ds", "--shard-tokens", str(SHARD_TOKENS), "--tasks", str(TASKS), "--val-fraction", "0.1",
         "--workers", "2"], env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proxy.stalling.wait(120), "the upload of task 3's first shard never started"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    store = open_store(f"s3://{bucket}/ds", endpoint_url=moto_endpoint)
    committed = [k for k in store.list("prepare/task-")]
    assert commit_key(3) not in committed and not store.exists("manifest.json")
    _, stats = _prepare(corpus, f"s3://{bucket}/ds", endpoint_url=moto_endpoint)
    assert stats.tasks_run == TASKS - len(committed) >= 1
    import hashlib

    tree = _s3_tree(moto_endpoint, bucket, "ds")
    assert {k: hashlib.sha256(v).hexdigest() for k, v in tree.items()} == reference


@pytest.mark.slow
def test_jsonl_and_parquet_objects_under_an_s3_prefix_give_the_local_files_bytes(corpus, bucket, moto_endpoint,
                                                                                  tmp_path):
    """The same files as objects: the same shards; the plan pins each object's ETag, and an object replaced after
    planning fails the task that reads it and makes a resume refuse, each in one line naming it."""
    picked = sorted(p for p in corpus.iterdir() if p.suffix in (".jsonl", ".parquet") or p.name.startswith("text-0"))
    (tmp_path / "local").mkdir()
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    for p in picked:
        (tmp_path / "local" / p.name).write_bytes(p.read_bytes())
        s3.put_object(Bucket=bucket, Key=f"corpus/{p.name}", Body=p.read_bytes())
    s3.put_object(Bucket=bucket, Key="corpus/.hidden.jsonl", Body=b'{"text": "never read"}\n')
    local, _ = _prepare(tmp_path / "local", f"file://{tmp_path}/a", tasks=3)
    remote, stats = _prepare(f"s3://{bucket}/corpus/", f"file://{tmp_path}/b", tasks=3, endpoint_url=moto_endpoint)
    assert [s.data.sha256 for s in remote.shards] == [s.data.sha256 for s in local.shards]
    assert [s.data.sha256 for s in remote.val_shards] == [s.data.sha256 for s in local.val_shards]
    plan = json.loads((tmp_path / "b" / PLAN_KEY).read_text())
    assert len(plan["inputs"]) == len(picked) - 1  # empty.jsonl is skipped (and said)
    assert all(i["path"].startswith(f"s3://{bucket}/corpus/") and i["content"].startswith("etag:")
               for i in plan["inputs"])  # fmt: skip
    # An object replaced after planning.
    victim = plan["inputs"][plan["units"][plan["bounds"][1]][0]]["path"]
    (tmp_path / "b" / "manifest.json").unlink()
    (tmp_path / "b" / commit_key(1)).unlink()
    replaced = tmp_path / ("replaced" + Path(victim).suffix)
    if replaced.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": ["replaced"]}), replaced)
    else:
        replaced.write_text('{"text": "replaced"}\n')
    s3.put_object(Bucket=bucket, Key=victim.split(f"{bucket}/", 1)[1], Body=replaced.read_bytes())
    out = attempt((tmp_path / "b" / PLAN_KEY).read_bytes(), 1, f"file://{tmp_path}/b", moto_endpoint)
    assert not out["ok"] and out["error"].startswith(f"{victim} changed after the plan was made (etag:")
    with pytest.raises(DataError, match=f"refusing to resume .*: input {victim} changed"):
        _prepare(f"s3://{bucket}/corpus/", f"file://{tmp_path}/b", tasks=3, endpoint_url=moto_endpoint)


def test_prepare_task_runs_one_task_of_a_planned_job_for_any_scheduler(corpus, reference, tmp_path, capsys):
    """What a cluster runner starts per task: `prepare-task OUT --index I`; then prepare merges, running nothing."""
    out = tmp_path / "ds"
    _prepare(corpus, f"file://{out}")
    (out / "manifest.json").unlink()
    for i in (2, 6):
        (out / commit_key(i)).unlink()
    assert cli(["prepare-task", f"file://{out}", "--index", "2", "--index", "6"]) == 0
    assert capsys.readouterr().out.splitlines() == ["task 2: committed", "task 6: committed"]
    _, stats = _prepare(corpus, f"file://{out}")
    assert stats.tasks_run == 0 and tree_sha(out) == reference
    assert cli(["prepare-task", f"file://{out}", "--index", str(TASKS)]) == 2
    assert f"error: task {TASKS}: task {TASKS} does not exist: the plan has tasks 0..{TASKS - 1}" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    """Child pids of ``pid`` (from /proc: no psutil here)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_a_worker_killed_mid_upload_is_replaced_and_the_job_finishes(corpus, reference, bucket, proxy, moto_endpoint,
                                                                     capsys):
    """SIGKILL one worker process while a shard upload hangs: its tasks are reported as died and run again (a
    bounded retry), and the dataset equals a clean run's."""
    proxy.stall_next(1, seconds=60, match="/shard-000002-000000.bin")
    errors: list[BaseException] = []
    progress = Progress(every_s=1e9)

    def run() -> None:
        try:
            _prepare(corpus, f"s3://{bucket}/ds", endpoint_url=proxy.endpoint, workers=2, progress=progress)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test thread)
            errors.append(exc)

    job = threading.Thread(target=run)
    job.start()
    try:
        assert proxy.stalling.wait(120), "the upload of task 2's first shard never started"
        servers = [p for p in _children(os.getpid()) if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
        workers = [w for s in servers for w in _children(s)]
        assert workers, "no worker processes found"
        os.kill(workers[0], signal.SIGKILL)
    finally:
        job.join(300)
    assert not errors, errors
    assert "failed (attempt 1 of 3), will retry: the worker running it died" in capsys.readouterr().err
    import hashlib

    tree = _s3_tree(moto_endpoint, bucket, "ds")
    assert {k: hashlib.sha256(v).hexdigest() for k, v in tree.items()} == reference
