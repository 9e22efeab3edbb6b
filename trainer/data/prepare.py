"""Turn text into a sharded token dataset in object storage (``python -m trainer.data prepare|synth``).

Use::

    python -m trainer.data prepare corpus/ --out s3://bucket/datasets/corpus --workers 8
    python -m trainer.data prepare src/ --include '*.py' --exclude 'site-packages/' --out file:///data/py
    python -m trainer.data prepare web.parquet --text-field content --tokenizer gpt2 \\
        --tokenizer-file ~/gpt2 --out gs://bucket/web --engine ray --address ray://head:10001
    python -m trainer.data prepare big/ --out s3://b/ds --tasks 512 --engine spark --master spark://host:7077
    python -m trainer.data synth --out file:///tmp/synth --tokens 1048576 --seed 0

A job is a fixed set of deterministic tasks (trainer/data/plan.py, trainer/data/tasks.py): the inputs (path, size,
sha256), cut into units (a text file, a 32 MiB JSONL slice, a Parquet row group) and grouped into ``--tasks``
contiguous runs (default: about 8 MiB of input each, whatever the worker count), the tokenizer and the settings
form the plan, stored as ``prepare/plan.json``. Each task writes its shards and then its commit; one merge writes
``manifest.json`` from the commits. A runner (trainer/data/engines.py: local processes, Ray, Spark) only schedules
the tasks, so the output is byte-identical for any runner and worker count. A relaunch runs only the tasks without a
commit; a relaunch with other settings, inputs or task count over an unfinished job is refused in one line naming
what changed (``--force`` starts over); over a finished dataset it makes the new one. A trained BPE learns from a
sample of units drawn in an order fixed by ``--seed``.

``--member INDEX/COUNT`` (INDEX ``env``: $JOB_COMPLETION_INDEX, as in an Indexed Job's pods): one of COUNT processes
started with the same flags. Each makes the same plan (and trains the same BPE), stores it create-if-absent (another
plan there is refused in one line naming what differs), runs the uncommitted tasks i with ``i % COUNT == INDEX`` and
then lists the commits: with all there it merges, else it says how many are missing and returns None. The member
whose commit is the last to land sees every commit, so one always merges; two that merge at once write equal bytes.
Members never clear --out (no ``--force``; a finished dataset of other settings is refused).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gpu_train.storage import ObjectNotFoundError, RetryPolicy, Store, open_store
from trainer.data.engines import make_engine
from trainer.data.errors import DataError, ManifestError
from trainer.data.inputs import DEFAULT_EXCLUDES, PrepareStats, Task, collect_files
from trainer.data.manifest import MANIFEST_NAME, FileRef, Manifest, TokenizerInfo, dtype_for_vocab
from trainer.data.plan import (
    COMMIT_PREFIX,
    PLAN_KEY,
    InputRef,
    Plan,
    commit_key,
    default_tasks,
    describe_inputs,
    plan_units,
    task_bounds,
)
from trainer.data.progress import Progress
from trainer.data.remote import is_remote, plan_remote
from trainer.data.synthetic import VAL_STREAM, synthetic_shards
from trainer.data.tasks import Commit, load_task_tokenizer, merge, unit_documents
from trainer.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer, load_gpt2, train_bpe
from trainer.data.writer import write_dataset

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 shards, large enough for full-speed GETs
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_ATTEMPTS = 3
BPE_TRAIN_BYTES = 1 << 30  # a trained BPE learns from a seeded sample of 1 GiB of the input
TOKENIZERS = ("byte", "bpe", "gpt2")
log = logging.getLogger("trainer.data")


# -- the driver -------------------------------------------------------------------------------------------
def _say(progress: Progress | None) -> Callable[[str], None]:
    return progress.say if progress is not None else lambda text: log.info("%s", text)


def _stored(store: Store, key: str) -> bytes | None:
    try:
        return store.get_bytes(key)
    except ObjectNotFoundError:
        return None


def _manifest(store: Store) -> Manifest | None:
    raw = _stored(store, MANIFEST_NAME)
    try:
        return None if raw is None else Manifest.parse(raw, uri=store.url_of(MANIFEST_NAME))
    except ManifestError:
        return None


def _up_to_date(store: Store, fingerprint: str) -> Manifest | None:
    """The manifest already at the destination, if it was written from the same plan (and every shard is there)."""
    manifest = _manifest(store)
    if manifest is None or (manifest.source or {}).get("fingerprint") != fingerprint:
        return None
    present = set(store.list("shard-")) | set(store.list("val-shard-"))
    if any(s.data.file not in present for s in (*manifest.shards, *manifest.val_shards)):
        return None
    return manifest


def _clear(store: Store) -> None:
    """Remove a previous dataset and job: the manifest first, so that no reader meets shards it does not list."""
    store.delete(MANIFEST_NAME)
    for prefix in ("prepare/", "shard-", "val-shard-"):
        store.delete_prefix(prefix)
    store.delete(TOKENIZER_FILE)


def _plan_inputs(inputs: Sequence[str | os.PathLike[str]], include: Sequence[str], exclude: Sequence[str],
                 endpoint_url: str | None, skip_binary: bool, stats: PrepareStats, progress: Progress | None
                 ) -> tuple[tuple[InputRef, ...], tuple[tuple[int, int, int], ...], list[int]]:  # fmt: skip
    """The inputs pinned (local files hashed, objects by ETag), their units and weights: local files and directories
    first (trainer/data/inputs.py), then each s3:// or gs:// prefix in the order given (trainer/data/remote.py)."""
    local = [i for i in inputs if not is_remote(i)]
    described: tuple[InputRef, ...] = ()
    units: tuple[tuple[int, int, int], ...] = ()
    weights: list[int] = []
    if local:
        files = collect_files(local, include, exclude, stats)
        described = describe_inputs(files)
        units, weights = plan_units(files, described, skip_binary=skip_binary, stats=stats, say=_say(progress))
    for uri in (str(i) for i in inputs if is_remote(i)):
        for (path, size, content, fmt), ranges, ws in plan_remote(
            uri, include=include, exclude=exclude, endpoint_url=endpoint_url, skip_binary=skip_binary, stats=stats,
            say=_say(progress),
        ):  # fmt: skip
            described += (InputRef(path, size, content, fmt),)
            units += tuple((len(described) - 1, a, b) for a, b in ranges)
            weights += ws
    return described, units, weights


def _bpe_sample(plan: Plan, seed: int, limit: int, endpoint_url: str | None) -> Iterable[str]:
    """Text for training a BPE: whole units in an order fixed by ``seed`` (a keyed hash of each unit's index), until
    ``limit`` bytes: a fixed sample of the whole input, not of its first files."""
    order = sorted(range(len(plan.units)), key=lambda u: hashlib.sha256(f"{seed}:{u}".encode()).digest())
    seen = 0
    for u in order:
        i, start, end = plan.units[u]
        ref = plan.inputs[i]
        for doc in unit_documents(Task(ref.path, ref.fmt, start, end), plan.settings["text_field"], endpoint_url):
            yield doc.decode("utf-8", errors="replace")
            seen += len(doc)
        if seen >= limit:
            return


def _tokenizer(plan: Plan, gpt2: Tokenizer | None, progress: Progress | None, total: int,
               endpoint_url: str | None) -> Tokenizer:
    st = plan.settings
    if st["tokenizer"] == "byte":
        return ByteTokenizer()
    if gpt2 is not None:
        return gpt2
    _say(progress)(f"training a BPE tokenizer of {st['vocab_size']} ids on a sample of "
                   f"{min(BPE_TRAIN_BYTES, total) / 1e6:,.1f} MB of the input (seed {st['seed']}) ...")
    t0 = time.monotonic()
    tok = train_bpe(_bpe_sample(plan, st["seed"], BPE_TRAIN_BYTES, endpoint_url), st["vocab_size"])
    _say(progress)(f"trained the BPE tokenizer in {time.monotonic() - t0:.1f}s")
    return tok


def run_tasks(engine: Any, plan: Plan, pending: Sequence[int], out_uri: str, *, endpoint_url: str | None,
              attempts: int, weights: Sequence[int], progress: Progress | None) -> None:
    """Run ``pending`` tasks on ``engine`` until each has committed; a task that fails is tried again, up to
    ``attempts`` times in all, after a jittered pause; one that fails on bad input (or too often) stops the job
    with one line naming the task and its input."""
    say = _say(progress)
    policy = RetryPolicy(attempts=attempts, base_s=0.5, cap_s=10.0)
    tries = dict.fromkeys(pending, 0)
    todo = list(pending)
    plan_json = plan.to_json()
    for round_ in range(attempts):
        failed: list[int] = []
        for out in engine.run(plan_json, todo, out_uri, endpoint_url):
            i = out["index"]
            tries[i] += 1
            if out["ok"]:
                commit = Commit.parse(out["commit"], f"task {i}", plan.settings["dtype"])
                for note in commit.notes:
                    say(f"warning: {note}")
                if progress is not None:
                    progress.advance(weights[i], commit.tokens)
                continue
            first = plan.units_of(i)[0].path if plan.units_of(i) else "no input"
            where = f"task {i} (input from {first})"
            if not out["retryable"] or tries[i] >= attempts:
                times = f" after {tries[i]} attempts" if tries[i] > 1 else ""
                raise DataError(f"{where} failed{times}: {out['error']}")
            say(f"{where} failed (attempt {tries[i]} of {attempts}), will retry: {out['error']}")
            failed.append(i)
        if not failed:
            return
        time.sleep(policy.delay(round_))
        todo = failed


def _member_plan(plan: Plan, old: Plan | None, store: Store, train: Callable[[], Tokenizer]) -> tuple[Plan, Tokenizer]:
    """A member's plan and tokenizer: the stored plan when it equals this one; else this one (its tokenizer trained
    from the seeded sample, as every member trains it) stored create-if-absent, then its tokenizer.json likewise,
    so that a member never overwrites what another wrote; a different plan stored meanwhile is refused naming what
    differs."""
    if old is not None:
        try:
            return old, load_task_tokenizer(old, store)
        except ObjectNotFoundError:  # a member stopped between the plan and the tokenizer: train it again
            plan = old
    tok = train()
    raw = tok.to_json().encode() if tok.kind != "byte" else b""  # type: ignore[attr-defined]
    mine = plan.with_tokenizer({"kind": tok.kind, "name": getattr(tok, "name", ""), "vocab_size": tok.vocab_size,
                                "eot_id": tok.eot_id, "sha256": hashlib.sha256(raw).hexdigest() if raw else ""})
    if not store.put_if_absent(PLAN_KEY, mine.to_json()) and (theirs := store.get_bytes(PLAN_KEY)) != mine.to_json():
        change = Plan.parse(theirs, store.url_of(PLAN_KEY)).difference(mine) or "another tokenizer"
        raise DataError(f"{store.url_of(PLAN_KEY)}: another member stored another plan: {change}")
    if raw and not store.put_if_absent(TOKENIZER_FILE, raw) and store.get_bytes(TOKENIZER_FILE) != raw:
        raise DataError(f"{store.url_of(TOKENIZER_FILE)}: sha256 differs from the plan's {mine.tokenizer['sha256']}")
    return mine, tok


def prepare(
    inputs: Iterable[str | os.PathLike[str]],
    out_uri: str,
    *,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    tokenizer_file: str | os.PathLike[str] | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    tasks: int | None = None,
    engine: str = "local",
    address: str | None = None,
    master: str | None = None,
    seed: int = 0,
    attempts: int = DEFAULT_ATTEMPTS,
    endpoint_url: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = DEFAULT_EXCLUDES,
    skip_binary: bool = True,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    force: bool = False,
    member: tuple[int, int] | None = None,
    stats: PrepareStats | None = None,
    progress: Progress | None = None,
) -> Manifest | None:
    """Tokenize ``inputs`` into a dataset at ``out_uri`` (a URI or a plain path); see the module docstring.
    `progress` is told what happens (python -m trainer.data prepare passes one); without it prepare is silent
    but for its warnings, which go to the `trainer.data` logger. ``member=(index, count)``: one of ``count``
    processes sharing the plan, running the tasks i with ``i % count == index``; it merges only when every task has
    a commit, else returns None (see the module docstring)."""
    if member is not None and not 0 <= member[0] < member[1]:
        raise DataError(f"--member {member[0]}/{member[1]}: the index must be in 0..COUNT-1")
    if member is not None and force:
        raise DataError("--force does not go with --member: members share one plan and never clear --out "
                        "(run prepare once with --force, then start the members)")
    if tokenizer not in TOKENIZERS:
        raise DataError(f"--tokenizer must be one of {', '.join(TOKENIZERS)} (got {tokenizer!r})")
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if shard_tokens < 2:
        raise DataError(f"--shard-tokens must be >= 2 (got {shard_tokens})")
    if attempts < 1:
        raise DataError(f"--attempts must be >= 1 (got {attempts})")
    stats = stats if stats is not None else PrepareStats()
    if tokenizer == "gpt2" and tokenizer_file is None:
        raise DataError("--tokenizer gpt2 needs --tokenizer-file: GPT-2's vocab.json + merges.txt folder")
    if tokenizer == "bpe" and vocab_size is None:
        raise DataError("--tokenizer bpe needs --vocab-size")
    if tokenizer == "byte" and vocab_size not in (None, ByteTokenizer.vocab_size):
        raise DataError(f"--vocab-size is fixed at {ByteTokenizer.vocab_size} for the byte tokenizer")
    runner = make_engine(engine, workers or os.cpu_count() or 1, address=address, master=master)
    gpt2 = load_gpt2(tokenizer_file) if tokenizer == "gpt2" else None  # type: ignore[arg-type]
    tok_sha = hashlib.sha256(gpt2.to_json().encode()).hexdigest() if gpt2 is not None else ""  # type: ignore[attr-defined]
    vocab = gpt2.vocab_size if gpt2 is not None else (vocab_size or ByteTokenizer.vocab_size)
    inputs = [str(i) if is_remote(i) else i for i in inputs]
    described, units, weights = _plan_inputs(inputs, include, exclude, endpoint_url, skip_binary, stats, progress)
    if not units:
        raise DataError(f"no text to tokenize in {[str(i) for i in inputs]}: every file was empty or binary")
    settings = {
        "tokenizer": tokenizer, "vocab_size": vocab_size, "tokenizer_sha256": tok_sha, "dtype": dtype_for_vocab(vocab),
        "shard_tokens": shard_tokens, "include": list(include), "exclude": list(exclude), "skip_binary": skip_binary,
        "text_field": text_field, "val_fraction": val_fraction, "seed": seed,
    }  # fmt: skip
    plan = Plan(settings, described, units, task_bounds(weights, tasks or default_tasks(sum(weights))))
    store = open_store(out_uri, endpoint_url=endpoint_url)
    if not force and (existing := _up_to_date(store, plan.recipe_sha256)) is not None:
        stats.documents = {"train": existing.num_documents, "val": existing.val_documents}
        stats.reused = True
        return existing
    old_raw = None if force else _stored(store, PLAN_KEY)
    old = Plan.parse(old_raw, store.url_of(PLAN_KEY)) if old_raw is not None else None
    change = old.difference(plan) if old is not None else ""
    done = _manifest(store) if change else None
    finished = old is not None and done is not None and (done.source or {}).get("plan") == old.sha256
    if member is not None and change and not finished:
        raise DataError(f"{store.url_of(PLAN_KEY)}: member {member[0]} of {member[1]} refuses to share a plan of other "
                        f"settings: {change} (start every member with the same flags)")
    if old is not None and change and not finished:
        raise DataError(f"{store.url_of(PLAN_KEY)}: refusing to resume an unfinished preparation with other settings:"
                        f" {change} (run it as before to finish it, or pass --force to start over)")
    if member is not None and (change or (old is None and _stored(store, MANIFEST_NAME) is not None)):
        raise DataError(f"{store.url_of(MANIFEST_NAME)}: holds another dataset ({change or 'written without a plan'});"
                        " members never replace one: remove it, or run prepare once with --force")
    if member is not None:
        plan, tok = _member_plan(plan, old, store, lambda: _tokenizer(plan, gpt2, progress, sum(weights), endpoint_url))
    elif old is not None and not change:
        plan, tok = old, load_task_tokenizer(old, store)
    else:
        _clear(store)
        tok = _tokenizer(plan, gpt2, progress, sum(weights), endpoint_url)
        raw = tok.to_json().encode() if tok.kind != "byte" else b""  # type: ignore[attr-defined]
        if raw:
            store.put_bytes(TOKENIZER_FILE, raw)
        plan = plan.with_tokenizer({"kind": tok.kind, "name": getattr(tok, "name", ""), "vocab_size": tok.vocab_size,
                                    "eot_id": tok.eot_id, "sha256": hashlib.sha256(raw).hexdigest() if raw else ""})
        if not store.put_if_absent(PLAN_KEY, plan.to_json()) and store.get_bytes(PLAN_KEY) != plan.to_json():
            raise DataError(f"{store.url_of(PLAN_KEY)}: another prepare wrote another plan here meanwhile")
    committed = {k for k in store.list(COMMIT_PREFIX)}
    mine = range(plan.tasks) if member is None else range(member[0], plan.tasks, member[1])
    pending = [i for i in mine if commit_key(i) not in committed]
    task_bytes = [sum(weights[plan.bounds[i] : plan.bounds[i + 1]]) for i in range(plan.tasks)]
    stats.tasks, stats.tasks_run = plan.tasks, len(pending)
    _say(progress)(f"{plan.tasks} tasks over {len(plan.units)} units of {len(plan.inputs)} inputs"
                   + (f"; {plan.tasks - len(pending)} committed already, {len(pending)} to run" if old is not None
                      and not change else "") + f"; {runner.name} runner"
                   + (f"; member {member[0]} of {member[1]}: tasks {member[0]}, {member[0] + member[1]}, ..."
                      f" ({len(mine)}, {len(pending)} to run)" if member is not None else ""))  # fmt: skip
    if progress is not None:
        progress.start(sum(task_bytes), plan.tasks, plan.tasks - len(pending),
                       sum(task_bytes) - sum(task_bytes[i] for i in pending))
    run_tasks(runner, plan, pending, out_uri, endpoint_url=endpoint_url, attempts=attempts, weights=task_bytes,
              progress=progress)
    if progress is not None:
        progress.finish()
    if member is not None and (left := plan.tasks - len(set(store.list(COMMIT_PREFIX)))):
        _say(progress)(f"{left} tasks of other members not committed yet: the last member to finish merges")
        return None
    tok_file = None
    if tok.kind != "byte":
        raw = store.get_bytes(TOKENIZER_FILE)
        tok_file = FileRef(TOKENIZER_FILE, len(raw), hashlib.sha256(raw).hexdigest())
    info = TokenizerInfo(tok.kind, tok.vocab_size, tok.eot_id, tok_file, getattr(tok, "name", ""))
    source = {"fingerprint": plan.recipe_sha256, "plan": plan.sha256, "tasks": plan.tasks, "files": stats.files,
              "skipped_binary": stats.skipped_binary}  # fmt: skip
    manifest = merge(plan, store, info, source)
    stats.documents = {"train": manifest.num_documents, "val": manifest.val_documents}
    if val_fraction > 0 and not manifest.val_shards:
        text = (f"--val-fraction {val_fraction} held out none of the {manifest.num_documents} documents: the "
                "validation split is empty, and a run with eval.every_steps will refuse this dataset; use a larger "
                "--val-fraction or more documents")
        if progress is not None:
            progress.warn(text)
        else:
            log.warning("%s", text)
    return manifest


def synth(out_uri: str, *, tokens: int = 1 << 20, seed: int = 0, shard_tokens: int = 1 << 18,
          val_tokens: int = 1 << 16, endpoint_url: str | None = None) -> Manifest:  # fmt: skip
    """The synthetic dataset of ``open_dataset("synthetic")`` (both splits), written as real shards."""
    store = open_store(out_uri, endpoint_url=endpoint_url)
    info = TokenizerInfo(ByteTokenizer.kind, ByteTokenizer.vocab_size, ByteTokenizer.eot_id)
    val = (
        synthetic_shards(val_tokens, seed=seed, shard_tokens=shard_tokens, stream=VAL_STREAM)
        if val_tokens
        else []
    )
    return write_dataset(
        synthetic_shards(tokens, seed=seed, shard_tokens=shard_tokens), store, info, "uint16", val_shards=val
    )
