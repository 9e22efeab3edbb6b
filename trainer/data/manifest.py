"""The dataset manifest (``manifest.json``): what a sharded token dataset is made of.

Use::

    from trainer.data.manifest import Manifest
    m = Manifest.parse(raw_bytes, uri="s3://bucket/ds/manifest.json")   # validates, errors name the key
    raw = m.to_json()

Layout (format version 1)::

    {"format": "gpu-train-token-shards", "version": 1,
     "tokenizer": {"kind": "byte"|"bpe", "vocab_size": 257, "eot_id": 256,
                   "name": "gpt2"|"trained",                             # bpe only, informative
                   "file": "tokenizer.json", "sha256": "...", "bytes": n}, # file/sha256 for bpe only
     "dtype": "uint16"|"uint32", "total_tokens": N, "num_documents": D,
     "shards": [{"file": "shard-000000.bin", "tokens": n, "bytes": n*itemsize, "sha256": "...",
                 "documents": d,
                 "index": {"file": "shard-000000.idx", "bytes": 8*d, "sha256": "..."}}],
     "val": {"fraction": 0.01, "shards": [...]},          # optional held-out split, same shard objects
     "source": {"fingerprint": "...", ...}}                 # optional: what prepare read, to skip redoing it

A shard is the raw little-endian token array. Its ``.idx`` file holds the start offset (uint64, little
endian) of every document that begins in the shard; only non-packed reading needs it. ``val`` and
``source`` are optional additions to version 1: a reader that does not know them still reads the
training split correctly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_train.spec.naming import DATASET_MANIFEST
from trainer.data.errors import ManifestError

FORMAT = "gpu-train-token-shards"
VERSION = 1
MANIFEST_NAME = DATASET_MANIFEST
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 while every token id fits (ids < 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class FileRef:
    """One object next to the manifest: file name (relative key), size in bytes, sha256 hex."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TokenizerInfo:
    kind: str  # "byte" or "bpe"
    vocab_size: int
    eot_id: int
    file: FileRef | None = None  # the tokenizers JSON, bpe only
    name: str = ""  # bpe only: "gpt2" (GPT-2's vocabulary) or "trained" (learned from the input)


@dataclass(frozen=True)
class ShardInfo:
    data: FileRef
    tokens: int
    documents: int
    index: FileRef

    @property
    def file(self) -> str:
        return self.data.file


SPLITS = ("train", "val")


def shard_doc(s: ShardInfo) -> dict[str, Any]:
    """A shard as the manifest (and a prepare task's commit) writes it."""
    return {
        "file": s.data.file,
        "tokens": s.tokens,
        "bytes": s.data.bytes,
        "sha256": s.data.sha256,
        "documents": s.documents,
        "index": {"file": s.index.file, "bytes": s.index.bytes, "sha256": s.index.sha256},
    }


def parse_shards(docs: Any, uri: str, where: str, dtype: str, names: set[str]) -> tuple[ShardInfo, ...]:
    """Shard objects as written by ``shard_doc``, checked as a manifest's are (errors name ``uri`` and ``where``)."""
    if not isinstance(docs, list):
        raise ManifestError(f"{uri}: key '{where}' must be a list (got {type(docs).__name__})")
    return _Reader(uri).shards(docs, where, dtype, names)


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerInfo
    dtype: str
    shards: tuple[ShardInfo, ...]
    val_shards: tuple[ShardInfo, ...] = ()
    val_fraction: float = 0.0
    source: dict[str, Any] | None = None

    def split(self, name: str) -> tuple[ShardInfo, ...]:
        """Shards of split ``name`` ("train" or "val")."""
        if name not in SPLITS:
            raise ManifestError(f"unknown split {name!r}: a dataset has splits {', '.join(SPLITS)}")
        return self.shards if name == "train" else self.val_shards

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def val_tokens(self) -> int:
        return sum(s.tokens for s in self.val_shards)

    @property
    def val_documents(self) -> int:
        return sum(s.documents for s in self.val_shards)

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        tok: dict[str, Any] = {
            "kind": self.tokenizer.kind,
            "vocab_size": self.tokenizer.vocab_size,
            "eot_id": self.tokenizer.eot_id,
        }
        if self.tokenizer.name:
            tok["name"] = self.tokenizer.name
        if self.tokenizer.file is not None:
            tok["file"] = self.tokenizer.file.file
            tok["sha256"] = self.tokenizer.file.sha256
            tok["bytes"] = self.tokenizer.file.bytes

        def shard_docs(shards: tuple[ShardInfo, ...]) -> list[dict[str, Any]]:
            return [shard_doc(s) for s in shards]

        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tok,
            "dtype": self.dtype,
            "total_tokens": self.total_tokens,
            "num_documents": self.num_documents,
            "shards": shard_docs(self.shards),
        }
        if self.val_shards or self.val_fraction:
            doc["val"] = {
                "fraction": self.val_fraction,
                "total_tokens": self.val_tokens,
                "num_documents": self.val_documents,
                "shards": shard_docs(self.val_shards),
            }
        if self.source is not None:
            doc["source"] = self.source
        return doc

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n").encode()

    # -- parsing -----------------------------------------------------------------------------------
    @classmethod
    def parse(cls, raw: bytes, uri: str) -> Manifest:
        """Validate and load a manifest; every error names ``uri`` and the offending key."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{uri}: manifest is not valid JSON ({exc})") from exc
        p = _Reader(uri)
        root = p.obj(doc, "")
        fmt = p.field(root, "", "format", str)
        if fmt != FORMAT:
            raise ManifestError(f"{uri}: key 'format' must be {FORMAT!r} (got {fmt!r})")
        version = p.field(root, "", "version", int)
        if version != VERSION:
            raise ManifestError(f"{uri}: key 'version' is {version}; this trainer reads version {VERSION}")
        tokenizer = p.tokenizer(root)
        vocab = tokenizer.vocab_size
        dtype = p.field(root, "", "dtype", str)
        if dtype not in DTYPES:
            raise ManifestError(f"{uri}: key 'dtype' must be one of {sorted(DTYPES)} (got {dtype!r})")
        if dtype != dtype_for_vocab(vocab) and dtype == "uint16":
            raise ManifestError(f"{uri}: key 'dtype' uint16 cannot hold vocab_size {vocab}")
        names: set[str] = set()
        shards = p.shards(p.field(root, "", "shards", list), "shards", dtype, names)
        if not shards:
            raise ManifestError(f"{uri}: key 'shards' is empty")
        val_shards: tuple[ShardInfo, ...] = ()
        val_fraction = 0.0
        if "val" in root:
            val_doc = p.obj(root["val"], "val")
            val_shards = p.shards(p.field(val_doc, "val", "shards", list), "val.shards", dtype, names)
            fraction = p.number(val_doc, "val", "fraction") if "fraction" in val_doc else 0.0
            if not 0 <= fraction < 1:
                raise ManifestError(f"{uri}: key 'val.fraction' must be in [0, 1) (got {fraction})")
            val_fraction = fraction
        source = p.obj(root["source"], "source") if "source" in root else None
        return cls(
            tokenizer=tokenizer,
            dtype=dtype,
            shards=shards,
            val_shards=val_shards,
            val_fraction=val_fraction,
            source=source,
        )


class _Reader:
    """Typed field access whose errors carry the manifest URI and the dotted key."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    def tokenizer(self, root: dict[str, Any]) -> TokenizerInfo:
        """The manifest's `tokenizer` object."""
        p, uri = self, self.uri
        tok_doc = p.obj(p.field(root, "", "tokenizer", dict), "tokenizer")
        kind = p.field(tok_doc, "tokenizer", "kind", str)
        if kind not in ("byte", "bpe"):
            raise ManifestError(f"{uri}: key 'tokenizer.kind' must be 'byte' or 'bpe' (got {kind!r})")
        vocab = p.positive(tok_doc, "tokenizer", "vocab_size")
        eot = p.field(tok_doc, "tokenizer", "eot_id", int)
        if not 0 <= eot < vocab:
            raise ManifestError(f"{uri}: key 'tokenizer.eot_id' ({eot}) must be in [0, vocab_size={vocab})")
        tok_file = None
        tok_name = ""
        if kind == "bpe":
            tok_file = FileRef(
                p.name(tok_doc, "tokenizer", "file"),
                p.field(tok_doc, "tokenizer", "bytes", int) if "bytes" in tok_doc else -1,
                p.sha(tok_doc, "tokenizer", "sha256"),
            )
            tok_name = p.field(tok_doc, "tokenizer", "name", str) if "name" in tok_doc else ""
        return TokenizerInfo(kind, vocab, eot, tok_file, tok_name)

    def shards(self, docs: list[Any], prefix: str, dtype: str, names: set[str]) -> tuple[ShardInfo, ...]:
        """A list of shard objects; `names` collects the file names, which must be unique across lists."""
        p, uri, itemsize = self, self.uri, DTYPES[dtype].itemsize
        shards = []
        for i, raw_shard in enumerate(docs):
            where = f"{prefix}[{i}]"
            sd = p.obj(raw_shard, where)
            tokens = p.positive(sd, where, "tokens")
            data = FileRef(
                p.name(sd, where, "file"), p.positive(sd, where, "bytes"), p.sha(sd, where, "sha256")
            )
            if data.bytes != tokens * itemsize:
                raise ManifestError(
                    f"{uri}: key '{where}.bytes' ({data.bytes}) != tokens ({tokens}) x {itemsize} ({dtype})"
                )
            documents = p.field(sd, where, "documents", int)
            idx_doc = p.obj(p.field(sd, where, "index", dict), f"{where}.index")
            index = FileRef(
                p.name(idx_doc, f"{where}.index", "file"),
                p.field(idx_doc, f"{where}.index", "bytes", int),
                p.sha(idx_doc, f"{where}.index", "sha256"),
            )
            if documents < 0 or index.bytes != 8 * documents:
                raise ManifestError(
                    f"{uri}: key '{where}.index.bytes' ({index.bytes}) must be 8 x documents ({documents})"
                )
            for name in (data.file, index.file):
                if name in names:
                    raise ManifestError(f"{uri}: key '{where}' reuses file name {name!r}")
                names.add(name)
            shards.append(ShardInfo(data=data, tokens=tokens, documents=documents, index=index))
        return tuple(shards)

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            what = f"key '{where}'" if where else "top level"
            raise ManifestError(f"{self.uri}: {what} must be a JSON object (got {type(value).__name__})")
        return value

    def field(self, obj: dict[str, Any], where: str, key: str, typ: type) -> Any:
        full = f"{where}.{key}" if where else key
        if key not in obj:
            raise ManifestError(f"{self.uri}: missing key '{full}'")
        value = obj[key]
        # bool is an int subclass in Python; a JSON true is never a valid count.
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ManifestError(
                f"{self.uri}: key '{full}' must be {typ.__name__} (got {type(value).__name__} {value!r})"
            )
        return value

    def number(self, obj: dict[str, Any], where: str, key: str) -> float:
        value = obj[key]
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ManifestError(
                f"{self.uri}: key '{where}.{key}' must be a number (got {type(value).__name__} {value!r})"
            )
        return float(value)

    def positive(self, obj: dict[str, Any], where: str, key: str) -> int:
        value = self.field(obj, where, key, int)
        if value < 1:
            raise ManifestError(f"{self.uri}: key '{where}.{key}' must be >= 1 (got {value})")
        return value

    def sha(self, obj: dict[str, Any], where: str, key: str) -> str:
        value = self.field(obj, where, key, str)
        if not _SHA256.match(value):
            raise ManifestError(f"{self.uri}: key '{where}.{key}' is not a lowercase sha256 hex digest")
        return value

    def name(self, obj: dict[str, Any], where: str, key: str) -> str:
        value = self.field(obj, where, key, str)
        if not _SAFE_NAME.match(value):
            raise ManifestError(
                f"{self.uri}: key '{where}.{key}' ({value!r}) must be a plain file name next to the manifest"
            )
        return value
