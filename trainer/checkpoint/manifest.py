"""Checkpoint manifests: parse, verify, list, write atomically, hash. Pure file code: no torch, no collectives.

Usage:
    from trainer.checkpoint.manifest import verify, list_step_dirs
    for step_dir in list_step_dirs(Path("runs/dev/checkpoints")):     # newest first
        try:
            manifest = verify(step_dir)      # every listed file present with its size and sha256
        except CheckpointInvalid as exc:
            print(exc)                       # names the directory and the bad file
            continue
        break

Layout of one checkpoint, `step_000000123/`:
    .metadata, __<rank>_<i>.distcp     DCP's files (model + optimizer, sharded or replicated, + trainer state)
    rng/rank_00000.pt ...              python/numpy/torch/CUDA generator state of each rank
    manifest.json                      {"format", "step", "world_size", "config", "trainer",
                                        "files": {path: {"size", "sha256", "rank"}}}: every file of the checkpoint,
                                       whichever node wrote it

"Complete" means one thing everywhere: a manifest, and every file it lists present with its size and sha256.
The collective protocol that writes and reads these is trainer/checkpoint/manager.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "manifest.json"
# 4: attention's query, key and value in one matrix, head by head (`attn.wqkv.weight`, trainer/model.py); 3: three
# matrices (`attn.q`, `attn.k`, `attn.v`); 2 and earlier: one matrix, query rows then key rows then value rows.
FORMAT_VERSION = 4
STEP_RE = re.compile(r"^step_(\d{9})$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def step_dir_name(step: int) -> str:
    """The directory (and remote prefix) of the checkpoint of `step`: step_000000123."""
    return f"step_{step:09d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class CheckpointInvalid(Exception):
    """A checkpoint that must not be loaded; the message names the directory (or URI) and the file."""


def parse_manifest(raw: bytes | str, where: str) -> dict[str, Any]:
    """The manifest as a dict, or CheckpointInvalid naming `where` and what is wrong with it."""
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointInvalid(f"{where}: manifest is not JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise CheckpointInvalid(f"{where}: manifest is not a JSON object")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointInvalid(f"{where}: manifest 'step' is not a whole number >= 0 (got {step!r})")
    world = manifest.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointInvalid(f"{where}: manifest 'world_size' is not a whole number >= 1 (got {world!r})")
    for key in ("config", "trainer"):
        if key in manifest and not isinstance(manifest[key], dict):
            raise CheckpointInvalid(f"{where}: manifest {key!r} is not a mapping")
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointInvalid(f"{where}: manifest lists no DCP .metadata")
    for rel, info in files.items():
        parts = PurePosixPath(rel).parts
        if not rel or rel.startswith("/") or ".." in parts or rel == MANIFEST:
            raise CheckpointInvalid(f"{where}: manifest lists an unsafe path {rel!r}")
        if not isinstance(info, dict):
            raise CheckpointInvalid(f"{where}: manifest entry {rel!r} is not a mapping (got {info!r})")
        size, digest = info.get("size"), info.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointInvalid(f"{where}: manifest entry {rel!r} has no valid 'size' (got {size!r})")
        if not isinstance(digest, str) or not _SHA_RE.match(digest):
            raise CheckpointInvalid(f"{where}: manifest entry {rel!r} has no valid 'sha256' (got {digest!r})")
    return manifest


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """Parse `step_dir/manifest.json`; CheckpointInvalid if it is missing, unreadable or malformed."""
    path = step_dir / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointInvalid(f"{step_dir}: no {MANIFEST} (incomplete save)") from exc
    except OSError as exc:
        raise CheckpointInvalid(f"{path}: unreadable manifest ({exc.strerror or exc})") from exc
    manifest = parse_manifest(raw, str(path))
    match = STEP_RE.match(step_dir.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise CheckpointInvalid(f"{path}: records step {manifest['step']} but the directory is {step_dir.name}")
    return manifest


def check_files(step_dir: Path, files: dict[str, Any], *, hashes: bool = True) -> list[tuple[str, str]]:
    """(file, what is wrong) for each listed file that is missing, unreadable, or differs in size or sha256.

    Sizes first for every file (cheap, catches truncation and missing files), then content hashes.
    """
    problems: dict[str, str] = {}
    for rel, info in files.items():
        path = step_dir / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            problems[rel] = f"{path}: listed in {MANIFEST} but missing"
            continue
        except OSError as exc:
            problems[rel] = f"{path}: unreadable ({exc.strerror or exc})"
            continue
        if not path.is_file():
            problems[rel] = f"{path}: listed in {MANIFEST} but not a file"
        elif st.st_size != info["size"]:
            problems[rel] = f"{path}: size {st.st_size} bytes, manifest says {info['size']} (truncated?)"
    if hashes:
        for rel, info in files.items():
            if rel in problems:
                continue
            path = step_dir / rel
            try:
                digest = sha256_file(path)
            except OSError as exc:
                problems[rel] = f"{path}: unreadable ({exc.strerror or exc})"
                continue
            if digest != info["sha256"]:
                problems[rel] = f"{path}: sha256 differs from {MANIFEST} (corrupted)"
    return sorted(problems.items())


def verify(step_dir: Path) -> dict[str, Any]:
    """Return the manifest of a complete checkpoint, or raise CheckpointInvalid naming the bad file."""
    manifest = read_manifest(step_dir)
    problems = check_files(step_dir, manifest["files"])
    if problems:
        raise CheckpointInvalid(problems[0][1])
    return manifest


def exists(path: Path) -> bool:
    """Path.exists that answers False, instead of raising, where the path cannot even be looked at (a directory
    on the way that this user may not read: Path.exists raises PermissionError there)."""
    try:
        path.stat()
    except OSError:
        return False
    return True


def is_file(path: Path) -> bool:
    """Path.is_file, False where the path cannot be looked at (see `exists`)."""
    try:
        return path.is_file()
    except OSError:
        return False


def permission_problem(step_dir: Path) -> str | None:
    """Why this user may not read the checkpoint directory (its listing or its manifest), or None.

    A directory that is merely damaged (a file missing, truncated, corrupt) is not a permission problem: a
    permission problem is one the files themselves cannot explain, which the owner of the directory must fix."""
    try:
        os.listdir(step_dir)
        with (step_dir / MANIFEST).open("rb"):
            pass
    except PermissionError as exc:
        where = f": {exc.filename}" if exc.filename and Path(exc.filename) != step_dir else ""
        return f"not readable by this user ({exc.strerror or exc}{where})"
    except OSError:
        return None
    return None


def list_step_dirs(root: Path) -> list[Path]:
    """Step directories under root, newest first (manifest or not); [] if root cannot be listed."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    dirs = []
    for p in entries:
        if not STEP_RE.match(p.name):
            continue
        try:
            if p.is_dir():
                dirs.append(p)
        except OSError:
            continue
    return sorted(dirs, key=lambda p: p.name, reverse=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader sees the old file or the whole new one, also after a crash
    (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
