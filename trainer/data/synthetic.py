"""A deterministic, learnable byte-level token stream for tests and ``make train``.

Use::

    from trainer.data.synthetic import synthetic_documents
    docs = synthetic_documents(num_tokens=1 << 20, seed=0)   # list[bytes], each one document

or ``python -m trainer.data synth --out file:///tmp/synth`` to write it as a real sharded dataset, or
``open_dataset("synthetic", context=T)`` to use it in memory.

The text is made of a small fixed vocabulary of made-up words chained by a sparse word-level Markov
chain (each word has only two possible successors). Inside a word every next byte is fixed, and between
words there are only two choices, so the entropy is well under one bit per byte: a tiny GPT drops from
ln(257) ~ 5.5 nats to below 1.5 within about a hundred steps, which is what a smoke test needs to see.
"""

from __future__ import annotations

import numpy as np

from trainer.data.pack import pack_documents

BYTE_VOCAB_SIZE = 257  # 256 byte values + the end-of-text token
BYTE_EOT_ID = 256

_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


def _lexicon(rng: np.random.Generator, n_words: int) -> list[bytes]:
    words: list[bytes] = []
    seen: set[bytes] = set()
    while len(words) < n_words:
        word = bytes(rng.choice(_LETTERS, size=int(rng.integers(2, 7))).tolist())
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


VAL_STREAM = 1  # the held-out split: other documents of the same language (same lexicon and chain)


def synthetic_documents(num_tokens: int, seed: int = 0, n_words: int = 24, stream: int = 0) -> list[bytes]:
    """Documents whose bytes plus one EOT each add up to at least ``num_tokens`` tokens.

    ``seed`` picks the language (lexicon and chain); ``stream`` picks which documents of it (0: training,
    ``VAL_STREAM``: the held-out split).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1 (got {num_tokens})")
    rng = np.random.default_rng([0x5EED, seed])
    words = _lexicon(rng, n_words)
    successors = rng.integers(0, n_words, size=(n_words, 2))
    if stream:
        rng = np.random.default_rng([0x5EED, seed, stream])
    docs: list[bytes] = []
    total = 0
    while total < num_tokens:
        doc_words = int(rng.integers(20, 200))
        coins = rng.integers(0, 2, size=doc_words)
        word = int(rng.integers(0, n_words))
        parts = []
        for coin in coins.tolist():
            parts.append(words[word])
            word = int(successors[word, coin])
        doc = b" ".join(parts) + b".\n"
        docs.append(doc)
        total += len(doc) + 1
    return docs


def synthetic_shards(
    num_tokens: int = 1 << 20, seed: int = 0, shard_tokens: int = 1 << 18, stream: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(uint16 tokens, document starts) per shard, byte-level with EOT 256: exactly what ``synth`` writes."""
    docs = (np.frombuffer(d, dtype=np.uint8) for d in synthetic_documents(num_tokens, seed, stream=stream))
    return list(pack_documents(docs, eot_id=BYTE_EOT_ID, shard_tokens=shard_tokens, dtype="uint16"))
