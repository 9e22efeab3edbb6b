"""Tokenizers that work offline: byte-level (default), GPT-2's BPE from its own files, and a BPE trained
on the input, the last two through the ``tokenizers`` library.

Use::

    tok = ByteTokenizer()                             # vocab 257: bytes 0..255 + EOT 256
    tok = load_gpt2("/path/to/gpt2")                  # vocab.json + merges.txt (or encoder.json + vocab.bpe)
    tok = train_bpe(iter_of_texts, vocab_size=4096)   # byte-level BPE, EOT = "<|endoftext|>"
    ids = tok.encode("hello"); text = tok.decode(ids)
    ids_per_doc = tok.encode_batch(["a", "b"])
    tok = load_tokenizer(manifest, store)             # what a dataset was prepared with (sha256-checked)

GPT-2's encoding is OpenAI's byte-level BPE: 50,000 merges over 256 byte symbols plus ``<|endoftext|>``,
50,257 tokens. Its two files are published by OpenAI as ``encoder.json`` + ``vocab.bpe`` and by Hugging
Face with the same bytes as ``vocab.json`` + ``merges.txt``; their sha256 digests below identify them (the
same digests ``tiktoken`` checks before it uses them). Nothing here downloads anything: the user supplies
the files, once, and the dataset then carries them as ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from gpu_train.storage import Store
from trainer.data.errors import DataError, ManifestError
from trainer.data.manifest import Manifest
from trainer.data.synthetic import BYTE_EOT_ID, BYTE_VOCAB_SIZE

EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
GPT2_VOCAB_SIZE = 50257
# sha256 of GPT-2's encoder.json (= Hugging Face vocab.json) and vocab.bpe (= merges.txt), as checked by
# tiktoken's gpt2 encoding (https://github.com/openai/tiktoken, tiktoken_ext/openai_public.py).
GPT2_ENCODER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_GPT2_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...
    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...
    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    kind = "byte"
    name = ""
    vocab_size = BYTE_VOCAB_SIZE
    eot_id = BYTE_EOT_ID

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[(arr != self.eot_id) & (arr >= 0) & (arr < 256)]
        return bytes(arr.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A ``tokenizers`` byte-level BPE; ``to_json`` is what prepare stores next to the shards."""

    kind = "bpe"

    def __init__(self, tok: object, name: str = "trained") -> None:
        from tokenizers import Tokenizer as HfTokenizer

        if not isinstance(tok, HfTokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tok).__name__}")
        self._tok = tok
        self.name = name
        eot = tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise DataError(f"BPE tokenizer has no {EOT_TEXT!r} token")
        self.eot_id = int(eot)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        # Text that happens to contain "<|endoftext|>" is data, not a document boundary: encode it as
        # ordinary text (the boundaries are the EOT ids prepare inserts itself).
        tok.encode_special_tokens = True

    @classmethod
    def from_json(cls, text: str, name: str = "trained") -> BpeTokenizer:
        from tokenizers import Tokenizer as HfTokenizer

        return cls(HfTokenizer.from_str(text), name)

    def to_json(self) -> str:
        return self._tok.to_str()

    @staticmethod
    def _text(text: str | bytes) -> str:
        return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self._tok.encode(self._text(text), add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # encode_batch_fast skips the character offsets, which shards do not need.
        encs = self._tok.encode_batch_fast([self._text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        keep = [int(i) for i in ids if int(i) != self.eot_id and 0 <= int(i) < self.vocab_size]
        return self._tok.decode(keep, skip_special_tokens=True)


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
    return BpeTokenizer(tok, "trained")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gpt2_files(path: str | os.PathLike[str]) -> tuple[Path, Path] | Path:
    """(vocab, merges) in a GPT-2 tokenizer folder, or a ``tokenizer.json`` file; DataError naming ``path``."""
    p = Path(path)
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir():
        for vocab, merges in _GPT2_FILE_PAIRS:
            if (p / vocab).is_file() and (p / merges).is_file():
                return p / vocab, p / merges
        if (p / TOKENIZER_FILE).is_file():
            return p / TOKENIZER_FILE
    raise DataError(
        f"--tokenizer-file {p}: expected a folder with vocab.json + merges.txt (Hugging Face) or "
        "encoder.json + vocab.bpe (OpenAI), or a tokenizer.json file"
    )


def load_gpt2(path: str | os.PathLike[str]) -> BpeTokenizer:
    """GPT-2's byte-level BPE from user-supplied files (see ``gpt2_files``); no network.

    The result's ``name`` is ``"gpt2"`` when the files are GPT-2's own (by sha256) and ``"gpt2-format"``
    for another vocabulary in the same format.
    """
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    found = gpt2_files(path)
    try:
        if isinstance(found, Path):
            tok = HfTokenizer.from_file(str(found))
            canonical = False
        else:
            vocab, merges = found
            canonical = (
                _file_sha256(vocab) == GPT2_ENCODER_SHA256 and _file_sha256(merges) == GPT2_MERGES_SHA256
            )
            # The GPT-2 pipeline: the byte-to-unicode mapping and GPT-2's split regex (ByteLevel with
            # use_regex), no prefix space, BPE over the two files.
            tok = HfTokenizer(models.BPE.from_file(str(vocab), str(merges)))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
            if tok.token_to_id(EOT_TEXT) is not None:
                tok.add_special_tokens([EOT_TEXT])
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise DataError(f"--tokenizer-file {path}: not a readable GPT-2 tokenizer ({exc})") from exc
    except Exception as exc:  # tokenizers raises its own Exception type for malformed files
        raise DataError(f"--tokenizer-file {path}: not a readable GPT-2 tokenizer ({exc})") from exc
    if tok.token_to_id(EOT_TEXT) is None:
        raise DataError(f"--tokenizer-file {path}: the vocabulary has no {EOT_TEXT!r} token")
    bpe = BpeTokenizer(tok, "gpt2" if canonical else "gpt2-format")
    if canonical and (bpe.vocab_size != GPT2_VOCAB_SIZE or bpe.eot_id != GPT2_VOCAB_SIZE - 1):
        raise DataError(
            f"--tokenizer-file {path}: GPT-2's files gave {bpe.vocab_size} tokens, expected 50257"
        )
    return bpe


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
    return tokenizer_from_json(
        raw.decode(), info.eot_id, info.vocab_size, info.name, store.url_of(info.file.file)
    )


def tokenizer_from_json(text: str, eot_id: int, vocab_size: int, name: str, where: str) -> BpeTokenizer:
    """A stored tokenizer.json, checked against the EOT id and vocabulary size the manifest records."""
    try:
        tok = BpeTokenizer.from_json(text, name or "trained")
    except Exception as exc:  # tokenizers' own exception type for malformed JSON
        raise ManifestError(f"{where}: not a tokenizers JSON file ({exc})") from exc
    if tok.eot_id != eot_id or tok.vocab_size != vocab_size:
        raise ManifestError(
            f"{where}: eot/vocab ({tok.eot_id}/{tok.vocab_size}) differ from the manifest ({eot_id}/{vocab_size})"
        )
    return tok
