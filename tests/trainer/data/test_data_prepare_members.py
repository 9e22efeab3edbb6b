"""prepare's members (``--member INDEX/COUNT``, what each pod of the cluster's Indexed Job runs): COUNT processes share
one plan, each runs the tasks i with i % COUNT == INDEX, and the one that finds every task committed merges. Held to
the one-process dataset of tests/trainer/data/conftest.py (`reference`): every shard, index, commit, the plan and
the manifest byte for byte.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_prepare_members.py -q``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.data.prepare_corpus import SHARD_TOKENS, TASKS, tree_sha
from trainer.data import DataError
from trainer.data.__main__ import main as cli
from trainer.data.__main__ import member
from trainer.data.inputs import PrepareStats
from trainer.data.plan import COMMIT_PREFIX, commit_key
from trainer.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[3]


def _member(corpus: Path, out: Path, index: int, count: int, **kw):
    stats = PrepareStats()
    kw = {"shard_tokens": SHARD_TOKENS, "tasks": TASKS, "val_fraction": 0.1, "workers": 1, **kw}
    return prepare([corpus], f"file://{out}", member=(index, count), stats=stats, **kw), stats


def _commits(out: Path) -> set[int]:
    return {int(p.stem.rsplit("-", 1)[1]) for p in (out / COMMIT_PREFIX.split("/")[0]).glob("task-*.json")}


def test_members_one_after_another_make_the_one_process_bytes_and_only_the_last_merges(corpus, reference, tmp_path,
                                                                                       caplog):
    out = tmp_path / "ds"
    caplog.set_level("INFO", logger="trainer.data")
    # TASKS = 7 tasks over 3 members: 0 runs 0, 3, 6; 1 runs 1, 4; 2 runs 2, 5.
    m, stats = _member(corpus, out, 0, 3)
    assert m is None and _commits(out) == {0, 3, 6} and stats.tasks_run == 3
    assert not (out / "manifest.json").exists()
    assert "4 tasks of other members not committed yet: the last member to finish merges" in caplog.text
    m, stats = _member(corpus, out, 1, 3)
    assert m is None and _commits(out) == {0, 1, 3, 4, 6} and stats.tasks_run == 2
    assert not (out / "manifest.json").exists()
    m, stats = _member(corpus, out, 2, 3)
    assert m is not None and stats.tasks_run == 2
    assert tree_sha(out) == reference

    # The merge is idempotent: with every commit there, any member that merges again writes the same manifest.
    (out / "manifest.json").unlink()
    m, stats = _member(corpus, out, 0, 3)
    assert m is not None and stats.tasks_run == 0
    assert tree_sha(out) == reference
    # Over the finished dataset a member only reads it.
    m, stats = _member(corpus, out, 1, 3)
    assert stats.reused and tree_sha(out) == reference


def test_more_members_than_tasks_and_a_trained_bpe_give_the_one_process_bytes(corpus, tmp_path):
    """A trained BPE: every member learns it from the same seeded sample, and the stored one is the one-process run's."""
    bpe = {"tokenizer": "bpe", "vocab_size": 300}
    one = tmp_path / "one"
    prepare([corpus], f"file://{one}", shard_tokens=SHARD_TOKENS, tasks=TASKS, val_fraction=0.1, workers=1, **bpe)
    out = tmp_path / "members"
    merged = [_member(corpus, out, i, 9, **bpe)[0] is not None for i in (8, 2, 0, 7, 1, 3, 4, 5, 6)]
    assert merged == [False] * 8 + [True]  # members 7 and 8 have no task: they commit nothing
    assert tree_sha(out) == tree_sha(one)


def test_a_member_with_another_task_count_is_refused_in_one_line(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    assert _member(corpus, out, 0, 3)[0] is None
    before = tree_sha(out)
    code = cli(["prepare", str(corpus), "--out", str(out), "--tasks", "5", "--shard-tokens", str(SHARD_TOKENS),
                "--val-fraction", "0.1", "--workers", "1", "--member", "1/3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ") and "--tasks 7 then, 5 now" in err[-1]
    assert [line for line in err if line.startswith("error")] == [err[-1]]
    assert tree_sha(out) == before  # nothing written, nothing cleared


def test_member_flag_reads_index_count_or_the_job_completion_index(monkeypatch, tmp_path, corpus):
    assert member("2/3") == (2, 3)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "4")
    assert member("env/5") == (4, 5)
    for bad in ("3/3", "-1/2", "1", "a/b", "env/4"):  # env: 4 is not below 4
        with pytest.raises(argparse.ArgumentTypeError):
            member(bad)
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    with pytest.raises(argparse.ArgumentTypeError, match="JOB_COMPLETION_INDEX"):
        member("env/2")
    with pytest.raises(DataError, match="--force does not go with --member"):
        _member(corpus, tmp_path / "ds", 0, 2, force=True)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", [(), ("--tokenizer", "bpe", "--vocab-size", "300")], ids=["byte", "bpe"])
def test_three_member_processes_at_once_make_the_one_process_bytes(corpus, reference, tmp_path, tokenizer):
    """Three `python -m trainer.data prepare --member env/3` processes started together, as an Indexed Job's pods
    are, each with its JOB_COMPLETION_INDEX: each exits 0, at least one merges, and the bytes are the one process's
    (with a trained BPE, every member trains it and races to store the plan and tokenizer.json)."""
    if tokenizer:
        one = tmp_path / "one"
        prepare([corpus], f"file://{one}", shard_tokens=SHARD_TOKENS, tasks=TASKS, val_fraction=0.1, workers=1,
                tokenizer="bpe", vocab_size=300)
        reference = tree_sha(one)
    out = tmp_path / "ds"
    argv = [sys.executable, "-m", "trainer.data", "prepare", str(corpus), "--out", str(out), "--tasks", str(TASKS),
            "--shard-tokens", str(SHARD_TOKENS), "--val-fraction", "0.1", "--workers", "2", "--member", "env/3",
            *tokenizer]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(argv, env={**env, "JOB_COMPLETION_INDEX": str(i)}, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(3)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert all(code == 0 for code, _, _ in results), results
    merged = [out_.startswith("wrote:") for _, out_, _ in results]
    assert any(merged), results
    for (_, out_, err), did in zip(results, merged, strict=True):
        if not did:
            assert "another member merges" in out_
            assert "tasks of other members not committed yet: the last member to finish merges" in err
    assert tree_sha(out) == reference
    assert all((out / commit_key(i)).exists() for i in range(TASKS))
