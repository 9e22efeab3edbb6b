"""Inputs in object storage for `prepare`: text, JSONL and Parquet objects under an ``s3://`` or ``gs://`` prefix.

Use::

    refs, units, weights = plan_remote("s3://bucket/corpus/", include=(), exclude=(), endpoint_url=None,
                                       skip_binary=True, stats=stats, say=print)
    raw = read_range("s3://bucket/corpus/a.jsonl", 0, 4096, endpoint_url=None)   # one ranged GET
    pf = parquet_file("s3://bucket/corpus/b.parquet", endpoint_url=None)          # pyarrow over ranged GETs
    check_etag(ref, endpoint_url=None)                                            # the object is still the planned one

A prefix is listed once (key, size, ETag, in key order); hidden names and the ``--include`` / ``--exclude``
patterns apply to the key below the prefix, as below a local directory. Each object becomes units as a local file
does, except that a text or JSONL object is one unit whatever its size (slicing it would need reads to find line
breaks while planning) and a Parquet object's row groups are read from its footer by ranged GETs. The plan pins each
object's ETag, and a task checks it before reading: an object replaced after planning fails the task, naming it,
instead of mixing two versions into one dataset.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlparse

from gpu_train.storage import S3Store, open_store
from trainer.data.errors import DataError
from trainer.data.inputs import BINARY_SNIFF_BYTES, PrepareStats, Task, _spec, format_of, read_documents

SCHEMES = ("s3://", "gs://")


def is_remote(path: object) -> bool:
    return str(path).startswith(SCHEMES)


@functools.lru_cache(maxsize=16)
def _store(root: str, endpoint_url: str | None) -> S3Store:
    store = open_store(root, endpoint_url=endpoint_url)
    assert isinstance(store, S3Store)
    return store


def _split(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return f"{parsed.scheme}://{parsed.netloc}", parsed.path.lstrip("/")


def read_range(uri: str, start: int, end: int | None, endpoint_url: str | None) -> bytes:
    root, key = _split(uri)
    return _store(root, endpoint_url).get_bytes(key, start, end)


class _RangedFile(io.RawIOBase):
    """A read-only, seekable file over ranged GETs of one object, for pyarrow (which reads a Parquet footer, then the
    column chunks it needs)."""

    def __init__(self, uri: str, size: int, endpoint_url: str | None) -> None:
        self.uri, self.size, self.endpoint_url, self.pos = uri, size, endpoint_url, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        end = min(self.size, self.pos + len(buffer))
        if end <= self.pos:
            return 0
        data = read_range(self.uri, self.pos, end, self.endpoint_url)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def parquet_file(uri: str, endpoint_url: str | None, size: int | None = None) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, key = _split(uri)
    if size is None:
        size = _size(root, key, endpoint_url)
    try:
        return pq.ParquetFile(io.BufferedReader(_RangedFile(uri, size, endpoint_url), buffer_size=1 << 20))
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{uri}: not a readable Parquet file ({exc})") from exc


def _size(root: str, key: str, endpoint_url: str | None) -> int:
    store = _store(root, endpoint_url)
    head = store._call(key, "HEAD", lambda: store.client.head_object(Bucket=store.bucket, Key=store.key_of(key)))
    return int(head["ContentLength"])


def read_remote_documents(task: Task, text_field: str, endpoint_url: str | None) -> list[bytes]:
    """``read_documents`` of a unit of an object: its bytes by ranged GETs, a Parquet file through its footer."""
    return read_documents(task, text_field, read=lambda start, end: read_range(task.path, start, end, endpoint_url),
                          parquet=lambda: parquet_file(task.path, endpoint_url))


def check_etag(path: str, content: str, endpoint_url: str | None) -> None:
    """DataError naming the object if it is no longer the one the plan pinned (``content`` = ``etag:<etag>``)."""
    root, key = _split(path)
    now = "etag:" + _store(root, endpoint_url).etag(key)
    if now != content:
        raise DataError(f"{path} changed after the plan was made ({content} then, {now} now): prepare again with "
                        "--force to start over from the current objects")


def plan_remote(uri: str, *, include: Sequence[str], exclude: Sequence[str], endpoint_url: str | None,
                skip_binary: bool, stats: PrepareStats, say: Callable[[str], None]
                ) -> list[tuple[tuple[str, int, str, str], list[tuple[int, int]], list[int]]]:  # fmt: skip
    """Per object under ``uri``: ((uri, size, "etag:...", format), its units as (start, end), their weights)."""
    root, prefix = _split(uri)
    store = _store(root, endpoint_url)
    inc, exc = _spec(include), _spec(exclude)
    out = []
    for key, size, etag in store.list_objects(prefix):
        rel = key[len(prefix) :].lstrip("/") if prefix.endswith("/") or key != prefix else PurePosixPath(key).name
        if any(part.startswith(".") for part in PurePosixPath(rel).parts):
            continue
        if (inc is not None and not inc.match_file(rel)) or (exc is not None and exc.match_file(rel)):
            stats.excluded += 1
            continue
        obj = f"{root}/{key}"
        fmt = format_of(PurePosixPath(rel))  # type: ignore[arg-type]
        stats.files += 1
        if size == 0:
            stats.skipped_empty += 1
            say(f"skipped {obj}: empty")
            continue
        if fmt == "parquet":
            groups = parquet_file(obj, endpoint_url, size).metadata.num_row_groups
            units = [(g, g + 1) for g in range(groups)]
            weights = [size // max(1, groups)] * groups
        else:
            if fmt == "text" and skip_binary and b"\0" in store.get_bytes(key, 0, BINARY_SNIFF_BYTES):
                stats.skipped_binary += 1
                say(f"skipped {obj}: binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes, as git decides; "
                    "--keep-binary keeps it)")
                continue
            units, weights = [(0, size)], [size]
        out.append(((obj, size, "etag:" + etag, fmt), units, weights))
    if not out:
        raise DataError(f"no input objects found under {uri} (check the prefix, --include and --exclude)")
    return out
