"""Dataset command line: ``python -m trainer.data {prepare,synth,verify} --help``.

Examples::

    python -m trainer.data prepare corpus/ --out s3://bucket/datasets/corpus --workers 8
    python -m trainer.data prepare docs.jsonl --out gs://bucket/ds --tokenizer bpe --vocab-size 8192
    python -m trainer.data synth --out file:///tmp/synth --tokens 1048576
    python -m trainer.data verify s3://bucket/datasets/corpus --cache-dir /nvme/cache

Exit status 2 with a one-line message naming the file, shard or URI on bad input.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from trainer.data.errors import DataError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.data", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint (else env TRAINER_S3_ENDPOINT_URL)"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prepare", help="tokenize text files into shards and upload them")
    p.add_argument("inputs", nargs="+", help="text files, .jsonl files ('text' field) or directories")
    p.add_argument("--out", required=True, help="destination URI: file:///abs, s3://bucket/prefix, gs://...")
    p.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    p.add_argument("--vocab-size", type=_positive, default=None, help="BPE vocabulary size (with EOT)")
    p.add_argument("--shard-tokens", type=_positive, default=None, help="tokens per shard (default 64 Mi)")
    p.add_argument("--workers", type=_positive, default=None, help="tokenizer processes (default: CPUs)")

    s = sub.add_parser("synth", help="write the synthetic learnable byte-level dataset")
    s.add_argument("--out", required=True)
    s.add_argument("--tokens", type=_positive, default=1 << 20)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--shard-tokens", type=_positive, default=1 << 18)

    v = sub.add_parser("verify", help="download every shard through a cache and check size + sha256")
    v.add_argument("uri", help="manifest URI or its folder")
    v.add_argument("--cache-dir", default=None, help="cache to fill (default: a temporary one)")

    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            from trainer.data.prepare import DEFAULT_SHARD_TOKENS, prepare

            t0 = time.perf_counter()
            m = prepare(
                args.inputs,
                args.out,
                tokenizer=args.tokenizer,
                vocab_size=args.vocab_size,
                shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                workers=args.workers,
                endpoint_url=args.endpoint_url,
            )
            dt = time.perf_counter() - t0
            print(
                f"wrote {len(m.shards)} shards, {m.total_tokens} tokens, {m.num_documents} documents "
                f"({m.tokenizer.kind}, vocab {m.tokenizer.vocab_size}, {m.dtype}) to {args.out} in {dt:.1f}s"
            )
        elif args.cmd == "synth":
            from trainer.data.prepare import synth

            m = synth(
                args.out, tokens=args.tokens, seed=args.seed, shard_tokens=args.shard_tokens,
                endpoint_url=args.endpoint_url,
            )  # fmt: skip
            print(f"wrote {len(m.shards)} shards, {m.total_tokens} synthetic tokens to {args.out}")
        else:
            from trainer.data.cache import CacheRef, ShardCache
            from trainer.data.shards import read_manifest, split_manifest_uri
            from trainer.data.storage import open_store

            root, key = split_manifest_uri(args.uri)
            store = open_store(root, endpoint_url=args.endpoint_url)
            manifest, digest = read_manifest(store, key)
            with tempfile.TemporaryDirectory(prefix="gpu-train-verify-") as tmp:
                cache = ShardCache(args.cache_dir or tmp)
                t0 = time.perf_counter()
                for shard in manifest.shards:
                    for ref in (shard.data, shard.index):
                        if ref.bytes:
                            cache.fetch(store, CacheRef(ref.file, ref.bytes, ref.sha256))
                dt = time.perf_counter() - t0
            print(
                f"ok: {store.url_of(key)} sha256 {digest}: {len(manifest.shards)} shards, "
                f"{manifest.total_tokens} tokens verified ({cache.stats.bytes_downloaded / 1e6:.1f} MB "
                f"downloaded, {cache.stats.hits} cache hits, {dt:.1f}s)"
            )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
