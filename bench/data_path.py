"""Data path: tokens/s the sampler + shard cache deliver from a local S3 server, cold and warm, against
what the trainer consumes and against a naive loader that GETs every sample on its own.

Usage: `python -m bench --only data`.

All readers run in this process, one after the other, over the same dataset in a moto S3 server on
localhost, reading the same global batches in the same order (GlobalSampler, seed 0).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import boto3
import numpy as np
import torch

from bench.common import Figure, local_s3, preset_flops_per_token, ratio
from trainer import config as tcfg
from trainer.data import GlobalSampler, open_dataset
from trainer.data.prepare import synth
from trainer.flops import gpu_peak_flops
from trainer.model import GPT

CONTEXT = 1024
BATCH = 32  # sequences per global batch


def _deliver(uri: str, endpoint: str, cache_dir: Path, steps: int) -> tuple[float, int]:
    """Seconds to deliver `steps` global batches (prefetching the next batch's shards), and tokens."""
    t0 = time.perf_counter()
    ds = open_dataset(uri, context=CONTEXT, cache_dir=str(cache_dir), cache_max_bytes=1 << 34,
                      prefetch_shards=4, endpoint_url=endpoint)
    sampler = GlobalSampler(ds.num_windows, global_batch=BATCH, seed=0)
    tokens = 0
    for step in range(steps):
        idx = sampler.global_batch(step)
        ds.prefetch(sampler.global_batch(step + 1))
        batch = ds.batch(idx)
        tokens += batch.shape[0] * (batch.shape[1] - 1)
    ds.close()
    return time.perf_counter() - t0, tokens


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
    """Tokens/s gpt2-124m needs on one H100 at the 40% MFU target (computed, not measured here)."""
    return 0.40 * gpu_peak_flops("NVIDIA H100 80GB HBM3") / preset_flops_per_token("gpt2-124m")


def run(quick: bool = False) -> list[Figure]:
    tokens = (1 << 23) if quick else (1 << 25)
    with local_s3("bench") as endpoint, tempfile.TemporaryDirectory() as tmp:
        uri = "s3://bench/ds"
        synth(uri, tokens=tokens, seed=0, shard_tokens=tokens // 8, endpoint_url=endpoint)
        manifest_uri = f"{uri}/manifest.json"
        ds = open_dataset(manifest_uri, context=CONTEXT, cache_dir=str(Path(tmp) / "probe"), endpoint_url=endpoint)
        epoch_steps = ds.num_windows // BATCH
        ds.close()
        cache = Path(tmp) / "cache"
        cold_s, cold_tok = _deliver(manifest_uri, endpoint, cache, epoch_steps)
        warm_s, warm_tok = _deliver(manifest_uri, endpoint, cache, epoch_steps)
        naive_steps = 3 if quick else 8
        naive_s, naive_tok = _naive("bench", "ds", endpoint, naive_steps)
    cold = cold_tok / cold_s
    warm = warm_tok / warm_s
    naive = naive_tok / naive_s
    cpu_rate, cpu_what = _consumption_cpu()
    h100 = _consumption_h100()
    return [
        Figure("data", "warm cache vs trainer consumption (here)", warm, "tokens/s", cpu_rate,
               f"trainer consumes ({cpu_what})", ratio(warm, cpu_rate), ">= 10x",
               ratio(warm, cpu_rate) is not None and ratio(warm, cpu_rate) >= 10),
        Figure("data", "warm cache vs gpt2-124m on one H100 at 40% MFU", warm, "tokens/s", h100,
               "computed consumption per GPU", ratio(warm, h100), ">= 10x",
               ratio(warm, h100) >= 10, notes="per data-loading process; one per GPU"),
        Figure("data", "cold cache (downloads included) vs trainer consumption (here)", cold, "tokens/s",
               cpu_rate, f"trainer consumes ({cpu_what})", ratio(cold, cpu_rate),
               notes=f"{tokens} tokens in 8 shards, one full epoch"),
        Figure("data", "warm cache vs naive GET per sample", warm, "tokens/s", naive, "naive loader",
               ratio(warm, naive), notes=f"naive: {naive_steps * BATCH} GETs"),
        Figure("data", "cold cache vs naive GET per sample", cold, "tokens/s", naive, "naive loader",
               ratio(cold, naive)),
    ]
