"""Checks of the trainer's inputs that turn a bad setting, path or dataset into one BadInput line naming it.

Usage:
    from trainer.preflight import check_inputs, compatibility_problem
    ds = check_inputs(cfg, run_dir, world_sizes=[8, 16, 24, 32], local_world_size=8)   # BadInput on failure
    reason = compatibility_problem(cfg, manifest, where, ds.manifest_sha256)  # may this checkpoint be resumed?
    ds.close()

The launcher (trainer/launch.py) runs them once per node before torchrun starts, for every world size the
job may run at; each worker runs them again for its own world size (a worker may be started without the
launcher, and a setting may differ per node). They only read, except for a probe file created and removed
in each directory that must be writable, so a refused launch leaves the run directory as it was.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpu_train.sizing.layout import batch_layout
from gpu_train.sizing.memory import sized
from gpu_train.spec.trainer_config import MAX_PORT, Config, ConfigError, to_dict
from trainer.checkpoint.manifest import FORMAT_VERSION
from trainer.errors import BadInput

# Keys that fix the parameter shapes: a checkpoint made with other values cannot be loaded.
SHAPE_KEYS = ("n_layer", "n_head", "d_model", "context", "vocab_size", "norm", "pos", "mlp_ratio")


def cache_dir_of(cfg: Config) -> Path:
    """data.cache_dir, or the shared per-user cache it stands for when empty (trainer.data.shards)."""
    from trainer.data.shards import default_cache_dir

    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()


def data_endpoint(cfg: Config) -> str | None:
    """The dataset's S3-compatible endpoint: data.endpoint_url, else env TRAINER_S3_ENDPOINT_URL; None: the store's
    own."""
    return cfg.data.endpoint_url or os.environ.get("TRAINER_S3_ENDPOINT_URL") or None


def dataset_options(cfg: Config) -> dict[str, Any]:
    """open_dataset's arguments for the data.* settings (the same for both splits)."""
    d = cfg.data
    return {
        "context": cfg.model.context,
        "cache_dir": d.cache_dir or None,
        "cache_max_bytes": d.cache_max_bytes or None,
        "cache_disk_fraction": d.cache_disk_fraction,
        "prefetch_shards": d.prefetch_shards,
        "endpoint_url": data_endpoint(cfg),
        # "auto" leaves env TRAINER_S3_AUTH its say (gpu_train/storage.py); the other two force a mode.
        "endpoint_auth": None if d.endpoint_auth == "auto" else d.endpoint_auth,
        "packing": d.packing,
        "read_mode": d.read_mode,
        "verify": d.verify,
    }


def checkpoint_dir_of(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.local_dir or run_dir / "checkpoints")


def check_writable_dir(path: Path, key: str) -> None:
    """Create `path` if needed and prove a file can be written in it; BadInput naming `key` otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"{key} {path}: not a writable directory ({exc.strerror or exc})") from exc


def check_world_sizes(cfg: Config, world_sizes: Iterable[int]) -> None:
    for world in world_sizes:
        try:  # train.micro_batch_size=auto: the layout must divide for some micro batch (memory is the worker's)
            batch_layout(sized(cfg, world, math.inf), world)
        except ConfigError as exc:
            raise ConfigError(f"at world size {world}: {exc}") from exc


def check_metrics_port(cfg: Config, local_world_size: int) -> None:
    """Each worker of a node serves metrics on metrics.port + LOCAL_RANK; the last one must be a valid port."""
    port = cfg.metrics.port
    if port and port + local_world_size - 1 > MAX_PORT:
        raise ConfigError(
            f"metrics.port {port} + {local_world_size - 1} (one port per worker of a node) is above {MAX_PORT}"
        )


def check_tracking(cfg: Config, run_dir: Path) -> None:
    """The MLflow settings the tracker would refuse on rank 0 only (trainer/tracking.py, Tracker.create)."""
    from trainer.tracking import resolve_tracking_uri

    if not cfg.tracking.enabled:
        return
    if not cfg.tracking.experiment.strip():
        raise ConfigError("tracking.experiment must not be empty")
    try:
        resolve_tracking_uri(cfg.tracking.uri, run_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def open_checked_dataset(cfg: Config, split: str = "train") -> Any:
    """Open the dataset (or its held-out split) as the loop will, and check it against the model; BadInput
    naming the key."""
    from trainer.data import open_dataset
    from trainer.data.errors import DataError

    if cfg.data.uri != "synthetic":
        key = "data.cache_dir" if cfg.data.cache_dir else f"data.cache_dir (default {cache_dir_of(cfg)})"
        check_writable_dir(cache_dir_of(cfg), key)
    # The held-out split is only read for the validation loss: say which setting asked for it.
    culprit = "data.uri" if split == "train" else f"eval.every_steps={cfg.eval.every_steps} needs the validation split of data.uri"
    try:
        ds = open_dataset(cfg.data.uri, split=split, **dataset_options(cfg))
    except DataError as exc:
        raise BadInput(f"{culprit}: {exc}") from exc
    except OSError as exc:
        raise BadInput(f"{culprit} {cfg.data.uri}: {exc.strerror or exc} ({getattr(exc, 'filename', '')})") from exc
    try:
        if ds.num_windows < 1:
            raise ConfigError(
                f"model.context ({cfg.model.context}) is longer than the data: dataset {ds.uri} holds no "
                f"window of model.context + 1 = {cfg.model.context + 1} tokens; lower model.context"
            )
        ds_vocab = getattr(ds, "vocab_size", None)
        if ds_vocab is not None and cfg.model.vocab_size < ds_vocab:
            raise ConfigError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of dataset "
                f"{cfg.data.uri} ({ds_vocab}, from its manifest); set model.vocab_size >= {ds_vocab}"
            )
    except BaseException:
        ds.close()
        raise
    return ds


def check_inputs(cfg: Config, run_dir: Path, *, world_sizes: Iterable[int], local_world_size: int) -> Any:
    """Everything checkable before training: batch layout, port range, tracking settings, writable directories,
    the dataset (and its validation split when eval.every_steps asks for evaluations).

    Returns the open dataset (the caller closes it).
    """
    check_world_sizes(cfg, world_sizes)
    check_metrics_port(cfg, local_world_size)
    check_tracking(cfg, Path(run_dir))
    check_writable_dir(Path(run_dir), "--run-dir")
    check_writable_dir(checkpoint_dir_of(cfg, Path(run_dir)),
                       "checkpoint.local_dir" if cfg.checkpoint.local_dir else "checkpoint.local_dir (RUN_DIR/checkpoints)")
    ds = open_checked_dataset(cfg)
    if cfg.eval.every_steps:
        try:
            open_checked_dataset(cfg, split="val").close()
        except BaseException:
            ds.close()
            raise
    return ds


def _shape(model_cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={model_cfg.get(k)!r}" for k in SHAPE_KEYS)


def compatibility_problem(cfg: Config, manifest: dict[str, Any], where: str, manifest_sha: str) -> str | None:
    """Why the checkpoint described by `manifest` must not be resumed with `cfg` and this dataset, or None.

    The model shape must match (else DCP cannot load it), and so must what fixes the sample order: the
    dataset's manifest hash, train.global_batch_tokens, train.seed, data.packing (which windows exist) and
    data.block_shards (else the run would silently continue on other data or another order). A checkpoint
    written before the block shuffle (its sampler state counts no shards) is refused for the same reason.
    Everything else (steps, learning rate, world size, ddp/fsdp, evaluation, watchdog) may change; the learning
    rate schedule continues at the checkpoint's step under the new settings (trainer.parallelize.continue_schedule).
    """
    if manifest.get("format", 0) < FORMAT_VERSION:
        layout = ("separate query, key and value matrices per block" if manifest.get("format") == 3 else
                  "one fused query/key/value matrix per block, optimizer state by group")
        return (f"checkpoint {where} is in format {manifest.get('format')} ({layout}): this trainer writes and "
                f"resumes format {FORMAT_VERSION} (query, key and value in one matrix, head by head). Export its "
                "weights (python -m trainer.export reads every format) or start a new run directory")
    ck_cfg = manifest.get("config") or {}
    ck_model = ck_cfg.get("model")
    mine = to_dict(cfg)
    if isinstance(ck_model, dict):
        differ = [k for k in SHAPE_KEYS if ck_model.get(k) != mine["model"][k]]
        if differ:
            return (f"checkpoint {where} holds a model with {_shape(ck_model)} but the settings ask for "
                    f"{_shape(mine['model'])} (model.{', model.'.join(differ)} differ): set them back, or train "
                    "the new shape in a new --run-dir with its own checkpoint.local_dir and checkpoint.remote_uri")
    # (section, key, what a checkpoint without the key was trained with; None: nothing to compare)
    order_keys = (("train", "global_batch_tokens", None), ("train", "seed", None), ("data", "packing", True),
                  ("data", "block_shards", None))
    for section, key, before in order_keys:
        ck_section = ck_cfg.get(section)
        if not isinstance(ck_section, dict):
            continue
        theirs = ck_section.get(key, before)
        if theirs is not None and theirs != mine[section][key]:
            return (f"checkpoint {where} was trained with {section}.{key}={theirs} but the settings "
                    f"say {section}.{key}={mine[section][key]}: the sample order would change mid-run; set it "
                    "back or start a new run directory")
    trainer_state = manifest.get("trainer") or {}
    sampler = trainer_state.get("sampler")
    if isinstance(sampler, dict) and not sampler.get("num_shards"):
        return (f"checkpoint {where} was written before the block shuffle (data.block_shards): this trainer cannot "
                "continue its whole-dataset sample order; start a new run directory")
    data = trainer_state.get("dataset")
    if isinstance(data, dict) and data.get("manifest_sha256") and data["manifest_sha256"] != manifest_sha:
        return (f"checkpoint {where} was trained on dataset {data.get('uri')} (manifest sha256 "
                f"{str(data['manifest_sha256'])[:16]}) but data.uri={cfg.data.uri} has manifest sha256 "
                f"{manifest_sha[:16]}: resume with the same dataset, or start a new run directory")
    return None
