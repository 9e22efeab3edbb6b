"""Tokenizers that work offline: byte-level (default) and a BPE trained on the input with ``tokenizers``.

Use::

    tok = ByteTokenizer()                         # vocab 257: bytes 0..255 + EOT 256
    tok = train_bpe(iter_of_texts, vocab_size=4096)   # byte-level BPE, EOT = "<|endoftext|>"
    ids = tok.encode("hello"); text = tok.decode(ids)
    tok = load_tokenizer(manifest, store)         # what a dataset was prepared with (sha256-checked)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from trainer.data.errors import DataError, ManifestError
from trainer.data.manifest import Manifest
from trainer.data.storage import Store
from trainer.data.synthetic import BYTE_EOT_ID, BYTE_VOCAB_SIZE

EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...
    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    kind = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eot_id = BYTE_EOT_ID

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        return bytes(arr[arr != self.eot_id].astype(np.uint8).tolist()).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A ``tokenizers`` byte-level BPE; ``to_json`` is what prepare stores next to the shards."""

    kind = "bpe"

    def __init__(self, tok: object) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        if not isinstance(tok, HfTokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tok).__name__}")
        self._tok = tok
        eot = tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise DataError(f"BPE tokenizer has no {EOT_TEXT!r} token")
        self.eot_id = int(eot)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_json(cls, text: str) -> BpeTokenizer:
        from tokenizers import Tokenizer as HfTokenizer

        return cls(HfTokenizer.from_str(text))

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eot_id], skip_special_tokens=True)


def train_bpe(texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
    """Train a byte-level BPE on ``texts`` (the ``tokenizers`` trainer runs multi-threaded in Rust)."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(
            f"--vocab-size must be >= {len(alphabet) + 1} for a byte-level BPE (got {vocab_size})"
        )
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TEXT], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BpeTokenizer(tok)


def load_tokenizer(manifest: Manifest, store: Store) -> Tokenizer:
    """The tokenizer a dataset was prepared with; a BPE file must match the manifest's sha256."""
    info = manifest.tokenizer
    if info.kind == "byte":
        return ByteTokenizer()
    assert info.file is not None
    raw = store.get_bytes(info.file.file)
    if hashlib.sha256(raw).hexdigest() != info.file.sha256:
        raise ManifestError(
            f"{store.url_of(info.file.file)}: sha256 differs from manifest key 'tokenizer.sha256'"
        )
    tok = BpeTokenizer.from_json(raw.decode())
    if tok.eot_id != info.eot_id or tok.vocab_size != info.vocab_size:
        raise ManifestError(
            f"{store.url_of(info.file.file)}: eot/vocab ({tok.eot_id}/{tok.vocab_size}) differ from the manifest "
            f"({info.eot_id}/{info.vocab_size})"
        )
    return tok
