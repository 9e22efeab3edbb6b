"""The trainer's data path: token shards in object storage -> local cache -> deterministic windows.

Use::

    from trainer.data import open_dataset, GlobalSampler
    ds = open_dataset(cfg.data.uri, context=T, cache_dir=..., cache_max_bytes=..., prefetch_shards=K)
    sampler = GlobalSampler(ds.num_windows, global_batch=B, seed=S)
    xy = ds.batch(sampler.rank_slice(step, rank, world))     # x = xy[:, :-1], y = xy[:, 1:]

``python -m trainer.data --help`` prepares datasets (``prepare``, ``synth``) and checks them (``verify``).
See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json

from trainer.data.dataset import Dataset, MemorySource
from trainer.data.errors import (
    DataError,
    ManifestError,
    SamplerStateError,
    ShardError,
    ShardIntegrityError,
    ShardMissingError,
)
from trainer.data.sampler import GlobalSampler
from trainer.data.synthetic import BYTE_EOT_ID, BYTE_VOCAB_SIZE, synthetic_shards

__all__ = [
    "DataError",
    "Dataset",
    "GlobalSampler",
    "ManifestError",
    "SamplerStateError",
    "ShardError",
    "ShardIntegrityError",
    "ShardMissingError",
    "open_dataset",
]

SYNTHETIC = "synthetic"
SYNTHETIC_TOKENS = 1 << 20
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
) -> Dataset:
    """Open a dataset by manifest URI (file://, s3://, gs://) or the in-memory ``"synthetic"`` one.

    ``uri`` may name the manifest itself or the folder holding ``manifest.json``. ``cache_max_bytes``
    None or 0 means no budget. ``packing=False`` keeps every window inside one document. ``seed`` only
    changes the synthetic data.
    """
    if uri == SYNTHETIC:
        shards = synthetic_shards(SYNTHETIC_TOKENS, seed=seed, shard_tokens=SYNTHETIC_SHARD_TOKENS)
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
        )
    from trainer.data.shards import open_sharded

    return open_sharded(
        uri,
        context=context,
        cache_dir=cache_dir,
        cache_max_bytes=cache_max_bytes,
        prefetch_shards=prefetch_shards,
        endpoint_url=endpoint_url,
        packing=packing,
    )
