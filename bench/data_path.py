"""Data path: what the sampler + shard cache deliver from a local S3 server and what verification costs (how fast
``prepare`` tokenizes is bench/prepare.py's section).

Usage: `python -m bench --only data` (`--quick` for smaller sizes).

All readers run in this process, one after the other, against a moto S3 server on localhost, reading the
same global batches in the same order (GlobalSampler, seed 0):

- warm / cold cache: a dataset that fits the cache, one epoch, whole-dataset shuffle (as before);
- larger than the cache: a dataset four times the cache budget, one epoch with the block shuffle and
  the upcoming blocks fetched ahead (disk and memory read modes), GETs per shard per epoch counted at the
  server, next to the old whole-dataset shuffle on the same budget (a few steps, GETs extrapolated);
- verification: proving a warm cache by seals (one stat per shard) against hashing every shard.
"""

from __future__ import annotations

import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

import boto3
import numpy as np
import torch

from bench.common import Figure, local_s3, preset_flops_per_token, ratio
from gpu_train.spec import trainer_config as tcfg
from trainer.data import GlobalSampler, open_dataset
from trainer.data.cache import CacheRef, ShardCache, sha256_file
from trainer.data.inputs import collect_files
from trainer.data.prepare import synth
from trainer.flops import gpu_peak_flops
from trainer.model import GPT

CONTEXT = 1024
BATCH = 32  # sequences per global batch
BLOCK = 2  # shards per shuffle block in the larger-than-cache runs


class _GetCounter:
    """Counts the GETs of shard objects that boto3 clients in this process send (request-created hook)."""

    def __init__(self) -> None:
        self.gets: Counter[str] = Counter()

    def __call__(self, request, **_) -> None:
        if request.method == "GET" and request.url.split("?")[0].endswith(".bin"):
            self.gets[request.url.split("?")[0].rsplit("/", 1)[-1]] += 1


def _counting(counter: _GetCounter):
    import boto3.session

    original = boto3.session.Session.client

    def client(self, *args, **kwargs):
        c = original(self, *args, **kwargs)
        c.meta.events.register("request-created.s3", counter)
        return c

    boto3.session.Session.client = client
    return lambda: setattr(boto3.session.Session, "client", original)


def _deliver(uri: str, endpoint: str, cache_dir: Path, steps: int) -> tuple[float, int]:
    """Seconds to deliver `steps` global batches (prefetching the next batch's shards), and tokens."""
    t0 = time.perf_counter()
    ds = open_dataset(uri, context=CONTEXT, cache_dir=str(cache_dir), cache_max_bytes=1 << 34,
                      prefetch_shards=4, endpoint_url=endpoint, read_mode="disk")
    sampler = GlobalSampler(ds.num_windows, global_batch=BATCH, seed=0)
    tokens = 0
    for step in range(steps):
        idx = sampler.global_batch(step)
        ds.prefetch(sampler.global_batch(step + 1))
        batch = ds.batch(idx)
        tokens += batch.shape[0] * (batch.shape[1] - 1)
    ds.close()
    return time.perf_counter() - t0, tokens


def _over_budget(uri: str, endpoint: str, cache_dir: Path, budget: int, *, mode: str, blocks: bool,
                 steps: int | None, counter: _GetCounter) -> tuple[float, int, int, int, int]:
    """(seconds, tokens, shard GETs, steps per epoch, shards) reading through a cache of `budget` bytes."""
    counter.gets.clear()
    t0 = time.perf_counter()
    ds = open_dataset(uri, context=CONTEXT, cache_dir=str(cache_dir), cache_max_bytes=budget, prefetch_shards=2,
                      endpoint_url=endpoint, read_mode=mode, memory_dir=str(cache_dir / "shm"),
                      max_open_shards=BLOCK)
    epoch_steps = ds.num_windows // BATCH
    n = epoch_steps if steps is None else steps
    if blocks:
        sampler = GlobalSampler(ds.num_windows, global_batch=BATCH, seed=0, shard_windows=ds.shard_windows,
                                block_shards=BLOCK)
    else:
        sampler = GlobalSampler(ds.num_windows, global_batch=BATCH, seed=0)
    tokens = 0
    for step in range(n):
        if blocks:
            ds.fetch_ahead(sampler.upcoming_shards(step, 2 * BLOCK, end_step=n))
        else:
            ds.prefetch(sampler.global_batch(step + 1))
        batch = ds.batch(sampler.global_batch(step))
        tokens += batch.shape[0] * (batch.shape[1] - 1)
    ds.close()
    return time.perf_counter() - t0, tokens, sum(counter.gets.values()), epoch_steps, ds.num_shards


def _naive(bucket: str, prefix: str, endpoint: str, steps: int) -> tuple[float, int]:
    """One ranged GET per sample straight from object storage: no cache, no prefetch."""
    import json

    s3 = boto3.client("s3", endpoint_url=endpoint)
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read())
    shards = manifest["shards"]
    itemsize = np.dtype(manifest["dtype"]).itemsize
    counts = [(s["tokens"] - 1) // CONTEXT for s in shards]
    cum = np.cumsum([0, *counts])
    sampler = GlobalSampler(int(cum[-1]), global_batch=BATCH, seed=0)
    t0 = time.perf_counter()
    tokens = 0
    for step in range(steps):
        for i in sampler.global_batch(step):
            s = int(np.searchsorted(cum, i, side="right")) - 1
            off = (i - int(cum[s])) * CONTEXT * itemsize
            body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{shards[s]['file']}",
                                 Range=f"bytes={off}-{off + (CONTEXT + 1) * itemsize - 1}")["Body"].read()
            tokens += len(body) // itemsize - 1
    return time.perf_counter() - t0, tokens


def _verification(uri: str, endpoint: str, cache_dir: Path) -> tuple[float, float, int, int]:
    """(seconds per shard to prove a warm cache by seals, MB/s of full hashing, shards, shard bytes)."""
    ds = open_dataset(uri, context=CONTEXT, cache_dir=str(cache_dir), endpoint_url=endpoint, read_mode="disk")
    refs = [CacheRef(s.data.file, s.data.bytes, s.data.sha256) for s in ds.manifest.shards]
    ds.close()
    store = ds._source.store
    cache = ShardCache(cache_dir)  # a new process's view: nothing proven yet
    t0 = time.perf_counter()
    for ref in refs:
        cache.fetch(store, ref)
    seal_s = (time.perf_counter() - t0) / len(refs)
    assert cache.stats.seal_hits == len(refs) and cache.stats.hashes == 0
    t0 = time.perf_counter()
    for ref in refs:
        sha256_file(cache.path_of(ref))
    hash_s = time.perf_counter() - t0
    size = sum(r.size for r in refs)
    return seal_s, size / hash_s / 1e6, len(refs), size


def _consumption_cpu(steps: int = 5) -> tuple[float, str]:
    """Tokens/s the trainer's model consumes here: forward + backward + AdamW on the tiny preset."""
    cfg = tcfg.tiny()
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, t = 16, cfg.model.context
    x = torch.randint(0, cfg.model.vocab_size, (b, t + 1))
    def step() -> None:
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * b * t / (time.perf_counter() - t0), "tiny preset, CPU, fp32"


def _consumption_h100() -> float:
    """Tokens/s gpt2-124m needs on one H100 at the 45% MFU target (computed, not measured here)."""
    return 0.45 * gpu_peak_flops("NVIDIA H100 80GB HBM3") / preset_flops_per_token("gpt2-124m")


def _stdlib_corpus(tmp: Path, limit: int) -> tuple[Path, int]:
    """Up to `limit` bytes of the standard library's own *.py files, copied into one folder."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = collect_files([root], include=["*.py"], exclude=["site-packages/", "test/", "tests/", "idlelib/"])
    out, total = tmp / "stdlib", 0
    out.mkdir()
    for f in files:
        data = f.path.read_bytes()
        if total + len(data) > limit:
            break
        (out / f.rel.replace("/", "__")).write_bytes(data)
        total += len(data)
    return out, total


def run(quick: bool = False) -> list[Figure]:
    tokens = (1 << 23) if quick else (1 << 25)
    big_tokens = (1 << 23) if quick else (1 << 24)
    counter = _GetCounter()
    restore = _counting(counter)
    try:
        with local_s3("bench") as endpoint, tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            uri = "s3://bench/ds"
            synth(uri, tokens=tokens, seed=0, shard_tokens=tokens // 8, val_tokens=0, endpoint_url=endpoint)
            manifest_uri = f"{uri}/manifest.json"
            ds = open_dataset(manifest_uri, context=CONTEXT, cache_dir=str(tmp / "probe"), endpoint_url=endpoint,
                              read_mode="disk")
            epoch_steps = ds.num_windows // BATCH
            ds.close()
            cache = tmp / "cache"
            cold_s, cold_tok = _deliver(manifest_uri, endpoint, cache, epoch_steps)
            warm_s, warm_tok = _deliver(manifest_uri, endpoint, cache, epoch_steps)
            seal_s, hash_mbs, n_shards, shard_bytes = _verification(manifest_uri, endpoint, cache)
            naive_steps = 3 if quick else 8
            naive_s, naive_tok = _naive("bench", "ds", endpoint, naive_steps)

            big = "s3://bench/big"
            shards = 32
            synth(big, tokens=big_tokens, seed=1, shard_tokens=big_tokens // shards, val_tokens=0,
                  endpoint_url=endpoint)
            budget = 8 * (big_tokens // shards) * 2  # a quarter of the dataset
            blk = {m: _over_budget(big, endpoint, tmp / f"blk-{m}", budget, mode=m, blocks=True, steps=None,
                                   counter=counter) for m in ("disk", "memory")}
            old_steps = 4 if quick else 10
            old = _over_budget(big, endpoint, tmp / "old", budget, mode="disk", blocks=False, steps=old_steps,
                               counter=counter)
    finally:
        restore()
    cold, warm, naive = cold_tok / cold_s, warm_tok / warm_s, naive_tok / naive_s
    cpu_rate, cpu_what = _consumption_cpu()
    h100 = _consumption_h100()
    disk_s, disk_tok, disk_gets, _, n_big = blk["disk"]
    mem_s, mem_tok, mem_gets, _, _ = blk["memory"]
    old_s, _old_tok, old_gets, old_epoch_steps, _ = old
    old_per_epoch = old_gets / old_steps * old_epoch_steps / n_big
    over = disk_tok / disk_s
    shard_mb = shard_bytes / n_shards / 1e6
    return [
        Figure("data", "warm cache vs trainer consumption (here)", warm, "tokens/s", cpu_rate,
               f"trainer consumes ({cpu_what})", ratio(warm, cpu_rate), ">= 10x",
               ratio(warm, cpu_rate) is not None and ratio(warm, cpu_rate) >= 10),
        Figure("data", "warm cache vs gpt2-124m on one H100 at 45% MFU", warm, "tokens/s", h100,
               "computed consumption per GPU", ratio(warm, h100), ">= 10x",
               ratio(warm, h100) >= 10, notes="per data-loading process; one per GPU"),
        Figure("data", "cold cache (downloads included) vs trainer consumption (here)", cold, "tokens/s",
               cpu_rate, f"trainer consumes ({cpu_what})", ratio(cold, cpu_rate),
               notes=f"{tokens} tokens in 8 shards, one full epoch"),
        Figure("data", "warm cache vs naive GET per sample", warm, "tokens/s", naive, "naive loader",
               ratio(warm, naive), notes=f"naive: {naive_steps * BATCH} GETs"),
        Figure("data", "cold cache vs naive GET per sample", cold, "tokens/s", naive, "naive loader",
               ratio(cold, naive)),
        Figure("data", "dataset 4x the cache, block shuffle (disk), one epoch", over, "tokens/s", warm,
               "warm cache, dataset fits", ratio(over, warm),
               notes=f"{big_tokens} tokens in {n_big} shards; cache budget {budget / 1e6:.0f} MB, a quarter of "
               f"the data; blocks of {BLOCK} shards",
               extra={"gets_per_shard_per_epoch": disk_gets / n_big}),
        Figure("data", "dataset 4x the cache: shard GETs per shard per epoch, block shuffle", disk_gets / n_big,
               "GETs/shard/epoch", old_per_epoch, "whole-dataset shuffle, same budget",
               ratio(disk_gets / n_big, old_per_epoch), "<= 1", disk_gets / n_big <= 1,
               notes=f"whole-dataset shuffle extrapolated from {old_steps} steps ({old_gets} GETs, {old_s:.1f}s)"),
        Figure("data", "dataset 4x the cache, memory read mode (RAM working set, no disk copy)", mem_tok / mem_s,
               "tokens/s", over, "disk read mode", ratio(mem_tok / mem_s, over),
               extra={"gets_per_shard_per_epoch": mem_gets / n_big}),
        Figure("data", "verification: proving a cached shard by its seal", seal_s * 1e6, "us/shard",
               shard_mb / hash_mbs * 1e6, f"hashing it (sha256, {hash_mbs:.0f} MB/s)",
               ratio(seal_s * 1e6, shard_mb / hash_mbs * 1e6), notes=f"{shard_mb:.1f} MB shards"),
        Figure("data", "verification: full sha256 of the cache vs warm-cache delivery", hash_mbs, "MB/s",
               warm * 2 / 1e6, "warm cache delivery (uint16 tokens)", ratio(hash_mbs, warm * 2 / 1e6),
               notes="verify=full hashes each shard once per process"),
    ]
