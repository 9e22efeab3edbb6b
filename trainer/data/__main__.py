"""Dataset command line: ``python -m trainer.data {prepare,prepare-task,synth,verify} --help``.

Examples::

    python -m trainer.data prepare corpus/ --out s3://bucket/datasets/corpus --workers 8
    python -m trainer.data prepare lib/ --include '*.py' --exclude 'site-packages/' --exclude 'test/' \\
        --out file:///data/py --val-fraction 0.02
    python -m trainer.data prepare docs.jsonl --out gs://bucket/ds --tokenizer bpe --vocab-size 8192
    python -m trainer.data prepare web.parquet --text-field content --tokenizer gpt2 \\
        --tokenizer-file ~/gpt2 --out s3://bucket/web
    python -m trainer.data prepare corpus/ --out s3://bucket/ds --tasks 64 --engine ray --workers 16
    python -m trainer.data prepare-task s3://bucket/ds --index 3     # one task of a planned job, e.g. in a pod
    python -m trainer.data prepare corpus/ --out s3://bucket/ds --member env/8   # one of an Indexed Job's 8 pods
    python -m trainer.data synth --out /tmp/synth --tokens 1048576
    python -m trainer.data verify s3://bucket/datasets/corpus --cache-dir /nvme/cache

Exit status 2 with a one-line message naming the file, shard or URI on bad input (``prepare-task``: 1 when a task
failed in a way worth another attempt).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from gpu_train.spec.values import as_uri
from trainer.data.errors import DataError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (got {value})")
    return value


MEMBER_ENV = "JOB_COMPLETION_INDEX"  # what Kubernetes sets in each pod of an Indexed Job


def member(text: str) -> tuple[int, int]:
    """--member INDEX/COUNT, INDEX a number or `env` (read from $JOB_COMPLETION_INDEX)."""
    import os

    index, sep, count = text.partition("/")
    if index == "env":
        index = os.environ.get(MEMBER_ENV, "")
        if not index:
            raise argparse.ArgumentTypeError(f"env/COUNT reads ${MEMBER_ENV}, which is not set")
    try:
        at, of = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not INDEX/COUNT or env/COUNT: {text!r}") from None
    if not sep or not 0 <= at < of:
        raise argparse.ArgumentTypeError(f"INDEX/COUNT needs 0 <= INDEX < COUNT (got {index}/{count})")
    return at, of


def _prepare(args: argparse.Namespace) -> None:
    from trainer.data.inputs import DEFAULT_EXCLUDES, PrepareStats
    from trainer.data.prepare import DEFAULT_SHARD_TOKENS, Progress, prepare

    stats = PrepareStats()
    t0 = time.perf_counter()
    same_name = ("tokenizer", "vocab_size", "tokenizer_file", "workers", "tasks", "engine", "address", "master",
                 "seed", "attempts", "endpoint_url", "include", "text_field", "val_fraction", "force", "member")
    m = prepare(
        args.inputs, args.out, **{name: getattr(args, name) for name in same_name},
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        exclude=[*([] if args.no_default_excludes else DEFAULT_EXCLUDES), *args.exclude],
        skip_binary=not args.keep_binary, stats=stats, progress=Progress(sys.stderr, every_s=args.progress_every),
    )
    dt = time.perf_counter() - t0
    if m is None:
        print(f"member {args.member[0]} of {args.member[1]}: committed {stats.tasks_run} of {stats.tasks} tasks "
              f"in {dt:.1f}s; another member merges")
        return
    tok = m.tokenizer.kind + (f" {m.tokenizer.name}" if m.tokenizer.name else "")
    print(
        f"{'up to date' if stats.reused else 'wrote'}: "
        f"{len(m.shards)} shards, {m.total_tokens} tokens, {m.num_documents} documents; "
        f"val {len(m.val_shards)} shards, {m.val_tokens} tokens, {m.val_documents} documents "
        f"({tok}, vocab {m.tokenizer.vocab_size}, {m.dtype}) from {stats.files} files in "
        f"{(m.source or {}).get('tasks', '?')} tasks ({stats.tasks_run} run now) "
        f"({stats.excluded} paths excluded, {stats.skipped_binary} binary and {stats.skipped_empty} empty skipped) "
        f"to {args.out} in {dt:.1f}s"
    )


def _prepare_task(args: argparse.Namespace) -> int:
    """Run the given tasks of the plan stored at --out, one after the other, in this process; one line each."""
    from gpu_train.storage import open_store
    from trainer.data.plan import PLAN_KEY
    from trainer.data.tasks import attempt

    plan_json = open_store(args.out, endpoint_url=args.endpoint_url).get_bytes(PLAN_KEY)
    status = 0
    for index in args.index:
        out = attempt(plan_json, index, args.out, args.endpoint_url)
        if out["ok"]:
            print(f"task {index}: committed")
        else:
            print(f"error: task {index}: {out['error']}", file=sys.stderr)
            status = 2 if not out["retryable"] else 1
    return status


def _verify(args: argparse.Namespace) -> int:
    """Hash every shard: the cached copies in --cache-dir (dropping bad ones), else the store's bytes."""
    from gpu_train.storage import FileStore, open_store
    from trainer.data.cache import CacheRef, SealBook, ShardCache
    from trainer.data.shards import DirectShardSource, read_manifest, split_manifest_uri

    root, key = split_manifest_uri(args.uri)
    store = open_store(root, endpoint_url=args.endpoint_url)
    manifest, digest = read_manifest(store, key)
    shards = (*manifest.shards, *manifest.val_shards)
    refs = [CacheRef(r.file, r.bytes, r.sha256) for s in shards for r in (s.data, s.index) if r.bytes]
    problems: list[str] = []
    t0 = time.perf_counter()
    downloaded = 0
    with tempfile.TemporaryDirectory(prefix="gpu-train-verify-") as tmp:
        if isinstance(store, FileStore) and not args.cache_dir:
            direct = DirectShardSource(store, shards, manifest.np_dtype, SealBook(tmp), verify="full")
            for ref in refs:
                try:
                    direct.prove(ref.key, ref.size, ref.sha256)
                except DataError as exc:
                    problems.append(str(exc))
        else:
            cache = ShardCache(args.cache_dir or tmp)
            for ref in refs:
                if cache.check(ref) == "corrupt":
                    problems.append(
                        f"shard {ref.key}: the cached copy in {cache.path_of(ref)} did not match its sha256 "
                        f"{ref.sha256}: dropped it"
                    )
                try:
                    cache.fetch(store, ref)
                except DataError as exc:
                    problems.append(str(exc))
            downloaded = cache.stats.bytes_downloaded
    dt = time.perf_counter() - t0
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        print(
            f"error: {store.url_of(key)}: {len(problems)} of {len(refs)} files failed verification",
            file=sys.stderr,
        )
        return 2
    print(
        f"ok: {store.url_of(key)} sha256 {digest}: {len(manifest.shards)} train + {len(manifest.val_shards)} val "
        f"shards, {manifest.total_tokens + manifest.val_tokens} tokens verified "
        f"({downloaded / 1e6:.1f} MB downloaded, {dt:.1f}s)"
    )
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line: prepare, synth, verify."""
    ap = argparse.ArgumentParser(prog="python -m trainer.data", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint (else env TRAINER_S3_ENDPOINT_URL)"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prepare", help="tokenize text files into shards and upload them")
    p.add_argument("inputs", nargs="+", help="files or directories: text, .jsonl(.gz), .parquet")
    p.add_argument("--out", required=True, type=as_uri,
                   help="destination: a directory (a plain path or file:///abs), s3://bucket/prefix, gs://...")
    p.add_argument(
        "--tokenizer",
        choices=("byte", "bpe", "gpt2"),
        default="byte",
        help="byte (257 ids), bpe (trained on the input), gpt2 (GPT-2's 50,257-token BPE)",
    )
    p.add_argument(
        "--tokenizer-file",
        default=None,
        help="gpt2: folder with vocab.json + merges.txt (or encoder.json + vocab.bpe), or tokenizer.json",
    )
    p.add_argument("--vocab-size", type=_positive, default=None, help="BPE vocabulary size (with EOT)")
    p.add_argument("--shard-tokens", type=_positive, default=None, help="tokens per shard (default 64 Mi)")
    p.add_argument("--workers", type=_positive, default=None,
                   help="tasks run at once: worker processes of the local runner, Ray tasks in flight, or Spark's "
                        "local[N] (default: the CPU count); the output does not depend on it")
    p.add_argument("--tasks", type=_positive, default=None,
                   help="the job's fixed task count (default: about 8 MiB of input per task, whatever --workers); a "
                        "resumed job must keep it")
    p.add_argument("--engine", choices=("local", "ray", "spark"), default="local",
                   help="who runs the tasks: local processes (default), Ray, or Spark")
    p.add_argument("--address", default=None,
                   help="--engine ray: an existing Ray cluster (ray://head:10001, or auto); default: start one here")
    p.add_argument("--master", default=None,
                   help="--engine spark: the master URL (spark://host:7077, yarn, k8s://...; default local[WORKERS])")
    p.add_argument("--seed", type=int, default=0, help="fixes the sample a trained BPE learns from (default 0)")
    p.add_argument("--attempts", type=_positive, default=3,
                   help="tries per task before the job fails (default 3); bad input fails at once")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                   help="when stderr is not a terminal, a progress line every SECONDS (default 10); on a terminal "
                        "one line is redrawn in place")
    for flag, which in (("--include", "only files"), ("--exclude", "skip files")):
        p.add_argument(flag, action="append", default=[], metavar="PATTERN",
                       help=f"{which} matching this gitignore-style pattern (repeatable)")
    p.add_argument(
        "--no-default-excludes", action="store_true", help="do not skip __pycache__/, *.pyc, *.pyo"
    )
    p.add_argument(
        "--keep-binary", action="store_true", help="do not skip files with a NUL byte in their head"
    )
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument(
        "--val-fraction",
        type=_fraction,
        default=None,
        help="share of documents held out as the validation split (default 0.01)",
    )
    p.add_argument("--force", action="store_true", help="redo it even if --out holds the same dataset")
    p.add_argument("--member", type=member, default=None, metavar="INDEX/COUNT",
                   help="one of COUNT processes (e.g. an Indexed Job's pods) sharing one plan: each makes the same "
                        "plan, stores it create-if-absent, runs the tasks i with i %% COUNT == INDEX (on the local "
                        "runner with --workers) and merges only once every task has committed; INDEX `env` reads "
                        f"${MEMBER_ENV}")

    t = sub.add_parser("prepare-task", help="run tasks of a planned prepare job (what a cluster runner starts)")
    t.add_argument("out", type=as_uri, help="the job's destination (holding prepare/plan.json), as --out of prepare")
    t.add_argument("--index", type=int, action="append", required=True,
                   help="a task to run (repeatable); one that has committed already is verified and skipped")

    s = sub.add_parser("synth", help="write the synthetic learnable byte-level dataset")
    s.add_argument("--out", required=True, type=as_uri, help="destination: a plain path or a URI")
    s.add_argument("--tokens", type=_positive, default=1 << 20)
    s.add_argument("--val-tokens", type=int, default=1 << 16, help="tokens in the val split (0: none)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--shard-tokens", type=_positive, default=1 << 18)

    v = sub.add_parser(
        "verify", help="hash every shard (cached copies and/or the store's) against the manifest"
    )
    v.add_argument("uri", type=as_uri, help="manifest URI or its folder (or a plain path to either)")
    v.add_argument(
        "--cache-dir",
        default=None,
        help="hash the copies in this shard cache (dropping bad ones) and fill in missing ones",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "prepare":
            from trainer.data.prepare import DEFAULT_VAL_FRACTION

            if args.val_fraction is None:
                args.val_fraction = DEFAULT_VAL_FRACTION
            _prepare(args)
        elif args.cmd == "prepare-task":
            return _prepare_task(args)
        elif args.cmd == "synth":
            from trainer.data.prepare import synth

            m = synth(
                args.out, tokens=args.tokens, seed=args.seed, shard_tokens=args.shard_tokens,
                val_tokens=max(0, args.val_tokens), endpoint_url=args.endpoint_url,
            )  # fmt: skip
            print(
                f"wrote {len(m.shards)} shards, {m.total_tokens} synthetic tokens "
                f"(+ {m.val_tokens} val) to {args.out}"
            )
        else:
            return _verify(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
