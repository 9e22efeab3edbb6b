"""What `prepare` reads: the input files it finds, and the documents in them (trainer/data/prepare.py).

Usage:
    files = collect_files(["corpus/"], include=["*.py"], exclude=DEFAULT_EXCLUDES, stats=stats)
    tasks = plan_tasks(files, skip_binary=True, stats=stats)      # the units of parallel work, in order
    docs = read_documents(tasks[0], text_field="text")             # UTF-8 bytes, one item a document

Formats by suffix: `.jsonl` (`.jsonl.gz`), one document per line, its text field; `.parquet`, one document per
row of the text column, read row group by row group; anything else is plain text, one document per file (a file
over TEXT_PIECE_BYTES is cut at line breaks). Malformed input raises DataError naming the file and line (or row
group).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.errors import DataError

DEFAULT_EXCLUDES = ("__pycache__/", "*.pyc", "*.pyo")
TEXT_PIECE_BYTES = 64 << 20
JSONL_PART_BYTES = 32 << 20
BINARY_SNIFF_BYTES = 8000  # git's heuristic: a NUL byte in the first 8000 bytes means binary


@dataclass(frozen=True)
class InputFile:
    path: Path
    rel: str  # path below the directory it was found in (the file name for a file given directly)
    fmt: str  # "text", "jsonl" or "parquet"


@dataclass(frozen=True)
class Task:
    """One unit of parallel work: a byte range of a text/JSONL file or a range of Parquet row groups."""

    path: str
    fmt: str
    start: int
    end: int


@dataclass
class PrepareStats:
    files: int = 0
    skipped_binary: int = 0
    skipped_empty: int = 0
    excluded: int = 0
    documents: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    reused: bool = False  # --out already held this dataset (same inputs and settings)
    tasks: int = 0  # the job's task count
    tasks_run: int = 0  # tasks this run ran (the others had committed in an earlier run)


def format_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _spec(patterns: Sequence[str]) -> Any:
    import pathspec

    return pathspec.PathSpec.from_lines("gitignore", patterns) if patterns else None


def collect_files(
    inputs: Iterable[str | os.PathLike[str]],
    include: Sequence[str] = (),
    exclude: Sequence[str] = DEFAULT_EXCLUDES,
    stats: PrepareStats | None = None,
) -> list[InputFile]:
    """Input files in a stable order: each input in turn, a directory's files sorted by relative path.

    In a directory, hidden files are skipped, a file must match one ``include`` pattern (if any) and no
    ``exclude`` pattern (gitignore syntax, matched against the path below the directory). A file named
    directly is always taken.
    """
    inc, exc = _spec(include), _spec(exclude)
    files: list[InputFile] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(p):
                base = Path(dirpath).relative_to(p).as_posix()
                prefix = "" if base == "." else base + "/"
                # Prune hidden and excluded directories instead of walking them (site-packages is big).
                keep = []
                for d in dirnames:
                    if d.startswith("."):
                        continue
                    if exc is not None and exc.match_file(f"{prefix}{d}/"):
                        if stats is not None:
                            stats.excluded += 1
                        continue
                    keep.append(d)
                dirnames[:] = keep
                for name in filenames:
                    rel = prefix + name
                    f = Path(dirpath) / name
                    if name.startswith(".") or not f.is_file():
                        continue
                    if (inc is not None and not inc.match_file(rel)) or (
                        exc is not None and exc.match_file(rel)
                    ):
                        if stats is not None:
                            stats.excluded += 1
                        continue
                    found.append(InputFile(f, rel, format_of(f)))
            files.extend(sorted(found, key=lambda x: x.rel))
        elif p.is_file():
            files.append(InputFile(p, p.name, format_of(p)))
        else:
            raise DataError(f"input {p} does not exist")
    if not files:
        raise DataError(f"no input files found in {[str(i) for i in inputs]} (check --include / --exclude)")
    return files


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def _line_ranges(path: Path, size: int, part: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``part`` bytes that start and end at line breaks."""
    ranges, lo = [], 0
    with open(path, "rb") as f:
        while lo < size:
            hi = lo + part
            if hi >= size:
                ranges.append((lo, size))
                break
            f.seek(hi)
            f.readline()  # move to the end of the line that straddles the cut
            hi = min(f.tell(), size)
            ranges.append((lo, hi))
            lo = hi
    return ranges


def plan_tasks(files: Sequence[InputFile], *, skip_binary: bool, stats: PrepareStats,
               say: Callable[[str], None] | None = None) -> list[Task]:
    """The tasks of the files, in order; a binary or empty text file is skipped and counted, with a line through
    `say` (else the log)."""
    say = say or logging.getLogger("trainer.data").info
    tasks: list[Task] = []
    for f in files:
        stats.files += 1
        size = f.path.stat().st_size
        if size == 0 and f.fmt != "parquet":
            stats.skipped_empty += 1
            say(f"skipped {f.path}: empty")
        elif f.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                groups = pq.ParquetFile(f.path).metadata.num_row_groups
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{f.path}: not a readable Parquet file ({exc})") from exc
            tasks += [Task(str(f.path), "parquet", g, g + 1) for g in range(groups)]
        elif f.fmt == "jsonl":
            if f.path.name.lower().endswith(".gz"):
                tasks.append(Task(str(f.path), "jsonl", 0, size))
            else:
                tasks += [
                    Task(str(f.path), "jsonl", lo, hi)
                    for lo, hi in _line_ranges(f.path, size, JSONL_PART_BYTES)
                ]
        elif skip_binary and _is_binary(f.path):
            stats.skipped_binary += 1
            say(f"skipped {f.path}: binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes, as git decides; "
                "--keep-binary keeps it)")
        else:
            tasks += [
                Task(str(f.path), "text", lo, hi) for lo, hi in _line_ranges(f.path, size, TEXT_PIECE_BYTES)
            ]
    return tasks


def _jsonl_error(task: Task, line_in_part: int, msg: str, read: Callable[[int, int | None], bytes]) -> DataError:
    line = line_in_part
    if task.start:  # count the lines before this part only when reporting an error
        line += read(0, task.start).count(b"\n")
    return DataError(f"{task.path}:{line}: {msg}")


def read_documents(task: Task, text_field: str = "text", *, read: Callable[[int, int | None], bytes] | None = None,
                   parquet: Callable[[], Any] | None = None) -> list[bytes]:
    """The documents of one task, as UTF-8 bytes; malformed input raises DataError naming file and line. ``read``
    (bytes [start, end) of the task's file, None: to its end) and ``parquet`` (its pyarrow ParquetFile) read from
    somewhere else than the local file system (trainer/data/remote.py)."""

    def local(start: int, end: int | None) -> bytes:
        with open(task.path, "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    read = read or local
    if task.fmt == "text":
        return [read(task.start, task.end)]
    if task.fmt == "jsonl":
        if task.path.lower().endswith(".gz"):
            try:
                raw = gzip.decompress(read(0, None))
            except (OSError, EOFError) as exc:
                raise DataError(f"{task.path}: not a readable gzip file ({exc})") from exc
        else:
            raw = read(task.start, task.end)
        docs = []
        for n, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _jsonl_error(task, n, f"not a JSON object ({exc})", read) from exc
            if not isinstance(obj, dict) or text_field not in obj:
                raise _jsonl_error(task, n, f"expected a JSON object with a string {text_field!r} field", read)
            text = obj[text_field]
            if not isinstance(text, str):
                raise _jsonl_error(task, n, f"{text_field!r} must be a string (got {type(text).__name__})", read)
            docs.append(text.encode("utf-8"))
        return docs
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = parquet() if parquet is not None else pq.ParquetFile(task.path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{task.path}: not a readable Parquet file ({exc})") from exc
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"{task.path}: cannot read column {text_field!r}: the file has columns {', '.join(pf.schema_arrow.names)}"
        )
    try:
        column = pf.read_row_groups(list(range(task.start, task.end)), columns=[text_field]).column(
            text_field
        )
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"{task.path}: cannot read column {text_field!r} of row group {task.start} ({exc})"
        ) from exc
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{task.path}: column {text_field!r} is {column.type}, expected a string column")
    return [s.encode("utf-8") for s in column.to_pylist() if s is not None]
