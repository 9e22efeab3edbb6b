"""The trainer's data path: token shards in object storage -> verified local bytes -> deterministic windows.

Use::

    from trainer.data import open_dataset, GlobalSampler
    ds = open_dataset(cfg.data.uri, context=T, cache_dir=..., prefetch_shards=K)
    sampler = GlobalSampler(ds.num_windows, global_batch=B, seed=S,
                            shard_windows=ds.shard_windows, block_shards=4)
    ds.fetch_ahead(sampler.upcoming_shards(step, 8))         # shards this and the next steps read
    xy = ds.batch(sampler.rank_slice(step, rank, world))     # x = xy[:, :-1], y = xy[:, 1:]
    xy, indices = read_step(ds, sampler, step, rank, world)  # the same two lines, as the trainer does them
    val = open_dataset(cfg.data.uri, context=T, split="val") # the held-out split, for trainer.evaluate

``python -m trainer.data --help`` prepares datasets (``prepare``, ``synth``) and checks them (``verify``).
See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from trainer.data.dataset import Dataset, MemorySource
from trainer.data.errors import (
    DataError,
    DatasetTooShortError,
    ManifestError,
    SamplerStateError,
    ShardError,
    ShardIntegrityError,
    ShardMissingError,
    is_transient,
)
from trainer.data.sampler import DEFAULT_BLOCK_SHARDS, GlobalSampler
from trainer.data.synthetic import BYTE_EOT_ID, BYTE_VOCAB_SIZE, VAL_STREAM, synthetic_shards

__all__ = [
    "DEFAULT_BLOCK_SHARDS",
    "DataError",
    "Dataset",
    "DatasetTooShortError",
    "GlobalSampler",
    "ManifestError",
    "SamplerStateError",
    "ShardError",
    "ShardIntegrityError",
    "ShardMissingError",
    "is_transient",
    "open_dataset",
    "open_tokenizer",
    "read_step",
]

SYNTHETIC = "synthetic"
SYNTHETIC_TOKENS = 1 << 20
SYNTHETIC_VAL_TOKENS = 1 << 16
SYNTHETIC_SHARD_TOKENS = 1 << 18


def open_dataset(
    uri: str,
    context: int,
    cache_dir: str | None = None,
    cache_max_bytes: int | None = None,
    prefetch_shards: int = 2,
    endpoint_url: str | None = None,
    *,
    packing: bool = True,
    seed: int = 0,
    split: str = "train",
    read_mode: str = "auto",
    verify: str = "seal",
    cache_disk_fraction: float = 0.5,
    memory_dir: str | None = None,
    max_open_shards: int = 16,
    endpoint_auth: str | None = None,
) -> Dataset:
    """Open a dataset by manifest URI (file://, s3://, gs://) or the in-memory ``"synthetic"`` one.

    ``uri`` may name the manifest itself or the folder holding ``manifest.json``. ``cache_dir`` None means
    the shared per-user cache (``trainer.data.shards.default_cache_dir``). ``cache_max_bytes`` None or 0
    derives the budget from the disk holding the cache (``cache_disk_fraction`` of it, see
    ``trainer.data.cache.disk_budget``). ``packing=False`` keeps every window inside one document.
    ``split`` is ``"train"`` or ``"val"`` (the held-out split written by ``prepare --val-fraction``).
    ``read_mode`` and ``verify`` are described in ``trainer.data.shards`` and ``trainer.data.cache``;
    ``endpoint_auth`` ("auto", "sigv4", "unsigned"; None: env TRAINER_S3_AUTH, else "auto") in
    ``gpu_train.storage``.
    ``seed`` only changes the synthetic data.
    """
    if uri == SYNTHETIC:
        if split not in ("train", "val"):
            raise DataError(f"dataset split must be one of train, val (got {split!r})")
        tokens = SYNTHETIC_TOKENS if split == "train" else SYNTHETIC_VAL_TOKENS
        stream = 0 if split == "train" else VAL_STREAM
        shards = synthetic_shards(tokens, seed=seed, shard_tokens=SYNTHETIC_SHARD_TOKENS, stream=stream)
        ident = {"synthetic": {"tokens": SYNTHETIC_TOKENS, "seed": seed, "shard": SYNTHETIC_SHARD_TOKENS}}
        return Dataset(
            MemorySource([t for t, _ in shards], [d for _, d in shards]),
            uri=uri,
            context=context,
            packing=packing,
            vocab_size=BYTE_VOCAB_SIZE,
            eot_id=BYTE_EOT_ID,
            manifest_sha256=hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest(),
            prefetch_shards=prefetch_shards,
            split=split,
        )
    from gpu_train.storage import StoreOptions
    from trainer.data.shards import open_sharded

    return open_sharded(
        uri,
        context=context,
        cache_dir=cache_dir,
        cache_max_bytes=cache_max_bytes,
        prefetch_shards=prefetch_shards,
        endpoint_url=endpoint_url,
        packing=packing,
        split=split,
        read_mode=read_mode,
        verify=verify,
        cache_disk_fraction=cache_disk_fraction,
        memory_dir=memory_dir,
        max_open_shards=max_open_shards,
        store_options=StoreOptions(auth=endpoint_auth) if endpoint_auth else None,
    )


def read_step(ds: Dataset, sampler: GlobalSampler, step: int, rank: int, world: int, *,
              end_step: int | None = None) -> tuple[np.ndarray, list[int]]:
    """This rank's windows of global batch ``step`` (rows of ``context + 1`` tokens) and their indices, after
    handing the shards of the current and the next block (the next ``2 * block_shards`` shards the run reads,
    none past ``end_step``) to the dataset, which fetches and pins them in the background."""
    indices = sampler.rank_slice(step, rank, world)
    ds.fetch_ahead(sampler.upcoming_shards(step, 2 * max(1, sampler.block_shards), end_step=end_step))
    return ds.batch(indices), indices


def open_tokenizer(uri: str, endpoint_url: str | None = None, options=None):  # -> trainer.data.tokenizer.Tokenizer
    """The tokenizer a dataset was prepared with (byte-level for ``"synthetic"``), sha256-checked; `options` are the
    store's (gpu_train.storage.StoreOptions)."""
    from trainer.data.tokenizer import ByteTokenizer, load_tokenizer

    if uri == SYNTHETIC:
        return ByteTokenizer()
    from gpu_train.storage import open_store
    from trainer.data.shards import read_manifest, split_manifest_uri

    root, key = split_manifest_uri(uri)
    store = open_store(root, endpoint_url=endpoint_url, options=options)
    manifest, _ = read_manifest(store, key)
    return load_tokenizer(manifest, store)
