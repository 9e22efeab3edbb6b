"""CheckpointManager: atomic, asynchronous, verified checkpoints with torch.distributed.checkpoint (DCP), on
node-local disks plus a remote store, and the collective protocol that saves and resumes them.

Usage, in any PyTorch loop once the default process group exists (every method is collective: call it on
every rank):
    from trainer.checkpoint import CheckpointManager
    ckpt = CheckpointManager("/nvme/ckpt", "s3://bucket/run", keep=3)     # env: this process's DistEnv
    path = ckpt.resume(model, optimizer, check=compatible, apply=restore)  # newest loadable checkpoint or None
    ckpt.save(step, model, optimizer, trainer_state, config_dict)         # returns after staging
    ckpt.wait()                                                           # last save written, uploaded, pruned
    ckpt.close()

`trainer_state` is any JSON-serialisable dict of the loop's own state (step, sampler position, ...): rank 0's
is stored inside the DCP state dict and copied into the manifest (every rank's manifest), and `resume` hands it
back to `apply` on every rank, whatever the world size that saved it.
`check(manifest, where)` may refuse a checkpoint (raise; the trainer raises BadInput) before anything is
fetched or loaded. The layout and the meaning of "complete" are in trainer/checkpoint/manifest.py.

Where the files are. Each rank writes its own files into `local_dir` on its own node, and DCP's coordinator
(rank 0) writes `.metadata` on node 0; with DDP the replicated state is also spread over the ranks (DCP's
planner gives each replicated tensor to one rank). So with node-local disks no node holds a whole checkpoint:
a node's directory holds its ranks' files and, once every rank has written, the manifest of the whole
checkpoint. The union is in the remote store (`remote_uri`), where each rank uploads its own files and rank 0
uploads `.metadata` and, last, the manifest.

Completeness is checked locally per directory and, for the remote store, by the manifest being there
(uploaded last). On start (`resume`) the candidates are every remote checkpoint with a manifest plus every
step that each node's directory holds completely; newest first, rank 0 reads the candidate's manifest,
`check` may refuse it, each directory fetches the files it lacks or that differ from the manifest, and every
rank loads it. A candidate that fails any of this on any rank (unreadable, truncated or corrupt file, bad
manifest, DCP cannot load it) is skipped with a warning naming it and the next older one is tried; the
outcome of each phase is agreed on by all ranks.

Which directories are the same: the node leaders (local rank 0) each drop a probe file into their
`local_dir` and report which probes they see; the lowest rank of a group that sees the same probes owns that
directory (writes manifests, fetches, prunes), so a directory shared by several nodes is handled once.

A save that fails anywhere (a write, a hash, an upload) is agreed on by every rank through collectives on the
checkpoint group, so no rank waits for another in a barrier; the save is recorded as failed on every rank,
its remote copy gets no manifest, and training goes on (the previous checkpoint stands).

Model and optimizer state go through torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict, so
DDP, FSDP2, tensor and pipeline parallelism share one code path, and DCP reshards on load when the world size or
the layout changed: every parameter has the same name in every layout (trainer/model.py, trainer/pipeline.py),
and each rank loads the parts of the parameters it holds now. Async saves use
dcp.async_save on a dedicated gloo group so that background collectives never interleave with the training
collectives on the default group
(https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.async_save).

Over 400 lines because the multi-rank save and resume protocol (owner probes, hashing, commit, upload, prune,
agreement on the candidate) runs across threads and ranks and reads as one state machine; the pure manifest code
lives in trainer/checkpoint/manifest.py.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from gpu_train.storage import open_store
from trainer.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    STEP_RE,
    CheckpointInvalid,
    check_files,
    exists,
    fsync_dir,
    is_file,
    list_step_dirs,
    parse_manifest,
    permission_problem,
    read_manifest,
    sha256_file,
    step_dir_name,
    write_atomic,
)
from trainer.data.errors import DataError
from trainer.distributed import DistEnv, current_env, rng_state, set_rng_state
from trainer.errors import BadInput, one_line

log = logging.getLogger("trainer.checkpoint")

# The optimizer's state keyed by parameter name, each parameter's group settings beside it
# ("state.blocks.7.mlp.fc.weight.exp_avg", "param_groups.blocks.7.mlp.fc.weight.lr"): a rank's keys are the
# names of the parameters it holds, whatever the layout, where the nested form lists each group's parameters
# per rank and so could not move between pipeline layouts.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_TRAINER_KEY = "trainer_state"  # a JSON string inside the DCP state dict: step, tokens, sampler, run id, ...
_PROBE = ".probe-"


def _describe(exc: BaseException, limit: int = 400) -> str:
    """One line for a log or an agreed error. DCP's CheckpointException prints every rank's traceback: use the
    first failing rank's own exception instead."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = next(iter(sorted(exc.failures.items(), key=lambda kv: kv[0])))
        return f"DCP on rank {rank}: {_describe(inner, limit)}"
    text = one_line(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _summarize(errors: list[str | None]) -> str | None:
    """The errors of the ranks that had one (index = rank), in one line; None if no rank had one."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return None
    text = "; ".join(f"rank {r}: {e}" for r, e in bad[:3])
    return text + (f"; and {len(bad) - 3} more ranks" if len(bad) > 3 else "")


@dataclass
class SaveRecord:
    """One save as every rank saw it: when it started and finished, where it went, or why it failed."""

    step: int
    path: Path
    started: float
    blocking_s: float = 0.0
    duration_s: float | None = None
    finished_unix: float | None = None
    remote_uri: str | None = None
    error: str | None = None  # the same text on every rank when the save failed


class CheckpointManager:
    """Saves, finalizes, uploads, prunes and resumes checkpoints; every method is called on every rank.

    local_dir: where DCP writes first (node-local NVMe, or a directory every node mounts); created if missing.
    remote_uri: "" or the upload target (s3://, gs://, file://); needed when nodes have separate local_dirs.
    keep: newest complete checkpoints kept, locally on every node and remotely.
    env: this process's rank, world size, local rank and device; None reads them from the default process
        group and torchrun's LOCAL_RANK (trainer.distributed.current_env).
    async_save: save() returns once the state is staged in host memory and writes in the background.
    endpoint_url: an S3-compatible endpoint for remote_uri.
    timeout_s: timeout of the checkpoint's own gloo group; must outlast the slowest rank's write and upload.
    Opening it is collective too (the directory-owner probe), and refuses separate local directories without a
    remote store (BadInput): no node could ever resume from such a checkpoint.
    """

    def __init__(
        self,
        local_dir: Path | str,
        remote_uri: str = "",
        *,
        keep: int = 3,
        env: DistEnv | None = None,
        async_save: bool = True,
        endpoint_url: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        env = env or current_env()
        self.local_dir = Path(local_dir)
        self.remote_uri = remote_uri.rstrip("/")
        self.keep = keep
        self.env = env
        self.async_save = async_save
        self.endpoint_url = endpoint_url
        self.local_dir.mkdir(parents=True, exist_ok=True)
        # Background DCP planning and our own finalize collectives run on this group, never on the default one.
        # Its timeout (the trainer passes trainer.watchdog.checkpoint_timeout_s) must outlast the slowest rank's
        # write and upload, which every other rank waits for in the phase's agreement.
        self._pg = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s) if timeout_s else None
        )
        self._thread: threading.Thread | None = None
        self.store = None
        if self.remote_uri:
            try:
                self.store = open_store(self.remote_uri, endpoint_url=endpoint_url)
            except DataError as exc:
                raise BadInput(f"checkpoint.remote_uri: {exc}") from exc
        # One stager for the whole run: it keeps the CPU copy (pinned on CUDA) of the state between saves
        # and refills it in place, so an async save blocks training only for a memory copy, not for
        # allocating and faulting in a fresh multi-GB buffer each time (torch.distributed.checkpoint.staging).
        # Safe because save() waits for the previous save before staging again.
        cuda = env.device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))
        self.last_success_unix: float | None = None
        self.saved: list[SaveRecord] = []  # every finished save, oldest first
        self.failed: list[SaveRecord] = []  # every failed save, oldest first (same on every rank)
        self.model_touched = False  # a load was attempted (and may have changed parameters) but none succeeded
        self._extra_files: list[str] = []  # this save's files beside DCP's (rank 0's, see save)
        self.owner, self.dir_groups = self._find_directory_owners()
        if len(self.dir_groups) > 1 and self.store is None:
            raise BadInput(
                f"checkpoint.local_dir {self.local_dir} is a separate directory on each of {len(self.dir_groups)} "
                "nodes and checkpoint.remote_uri is empty: each checkpoint would be spread over the nodes' disks "
                "and no node could resume from it; set checkpoint.remote_uri, or put checkpoint.local_dir on "
                "storage that every node mounts"
            )

    # ------------------------------------------------------------------------------------------ collectives
    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(out, value, group=self._pg)
        return out

    def _agree(self, error: str | None) -> str | None:
        """Every rank's error of a phase, as one message every rank gets (None when all succeeded)."""
        return _summarize(self._gather(error))

    def _find_directory_owners(self) -> tuple[bool, list[tuple[int, ...]]]:
        """(this rank owns its local_dir, the groups of node leaders that share a directory)."""
        box = [uuid.uuid4().hex if self.env.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        token = box[0]
        leader = self.env.local_rank == 0
        probe = self.local_dir / f"{_PROBE}{token}-{self.env.rank}"
        error = None
        if leader:
            try:
                probe.write_bytes(b"")
            except OSError as exc:
                error = f"checkpoint.local_dir {self.local_dir}: not writable ({exc.strerror or exc})"
        failure = self._agree(error)
        if failure:
            raise BadInput(failure)
        seen: tuple[int, ...] = ()
        if leader:
            seen = tuple(sorted(int(p.name.rsplit("-", 1)[1]) for p in self.local_dir.glob(f"{_PROBE}{token}-*")))
        views = self._gather((leader, seen))
        if leader:
            probe.unlink(missing_ok=True)
        groups = sorted({view for is_leader, view in views if is_leader})
        return leader and bool(seen) and seen[0] == self.env.rank, groups

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
        meta: dict[str, Any] | None = None,
        files: dict[str, bytes] | None = None,
    ) -> float:
        """Checkpoint `step`. Returns the seconds training was blocked (waiting + staging).

        meta: more top-level manifest keys (JSON), rank 0's (e.g. the tokenizer's description).
        files: {name: bytes} that rank 0 writes into the checkpoint directory beside DCP's files, listed in the
        manifest as its own and uploaded with them (e.g. tokenizer.json); other ranks' are ignored."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time; the group is free again after this
        # One trainer state for the whole checkpoint: rank 0's. DCP stores a value that every rank holds once
        # (its planner de-duplicates replicated entries and may keep any rank's copy), and every directory owner
        # writes its own manifest, so a field that differs between ranks (the MLflow run id exists on rank 0
        # only) would be lost at random.
        box = [(trainer_state, meta or {})]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        trainer_state, meta = box[0]
        self._extra_files = sorted(files or {}) if self.env.rank == 0 else []
        path = self.local_dir / step_dir_name(step)
        early: str | None = None
        if self.owner and exists(path):
            try:
                shutil.rmtree(path)  # an earlier attempt at this step (or an abandoned timeline): never reused
            except OSError as exc:
                early = f"cannot clear {path}: {exc.strerror or exc}"
        dist.barrier(group=self._pg)
        try:
            (path / "rng").mkdir(parents=True, exist_ok=True)
            rng_file = path / "rng" / f"rank_{self.env.rank:05d}.pt"
            tmp = rng_file.with_name(rng_file.name + ".tmp")
            torch.save(rng_state(), tmp)
            os.replace(tmp, rng_file)
            for name in self._extra_files:
                write_atomic(path / name, (files or {})[name])
        except OSError as exc:
            early = early or f"cannot write {path}: {exc.strerror or exc}"

        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        state = {"model": model_sd, "optim": optim_sd, _TRAINER_KEY: json.dumps(trainer_state, sort_keys=True)}
        record = SaveRecord(step=step, path=path, started=time.time())
        extra = {**meta, "trainer": trainer_state, "config": config}
        if self.async_save and not block:
            # Returns once the state is staged (copied) to CPU memory; writing happens in a DCP thread.
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._pg,
                                    async_stager=self._stager)
            self._thread = threading.Thread(
                target=self._finish, args=(record, extra, early, future, None), name=f"ckpt-{step}", daemon=True
            )
            self._thread.start()
        else:
            self._finish(record, extra, early, None, state)
        record.blocking_s = time.perf_counter() - t0
        return record.blocking_s

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _finish(self, record: SaveRecord, extra: dict[str, Any], early: str | None, future: Any,
                state: dict[str, Any] | None) -> None:
        """Write (sync) or wait for the write (async), then manifest, upload and prune, agreeing after each phase.

        Every rank runs the same collectives whatever happens locally: a local failure is data in the next
        agreement, never a skipped collective.
        """
        prefix = step_dir_name(record.step)
        # Phase 1: DCP files on every node (DCP itself agrees on write errors), hashes, stale remote manifest.
        error = early
        try:
            if future is not None:
                future.result()
            else:
                dcp.save(state, checkpoint_id=str(record.path), process_group=self._pg)
        # DCP's own error type derives from BaseException, not Exception.
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported through the agreement
            error = error or f"write: {_describe(exc)}"
        part: dict[str, Any] = {}
        if error is None:
            try:
                part = self._hash_own_files(record.path)
                if self.store is not None and self.env.rank == 0:
                    # A manifest left by an earlier attempt at this step must not vouch for the new files.
                    self.store.delete(f"{prefix}/{MANIFEST}")
            except (OSError, DataError) as exc:
                error = _describe(exc)
        gathered = self._gather((error, part, time.time()))
        failure = _summarize([e for e, _, _ in gathered])
        if failure:
            return self._failed(record, failure)
        files: dict[str, Any] = {}
        for _, p, _ in gathered:
            files.update(p)
        manifest = {
            "format": FORMAT_VERSION,
            "step": record.step,
            "world_size": self.env.world_size,
            "created_unix": gathered[0][2],
            **extra,
            "files": dict(sorted(files.items())),
        }
        manifest_bytes = json.dumps(manifest, indent=1).encode()
        # Phase 2: every directory owner records the complete checkpoint; every rank uploads its own files.
        error = None
        try:
            if self.owner:
                write_atomic(record.path / MANIFEST, manifest_bytes)
                fsync_dir(record.path)
            if self.store is not None:
                for rel in self._own_files(record.path):
                    self.store.upload(record.path / rel, f"{prefix}/{rel}")
        except (OSError, DataError) as exc:
            error = _describe(exc)
        failure = self._agree(error)
        if failure:
            return self._failed(record, failure)
        # Phase 3: rank 0 commits the remote copy: .metadata, then the manifest, which makes it complete.
        if self.store is not None:
            box: list[str | None] = [None]
            if self.env.rank == 0:
                try:
                    self.store.upload(record.path / ".metadata", f"{prefix}/.metadata")
                    self.store.put_bytes(f"{prefix}/{MANIFEST}", manifest_bytes)
                except (OSError, DataError) as exc:
                    box[0] = f"rank 0: {_describe(exc)}"
            dist.broadcast_object_list(box, src=0, group=self._pg)
            if box[0]:
                return self._failed(record, box[0])
            record.remote_uri = f"{self.remote_uri}/{prefix}"
        self._prune(record.step)
        record.finished_unix = self.last_success_unix = time.time()
        record.duration_s = record.finished_unix - record.started  # staging + write + manifest + upload
        self.saved.append(record)
        if self.env.rank == 0:
            log.info("checkpoint step %d saved to %s%s in %.2fs", record.step, record.path,
                     f" and {record.remote_uri}" if record.remote_uri else "", record.duration_s)

    def _failed(self, record: SaveRecord, failure: str) -> None:
        record.error = failure
        self.failed.append(record)
        if self.env.rank == 0:
            log.error("checkpoint step %d failed, the previous checkpoint stands: %s", record.step, failure)

    def _own_files(self, path: Path) -> list[str]:
        """Files this rank wrote: its RNG state, its DCP data files (FileSystemWriter names them
        __<rank>_<n>.distcp), on rank 0 the save's extra files and (DCP's coordinator) .metadata, added by the
        callers that need it."""
        own = [f"rng/rank_{self.env.rank:05d}.pt", *sorted(p.name for p in path.glob(f"__{self.env.rank}_*.distcp"))]
        return own + self._extra_files

    def _hash_own_files(self, path: Path) -> dict[str, Any]:
        rels = self._own_files(path) + ([".metadata"] if self.env.rank == 0 else [])
        return {rel: {"size": (path / rel).stat().st_size, "sha256": sha256_file(path / rel), "rank": self.env.rank}
                for rel in rels}

    # ------------------------------------------------------------------------------------------ prune
    def _prune(self, saved_step: int) -> None:
        """Keep the newest `keep` complete checkpoints up to `saved_step`; delete everything older.

        Directories newer than the step just saved (left by an abandoned attempt) are left alone: they are
        replaced when training gets there again. Failures are logged: pruning never fails a save.
        """
        limit = step_dir_name(saved_step)
        if self.owner:
            try:
                dirs = [p for p in list_step_dirs(self.local_dir) if p.name <= limit]
                complete = [p for p in dirs if is_file(p / MANIFEST)]
                if len(complete) >= self.keep:
                    keep_from = complete[self.keep - 1].name
                    for p in dirs:
                        if p.name < keep_from:
                            shutil.rmtree(p, ignore_errors=True)
            except OSError as exc:
                log.warning("pruning %s failed: %s", self.local_dir, _describe(exc))
        if self.env.rank == 0 and self.store is not None:
            try:
                names, complete_names = self._remote_listing()
                complete_names = [n for n in complete_names if n <= limit]
                if len(complete_names) >= self.keep:
                    keep_from = complete_names[-self.keep]
                    for name in names:
                        if name < keep_from:
                            self.store.delete_prefix(f"{name}/")
            except DataError as exc:
                log.warning("pruning %s failed: %s", self.remote_uri, _describe(exc))

    # ------------------------------------------------------------------------------------------ resume
    def _remote_listing(self) -> tuple[list[str], list[str]]:
        """(every remote step name, those whose manifest is there), oldest first."""
        keys = self.store.list()
        names = sorted({k.split("/", 1)[0] for k in keys if STEP_RE.match(k.split("/", 1)[0])})
        have = set(keys)
        return names, [n for n in names if f"{n}/{MANIFEST}" in have]

    def _local_complete(self) -> tuple[list[str], list[str]]:
        """(step names this directory holds completely: manifest, every file with its size, no hashing yet;
        the directories this user may not read, each with why)."""
        out, denied = [], []
        for p in list_step_dirs(self.local_dir):
            problem = permission_problem(p)
            if problem:
                log.warning("skipping checkpoint %s: %s", p, problem)
                denied.append(f"{p}: {problem}")
                continue
            try:
                manifest = read_manifest(p)
            except CheckpointInvalid as exc:
                if exists(p / MANIFEST):
                    log.warning("skipping checkpoint %s: %s", p, exc)
                elif self.store is None:
                    log.warning("skipping checkpoint %s: no %s (a save that did not finish)", p, MANIFEST)
                else:
                    log.warning("skipping local copy of checkpoint %s: no %s (a save that did not finish); its "
                                "remote copy is tried if it has one", p, MANIFEST)
                continue
            problems = check_files(p, manifest["files"], hashes=False)
            if not problems:
                out.append(p.name)
            elif len(self.dir_groups) == 1 or any(not what.endswith("but missing") for _, what in problems):
                # One directory for all nodes must hold every file; on node-local disks other nodes' files are
                # missing as a rule, but a file that is there and wrong is damage either way.
                if self.store is None:
                    log.warning("skipping checkpoint %s: %s", p, problems[0][1])
                else:
                    log.warning("local copy of checkpoint %s is damaged (%s): its remote copy is tried", p,
                                problems[0][1])
        return out, denied

    def _candidate_manifest(self, name: str, local_names: set[str]) -> dict[str, Any]:
        """Rank 0's reading of a candidate's manifest: the local copy if complete here, else the remote one."""
        if name in local_names:
            return read_manifest(self.local_dir / name)
        uri = f"{self.remote_uri}/{name}/{MANIFEST}"
        try:
            raw = self.store.get_bytes(f"{name}/{MANIFEST}")
        except DataError as exc:
            raise CheckpointInvalid(f"{uri}: unreadable manifest ({exc})") from exc
        manifest = parse_manifest(raw, uri)
        if manifest["step"] != int(name.split("_")[1]):
            raise CheckpointInvalid(f"{uri}: records step {manifest['step']} but the checkpoint is {name}")
        return manifest

    def _materialize(self, name: str, manifest: dict[str, Any]) -> str | None:
        """Make this directory hold checkpoint `name` completely, fetching what is missing or differs; the
        error text, or None."""
        target = self.local_dir / name
        files = manifest["files"]
        try:
            problems = check_files(target, files)
            if problems:
                if self.store is None:
                    return f"{problems[0][1]} (and no checkpoint.remote_uri to fetch it from)"
                for _, what in problems:
                    if not what.endswith("but missing"):  # another node's files are missing as a rule
                        log.warning("checkpoint %s: %s; fetching it again", name, what)
                for rel, _ in problems:
                    dest = target / rel
                    if dest.is_dir() and not dest.is_symlink():
                        shutil.rmtree(dest)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    self.store.download(f"{name}/{rel}", dest)
                still = check_files(target, {rel: files[rel] for rel, _ in problems})
                if still:
                    return f"{self.remote_uri}/{name}: {still[0][1]}"
                log.info("downloaded checkpoint %s/%s (%d of %d files) to %s", self.remote_uri, name,
                         len(problems), len(files), target)
            data = json.dumps(manifest, indent=1).encode()
            mine = target / MANIFEST
            if not mine.is_file() or mine.read_bytes() != data:
                write_atomic(mine, data)
        except (OSError, DataError) as exc:
            return f"{target}: {_describe(exc)}"
        return None

    def resume(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        check: Callable[[dict[str, Any], str], None] | None = None,
        apply: Callable[[dict[str, Any]], None] | None = None,
        report: bool = True,
    ) -> Path | None:
        """Load the newest checkpoint that every rank can read and load; None if there is none.

        With `report`, rank 0 logs one line `resumed from PATH at step N` (a loop that says more itself passes
        False).

        `check(manifest, where)` may raise BadInput to refuse a checkpoint (it runs before anything is
        fetched or loaded, with the same manifest on every rank). `apply(trainer_state)` restores the loop's
        own state; if it raises, the checkpoint counts as damaged. If a load was attempted and none
        succeeded, `model_touched` is set: the caller must rebuild the model and optimizer.
        """
        local: list[str] = []
        denied: list[str] = []
        remote: list[str] = []
        error = None
        if self.owner:
            local, denied = self._local_complete()
        unfinished: set[str] = set()  # rank 0: steps in the store without a manifest
        if self.env.rank == 0 and self.store is not None:
            try:
                names, remote = self._remote_listing()
                unfinished = set(names) - set(remote)
            except DataError as exc:
                error = f"checkpoint.remote_uri: cannot list checkpoints: {exc}"
        views = self._gather((self.owner, local, remote, error, denied))
        if views[0][3]:
            raise BadInput(views[0][3])
        unreadable = [d for view in views for d in view[4]]
        owned = [set(names) for is_owner, names, _, _, _ in views if is_owner]
        common = set.intersection(*owned) if owned else set()
        candidates = sorted(set(views[0][2]) | common, reverse=True)
        for name in sorted(unfinished - common, reverse=True):  # one that every node holds whole is still tried
            log.warning("skipping checkpoint %s/%s: no %s in the store (an upload that did not finish)",
                        self.remote_uri, name, MANIFEST)
        local_here = set(local)
        for name in candidates:
            where = f"{self.remote_uri}/{name}" if name not in common else str(self.local_dir / name)
            box: list[Any] = [None, None]
            if self.env.rank == 0:
                try:
                    box[0] = self._candidate_manifest(name, local_here)
                except CheckpointInvalid as exc:
                    box[1] = str(exc)
            dist.broadcast_object_list(box, src=0, group=self._pg)
            manifest, problem = box
            if problem:
                self._skip(name, problem)
                continue
            if check is not None:
                check(manifest, where)
            problem = self._agree(self._materialize(name, manifest) if self.owner else None)
            if problem:
                self._skip(name, problem)
                continue
            self.model_touched = True
            problem = None
            try:
                self._load(self.local_dir / name, model, optimizer, manifest, apply)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - whatever is wrong, it is skipped
                problem = f"cannot be loaded: {_describe(exc)}"
            problem = self._agree(problem)
            if problem:
                self._skip(name, problem)
                continue
            self.model_touched = False
            if report and self.env.rank == 0:
                log.info("resumed from %s at step %d", self.local_dir / name, manifest["step"])
            return self.local_dir / name
        if unreadable:
            # Starting over would train from step 0 beside checkpoints nobody may read (and could not prune them):
            # the permissions are the owner's to fix.
            raise BadInput(f"checkpoint {unreadable[0]}, and no other checkpoint could be resumed: make it readable "
                           f"by this user, or move it out of {self.local_dir} to start over from step 0")
        if candidates and self.env.rank == 0:
            log.warning("no usable checkpoint among %s: training starts from step 0", ", ".join(candidates))
        return None

    def _skip(self, name: str, problem: str) -> None:
        if self.env.rank == 0:
            log.warning("skipping checkpoint %s: %s", self.local_dir / name, problem)

    def _load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              manifest: dict[str, Any], apply: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        state = {"model": model_sd, "optim": optim_sd, _TRAINER_KEY: ""}
        dcp.load(state, checkpoint_id=str(path), process_group=self._pg)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=STATE_DICT_OPTIONS)
        trainer_state = json.loads(state[_TRAINER_KEY])
        if not isinstance(trainer_state, dict):
            raise CheckpointInvalid(f"{path}: trainer state is not a mapping")
        if manifest["world_size"] == self.env.world_size:
            rng = torch.load(path / "rng" / f"rank_{self.env.rank:05d}.pt", weights_only=False)
            set_rng_state(rng)
        elif self.env.rank == 0:
            log.info(
                "world size changed (%d -> %d): per-rank RNG state not restored; data order is unaffected",
                manifest["world_size"], self.env.world_size,
            )
        if apply is not None:
            apply(trainer_state)
        return trainer_state

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load one given checkpoint directory (collective), without fallback; returns the trainer state."""
        return self._load(Path(path), model, optimizer, read_manifest(Path(path)), None)

    def close(self) -> None:
        self.wait()
        self._stager.close()
