"""Pack tokenized documents into shards: each document followed by EOT, shards cut at document starts.

Use::

    from trainer.data.pack import Packer, pack_documents
    for tokens, doc_starts in pack_documents(docs, eot_id=256, shard_tokens=1 << 26, dtype="uint16"):
        ...   # tokens: 1-D array for one shard, doc_starts: offsets of the documents starting in it

    packer = Packer(eot_id=256, shard_tokens=1 << 26, dtype="uint16")   # push style, for several splits
    for shard in packer.add(doc): ...
    for shard in packer.finish(): ...

A shard is closed before a document that would overflow it, so documents do not straddle shards. A single
document longer than a whole shard is cut into shard-sized pieces; each piece counts as a document of its
own (so non-packed windows never span two shards).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

Shard = tuple[np.ndarray, np.ndarray]


class Packer:
    """Push documents in, get finished (tokens, doc_starts) shards out, in order."""

    def __init__(self, *, eot_id: int, shard_tokens: int, dtype: str) -> None:
        if shard_tokens < 2:
            raise ValueError(f"shard_tokens must be >= 2 (got {shard_tokens})")
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self._eot = np.asarray([eot_id], dtype=dtype)
        self._parts: list[np.ndarray] = []
        self._starts: list[int] = []
        self._filled = 0

    def _flush(self) -> Shard:
        out = (np.concatenate(self._parts).astype(self.dtype, copy=False), np.asarray(self._starts, np.int64))
        self._parts, self._starts, self._filled = [], [], 0
        return out

    def add(self, doc: np.ndarray) -> list[Shard]:
        """Append one document (+ EOT); returns the shards this completed (usually none)."""
        done: list[Shard] = []
        full = np.concatenate([np.asarray(doc, dtype=self.dtype), self._eot])
        if self._filled and self._filled + full.size > self.shard_tokens:
            done.append(self._flush())
        if full.size > self.shard_tokens:
            for lo in range(0, full.size, self.shard_tokens):
                piece = full[lo : lo + self.shard_tokens]
                self._parts, self._starts, self._filled = [piece], [0], piece.size
                if piece.size == self.shard_tokens:
                    done.append(self._flush())
            return done
        self._starts.append(self._filled)
        self._parts.append(full)
        self._filled += full.size
        return done

    def finish(self) -> list[Shard]:
        """The last, partly filled shard (if any)."""
        return [self._flush()] if self._filled else []


def pack_documents(
    docs: Iterable[np.ndarray], *, eot_id: int, shard_tokens: int, dtype: str
) -> Iterator[Shard]:
    packer = Packer(eot_id=eot_id, shard_tokens=shard_tokens, dtype=dtype)
    for doc in docs:
        yield from packer.add(doc)
    yield from packer.finish()
