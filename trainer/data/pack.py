"""Pack tokenized documents into shards: each document followed by EOT, shards cut at document starts.

Use::

    from trainer.data.pack import pack_documents
    for tokens, doc_starts in pack_documents(docs, eot_id=256, shard_tokens=1 << 26, dtype="uint16"):
        ...   # tokens: 1-D array for one shard, doc_starts: offsets of the documents starting in it

A shard is closed before a document that would overflow it, so documents do not straddle shards. A single
document longer than a whole shard is cut into shard-sized pieces; each piece counts as a document of its
own (so non-packed windows never span two shards).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


def pack_documents(
    docs: Iterable[np.ndarray], *, eot_id: int, shard_tokens: int, dtype: str
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    if shard_tokens < 2:
        raise ValueError(f"shard_tokens must be >= 2 (got {shard_tokens})")
    parts: list[np.ndarray] = []
    starts: list[int] = []
    filled = 0

    def flush() -> tuple[np.ndarray, np.ndarray]:
        nonlocal parts, starts, filled
        out = (np.concatenate(parts).astype(dtype, copy=False), np.asarray(starts, dtype=np.int64))
        parts, starts, filled = [], [], 0
        return out

    eot = np.asarray([eot_id], dtype=dtype)
    for doc in docs:
        full = np.concatenate([np.asarray(doc, dtype=dtype), eot])
        if filled and filled + full.size > shard_tokens:
            yield flush()
        if full.size > shard_tokens:
            for lo in range(0, full.size, shard_tokens):
                piece = full[lo : lo + shard_tokens]
                if piece.size == shard_tokens:
                    parts, starts, filled = [piece], [0], piece.size
                    yield flush()
                else:
                    parts, starts, filled = [piece], [0], piece.size
            continue
        starts.append(filled)
        parts.append(full)
        filled += full.size
    if filled:
        yield flush()
