"""Atomic, asynchronous, verified checkpoints with torch.distributed.checkpoint (DCP).

Usage (inside the training loop, on every rank):
    ckpt = CheckpointManager(local_dir, remote_uri, endpoint_url=None, keep=3, env=env, async_save=True)
    found = ckpt.find_latest()                      # newest verified step dir (local, else downloaded), or None
    meta = ckpt.load(found, model, optimizer)       # -> trainer state dict, per-rank RNG restored
    ckpt.save(step, model, optimizer, trainer_state, config_dict)   # returns after staging; writes in background
    ckpt.wait()                                     # before exit: last save fully written, uploaded, retained

Layout of one checkpoint, `step_000000123/`:
    .metadata, __<rank>_<i>.distcp     DCP's files (model + optimizer, sharded or replicated, + trainer state)
    rng/rank_00000.pt ...              python/numpy/torch/CUDA generator state of each rank
    manifest.json                      written LAST by rank 0, tmp + rename, after every rank finished writing:
                                       {"step", "world_size", "config", "trainer", "files": {path: {size, sha256}}}
A directory without manifest.json, or whose files differ from it in size or sha256, is not a checkpoint: it is
skipped with a warning naming the directory and the offending file, and the previous one is used.

Model and optimizer state go through torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict, so
DDP (replicated, written once) and FSDP2 (sharded DTensors) use the same code, and DCP reshards on load when the
world size changed. Async saves use dcp.async_save on a dedicated gloo group so that the background planning
collectives never interleave with the training collectives on the default group
(https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.async_save).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.data.storage import StorageError, open_store
from trainer.distributed import DistEnv, rng_state, set_rng_state

log = logging.getLogger("trainer.checkpoint")

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{9})$")
_TRAINER_KEY = "trainer_state"  # a JSON string inside the DCP state dict: step, tokens, sampler, run id, ...


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class CheckpointInvalid(Exception):
    """A checkpoint directory that must not be loaded; the message names the directory and the file."""


def verify(step_dir: Path) -> dict[str, Any]:
    """Return the manifest of a complete checkpoint, or raise CheckpointInvalid naming the bad file."""
    manifest_path = step_dir / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointInvalid(f"{step_dir}: no {MANIFEST} (incomplete save)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointInvalid(f"{manifest_path}: unreadable manifest ({exc})") from exc
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointInvalid(f"{manifest_path}: manifest lists no DCP .metadata")
    match = _STEP_RE.match(step_dir.name)
    if match and int(match.group(1)) != step:
        raise CheckpointInvalid(f"{manifest_path}: records step {step} but the directory is {step_dir.name}")
    # Sizes first (cheap, catches truncation), then content hashes.
    for rel, info in files.items():
        path = step_dir / rel
        if not path.is_file():
            raise CheckpointInvalid(f"{path}: listed in {MANIFEST} but missing")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointInvalid(f"{path}: size {size} bytes, manifest says {info['size']} (truncated?)")
    for rel, info in files.items():
        path = step_dir / rel
        if sha256_file(path) != info["sha256"]:
            raise CheckpointInvalid(f"{path}: sha256 differs from {MANIFEST} (corrupted)")
    return manifest


def list_step_dirs(root: Path) -> list[Path]:
    """Step directories under root, newest first (manifest or not)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(dirs, key=lambda p: p.name, reverse=True)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SaveRecord:
    step: int
    path: Path
    started: float
    blocking_s: float = 0.0
    duration_s: float | None = None
    finished_unix: float | None = None
    remote_uri: str | None = None
    error: str | None = None


class CheckpointManager:
    """Saves, finalizes, uploads, prunes and finds checkpoints; every method is called on every rank."""

    def __init__(
        self,
        local_dir: Path,
        remote_uri: str,
        *,
        keep: int,
        env: DistEnv,
        async_save: bool = True,
        endpoint_url: str | None = None,
    ) -> None:
        self.local_dir = Path(local_dir)
        self.remote_uri = remote_uri.rstrip("/")
        self.keep = keep
        self.env = env
        self.async_save = async_save
        self.endpoint_url = endpoint_url
        self.local_dir.mkdir(parents=True, exist_ok=True)
        # Background DCP planning and our own finalize collectives run on this group, never on the default one.
        self._pg = dist.new_group(backend="gloo")
        self._thread: threading.Thread | None = None
        self._store = None
        # One stager for the whole run: it keeps the CPU copy (pinned on CUDA) of the state between saves
        # and refills it in place, so an async save blocks training only for a memory copy, not for
        # allocating and faulting in a fresh multi-GB buffer each time (torch.distributed.checkpoint.staging).
        # Safe because save() waits for the previous save before staging again.
        cuda = env.device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))
        self.last_success_unix: float | None = None
        self.saved: list[SaveRecord] = []  # every finished save, oldest first

    # ------------------------------------------------------------------------------------------ store
    @property
    def store(self):
        if self._store is None and self.remote_uri:
            self._store = open_store(self.remote_uri, endpoint_url=self.endpoint_url)
        return self._store

    # ------------------------------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        config: dict[str, Any],
        *,
        block: bool = False,
    ) -> float:
        """Checkpoint `step`. Returns the seconds training was blocked (waiting + staging)."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time; the group is free again after this
        path = self.local_dir / step_dir_name(step)
        if self.env.local_rank == 0 and path.exists():
            shutil.rmtree(path)  # leftover of an attempt that died before its manifest; never a checkpoint
        dist.barrier(group=self._pg)
        (path / "rng").mkdir(parents=True, exist_ok=True)
        rng_file = path / "rng" / f"rank_{self.env.rank:05d}.pt"
        tmp = rng_file.with_name(rng_file.name + ".tmp")
        torch.save(rng_state(), tmp)
        os.replace(tmp, rng_file)

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, _TRAINER_KEY: json.dumps(trainer_state, sort_keys=True)}
        record = SaveRecord(step=step, path=path, started=time.time())
        manifest_extra = {"trainer": trainer_state, "config": config}
        if self.async_save and not block:
            # Returns once the state is staged (copied) to CPU memory; writing happens in a DCP thread.
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._pg,
                                    async_stager=self._stager)
            self._thread = threading.Thread(
                target=self._finish, args=(record, future, manifest_extra), name=f"ckpt-{step}", daemon=True
            )
            self._thread.start()
        else:
            dcp.save(state, checkpoint_id=str(path), process_group=self._pg)
            self._finish(record, None, manifest_extra)
        record.blocking_s = time.perf_counter() - t0
        return record.blocking_s

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _finish(self, record: SaveRecord, future, extra: dict[str, Any]) -> None:
        """After DCP finished on this rank: gather file hashes, rank 0 writes the manifest, upload, prune."""
        try:
            if future is not None:
                future.result()
            mine = self._hash_own_files(record.path)
            gathered: list[dict[str, Any] | None] = [None] * self.env.world_size
            # DCP's own finish step already gathered every rank's write results before rank 0 wrote .metadata,
            # so when this all_gather completes every rank's files are on disk.
            dist.all_gather_object(gathered, mine, group=self._pg)
            if self.env.rank == 0:
                files: dict[str, Any] = {}
                for part in gathered:
                    files.update(part or {})
                meta = record.path / ".metadata"
                files[".metadata"] = {"size": meta.stat().st_size, "sha256": sha256_file(meta)}
                manifest = {
                    "format": FORMAT_VERSION,
                    "step": record.step,
                    "world_size": self.env.world_size,
                    "created_unix": time.time(),
                    **extra,
                    "files": dict(sorted(files.items())),
                }
                _write_atomic(record.path / MANIFEST, json.dumps(manifest, indent=1).encode())
                _fsync_dir(record.path)
            if self.store is not None:
                self._upload(record)
            self._prune()
            record.finished_unix = self.last_success_unix = time.time()
            record.duration_s = record.finished_unix - record.started  # staging + write + manifest + upload
            self.saved.append(record)
            if self.env.rank == 0:
                log.info("checkpoint step %d saved to %s in %.2fs", record.step, record.path, record.duration_s)
        except Exception as exc:  # a failed save must not kill training: the previous checkpoint still stands
            record.error = f"{type(exc).__name__}: {exc}"
            log.error("checkpoint step %d at %s failed: %s", record.step, record.path, record.error)

    def _own_files(self, path: Path) -> list[str]:
        """Files this rank wrote: its RNG state and its DCP data files (FileSystemWriter names them
        __<rank>_<n>.distcp)."""
        return [f"rng/rank_{self.env.rank:05d}.pt", *sorted(p.name for p in path.glob(f"__{self.env.rank}_*.distcp"))]

    def _hash_own_files(self, path: Path) -> dict[str, Any]:
        return {rel: {"size": (path / rel).stat().st_size, "sha256": sha256_file(path / rel)}
                for rel in self._own_files(path)}

    def _upload(self, record: SaveRecord) -> None:
        """Each rank uploads the files it wrote; rank 0 uploads .metadata and, last, the manifest."""
        prefix = step_dir_name(record.step)
        for rel in self._own_files(record.path):
            self.store.upload(record.path / rel, f"{prefix}/{rel}")
        dist.barrier(group=self._pg)
        if self.env.rank == 0:
            self.store.upload(record.path / ".metadata", f"{prefix}/.metadata")
            self.store.upload(record.path / MANIFEST, f"{prefix}/{MANIFEST}")
            record.remote_uri = f"{self.remote_uri}/{prefix}"

    def _prune(self) -> None:
        """Keep the newest `keep` verified checkpoints; drop older ones and stale manifest-less dirs."""
        if self.env.local_rank == 0:
            complete = [p for p in list_step_dirs(self.local_dir) if (p / MANIFEST).is_file()]
            keep_from = complete[self.keep - 1].name if len(complete) >= self.keep else None
            for p in list_step_dirs(self.local_dir):
                if keep_from is not None and p.name < keep_from:
                    shutil.rmtree(p, ignore_errors=True)
        if self.env.rank == 0 and self.store is not None:
            steps = self._remote_step_names()
            complete = [s for s in steps if self.store.exists(f"{s}/{MANIFEST}")]
            if len(complete) > self.keep:
                keep_from = complete[-self.keep]
                for s in steps:
                    if s < keep_from:
                        self.store.delete_prefix(f"{s}/")

    # ------------------------------------------------------------------------------------------ find
    def _newest_valid_local(self) -> Path | None:
        for p in list_step_dirs(self.local_dir):
            try:
                verify(p)
                return p
            except CheckpointInvalid as exc:
                log.warning("skipping checkpoint %s: %s", p, exc)
        return None

    def _remote_step_names(self) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self.store.list() if _STEP_RE.match(k.split("/", 1)[0])})

    def _download(self, name: str) -> None:
        """Fetch remote checkpoint `name` into local_dir (staging dir, verify, rename); CheckpointInvalid if bad."""
        uri = f"{self.remote_uri}/{name}"
        if not self.store.exists(f"{name}/{MANIFEST}"):
            raise CheckpointInvalid(f"{uri}: no {MANIFEST} (incomplete upload)")
        staging = self.local_dir / f".download-{name}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            manifest = json.loads(self.store.get_bytes(f"{name}/{MANIFEST}"))
            for rel in [*manifest["files"], MANIFEST]:
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                self.store.download(f"{name}/{rel}", staging / rel)
        except (ValueError, KeyError, TypeError) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointInvalid(f"{uri}/{MANIFEST}: unreadable manifest ({exc})") from exc
        except StorageError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointInvalid(f"{uri}: download failed ({exc})") from exc
        try:
            verify(staging)
        except CheckpointInvalid as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointInvalid(f"{uri}: {exc}") from exc
        target = self.local_dir / name
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        log.info("downloaded checkpoint %s to %s", uri, target)

    def _newest_valid_remote(self) -> str | None:
        """Download the newest remote checkpoint that verifies; return its directory name."""
        for name in reversed(self._remote_step_names()):
            try:
                self._download(name)
                return name
            except CheckpointInvalid as exc:
                log.warning("skipping remote checkpoint: %s", exc)
        return None

    def find_latest(self) -> Path | None:
        """The newest checkpoint every rank can read, agreed on by all ranks (collective)."""
        local = None
        if self.env.local_rank == 0:
            found = self._newest_valid_local()
            local = found.name if found else None
        names: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(names, (self.env.local_rank, local), group=self._pg)
        leaders = [n for lr, n in names if lr == 0]
        chosen = leaders[0] if leaders and all(n == leaders[0] for n in leaders) else None
        if chosen is None and any(leaders) and self.store is None:
            # Starting over would silently discard progress that some node still has.
            raise RuntimeError(
                f"nodes disagree on the newest checkpoint under {self.local_dir} ({sorted(set(map(str, leaders)))})"
                " and checkpoint.remote_uri is empty: put checkpoint.local_dir on storage all nodes share, or set "
                "checkpoint.remote_uri"
            )
        if self.store is not None and chosen is None:
            # No checkpoint that every node has intact locally (fresh nodes, node-local NVMe, a lost disk):
            # rank 0 downloads the newest remote one that verifies; then every other node leader fetches the
            # same one unless it already has it intact.
            box: list[str | None] = [None]
            if self.env.rank == 0:
                box[0] = self._newest_valid_remote()
            dist.broadcast_object_list(box, src=0, group=self._pg)
            name = box[0]
            if name is not None:
                if self.env.local_rank == 0 and self.env.rank != 0:
                    try:
                        verify(self.local_dir / name)
                    except CheckpointInvalid:
                        self._download(name)
                chosen = name
        dist.barrier(group=self._pg)
        return self.local_dir / chosen if chosen else None

    # ------------------------------------------------------------------------------------------ load
    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load model + optimizer (resharding if needed); restore this rank's RNG if the world size matches."""
        manifest = json.loads((path / MANIFEST).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, _TRAINER_KEY: ""}
        dcp.load(state, checkpoint_id=str(path), process_group=self._pg)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        trainer_state = json.loads(state[_TRAINER_KEY])
        if manifest["world_size"] == self.env.world_size:
            rng = torch.load(path / "rng" / f"rank_{self.env.rank:05d}.pt", weights_only=False)
            set_rng_state(rng)
        elif self.env.rank == 0:
            log.info(
                "world size changed (%d -> %d): per-rank RNG state not restored; data order is unaffected",
                manifest["world_size"], self.env.world_size,
            )
        return trainer_state

    def close(self) -> None:
        self.wait()
        self._stager.close()
