"""Trainer configuration: one tree of frozen dataclasses, named presets, YAML files and dotted overrides.

Usage:
    from gpu_train.spec.trainer_config import build_config
    cfg = build_config("tiny", config_file=None, overrides=["train.steps=50", "model.norm=rmsnorm"])
    cfg.train.steps            # 50
    flatten(cfg)               # {"model.n_layer": 2, ...} for MLflow params

Every key has one type. An override naming a key that does not exist, a value that does not parse as the
key's type, or a value outside the key's range (a non-finite number, a port above 65535, a URI with an
unknown scheme, ...) raises ConfigError naming the key; the command line turns that into exit code 2. It lives
in the platform's core (no torch) because a job spec's trainer settings are checked against it wherever a job
is made: the plan, `gpu-train submit` and `run --local`, and the trainer itself.

Over 400 lines because the schema, its presets, its one parser and its checks (the parallel degrees' among them,
static_problems) are read together everywhere; the checks at a world size (the parallel layout) are
gpu_train/sizing/layout.py's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml

from gpu_train.spec import env as job_env
from gpu_train.spec import yamlfile
from gpu_train.spec.errors import ConfigError
from gpu_train.spec.values import NonFiniteError, ValueTextError, as_uri, parse_bool, parse_float, parse_int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads per block
    d_model: int = 64  # residual stream width
    context: int = 64  # tokens per sequence (T)
    vocab_size: int = 264  # must be >= the dataset's vocab_size (manifest)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    pos: Literal["learned", "rope"] = "learned"
    dropout: float = 0.0
    mlp_ratio: int = 4  # hidden width of the MLP = mlp_ratio * d_model


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200  # optimizer steps
    global_batch_tokens: int = 4096  # tokens per optimizer step over all workers, constant under elasticity
    # Sequences per forward/backward on one worker; auto: the largest that divides the step and fits the worker's
    # memory by the estimate (gpu_train/sizing/memory.py fitting_micro_batch), chosen where the world size is known.
    micro_batch_size: int | Literal["auto"] = 8
    lr: float = 3e-3  # peak learning rate after warmup
    min_lr: float = 3e-4  # floor of the cosine decay
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 1234
    parallel: Literal["ddp", "fsdp"] = "ddp"  # data parallelism: replicate (ddp) or shard (fsdp, FSDP2) the model
    # Model parallelism (docs/trainer.md, Choosing a layout; gpu_train/sizing/layout.py): ranks form a mesh
    # (pp, dp_replicate, dp_shard, tp) with tp innermost, so a tensor-parallel group is one node's GPUs.
    tp: int = 1  # tensor-parallel degree: each block's matmuls split over this many GPUs of one node
    pp: int = 1  # pipeline-parallel degree: the blocks split into consecutive stages over this many GPUs
    dp_replicate: int = 1  # fsdp: replica groups (HSDP across nodes); -1 = what train.dp_shard leaves
    dp_shard: int = -1  # fsdp: GPUs a model is sharded over; -1 = world / (pp x tp x dp_replicate)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_microbatches: int = 0  # micro batches per pipeline schedule run; 0 = all of the step's in one run
    pp_stages_per_rank: int = 1  # interleaved_1f1b: stages each pipeline rank holds (2 or more)
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False  # torch.compile the model
    # F.scaled_dot_product_attention's kernel on CUDA: auto = torch's choice (flash on an H100 in bf16, which
    # measured fastest there, docs/performance.md); one name = that kernel alone. A CPU always takes torch's choice.
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    # The output layer and the loss in chunks of this many tokens, so the (tokens x vocabulary) logits never exist
    # whole (trainer/model.py, chunked_lm_loss); 0 = in one piece. Without tensor and pipeline parallelism only.
    loss_chunk_tokens: int = 8192
    activation_checkpointing: bool = False  # recompute each block in backward to save memory
    deterministic: bool = True  # torch.use_deterministic_algorithms (warn-only on CUDA kernels without one)
    # A token budget ({"tokens": N}, file://, s3:// or gs://): train to N tokens, then hold there, checkpoint saved,
    # until it is raised or the run is stopped; status.json is written beside it (trainer/budget.py). "" = none.
    budget_uri: str = ""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    uri: str = "synthetic"  # dataset manifest URI (file://, s3://, gs://) or "synthetic"
    endpoint_url: str = ""  # S3-compatible endpoint override; "" = env TRAINER_S3_ENDPOINT_URL or AWS default
    # Request signing (gpu_train/storage.py): auto = unsigned to the Alluxio S3 proxy, SigV4 elsewhere.
    endpoint_auth: Literal["auto", "sigv4", "unsigned"] = "auto"
    cache_dir: str = ""  # shard cache; "" = the shared one: env TRAINER_CACHE_DIR, else ~/.cache/gpu-train/shards
    cache_max_bytes: int = 0  # cache budget; 0 = cache_disk_fraction of the disk holding cache_dir
    cache_disk_fraction: float = 0.5  # share of that disk the cache may use when cache_max_bytes is 0
    prefetch_shards: int = 2  # shards downloaded in parallel ahead of use
    block_shards: int = 4  # shards per block of the block shuffle (trainer/data/sampler.py); 0 = one block
    packing: bool = True  # false: no training window crosses a document boundary
    # Where shard bytes live (trainer/data/shards.py): auto = direct for file://, memory behind the cache proxy,
    # disk otherwise.
    read_mode: Literal["auto", "direct", "disk", "memory"] = "auto"
    verify: Literal["seal", "full"] = "seal"  # seal: hash a cached shard only when its seal changed; full: always


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every_steps: int = 0  # validation loss every N steps and at the end; 0 = off
    batches: int = 20  # micro batches of held-out windows per evaluation (the same windows every time)
    micro_batch_size: int = 0  # sequences per forward in evaluation; 0 = train.micro_batch_size
    early_stopping_patience: int = 0  # stop after this many evaluations without a new best; 0 = never
    sample_tokens: int = 100  # tokens sampled from the final model at the end of a run; 0 = no sample
    sample_prompt: str = ""  # text the end-of-run sample continues; "" = the start of a document


@dataclass(frozen=True, kw_only=True)
class WatchdogConfig:
    enabled: bool = True  # a per-rank thread that ends a hung worker (trainer/watchdog.py)
    factor: float = 10.0  # a step may take factor x the median of the last `window` steps ...
    window: int = 20
    floor_s: float = 300.0  # ... but never less than this
    warmup_steps: int = 3  # the first steps of each launch (compilation, cold caches) get startup_s each
    startup_s: float = 900.0  # also the most any step is ever allowed
    checkpoint_s: float = 1800.0  # a blocking checkpoint save (or waiting for a background one)
    eval_s: float = 900.0  # one evaluation of the validation loss


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    local_dir: str = ""  # "" = RUN_DIR/checkpoints
    remote_uri: str = ""  # "" = no upload; s3://, gs://, file://
    # S3-compatible endpoint for remote_uri; "" = env TRAINER_S3_ENDPOINT_URL, else the provider's default.
    # Separate from data.endpoint_url, which usually points at the read cache (Alluxio proxy).
    endpoint_url: str = ""
    every_steps: int = 50  # 0 = only at the end and on SIGTERM
    keep: int = 3  # newest checkpoints kept locally and remotely
    async_save: bool = True  # write in the background while training continues


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    port: int = 0  # Prometheus port of local rank 0 (each worker binds port + LOCAL_RANK); 0 = off
    log_every: int = 10  # steps between console/JSONL metric lines
    batch_hash: bool = False  # log a hash of each global batch's window indices (elasticity checks)


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    enabled: bool = True
    uri: str = ""  # "" = env MLFLOW_TRACKING_URI, else an embedded local store under runs/
    experiment: str = "gpu-train"
    register_name: str = ""  # "" = don't register the final model
    parent_run_id: str = ""  # MLflow run this run is a child of (tag mlflow.parentRunId): a sweep's trials
    log_every: int = 10


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)


# ---------------------------------------------------------------------------------------------- presets
# Real presets use GPT-2's vocabulary padded to a multiple of 64 (50257 -> 50304), which keeps the embedding
# and output matmuls on tensor-core friendly shapes (https://github.com/karpathy/nanoGPT, model.py).
GPT2_VOCAB = 50304


def _preset(model: ModelConfig, train: TrainConfig, checkpoint_every: int) -> Config:
    return Config(model=model, train=train, checkpoint=CheckpointConfig(every_steps=checkpoint_every))


def tiny() -> Config:
    """Seconds on a CPU; byte-level vocabulary that covers `python -m trainer.data synth` output."""
    return Config()


def gpt2_124m() -> Config:
    """GPT-2 small shape (12 x 768, 12 heads, 1024 context): ~124M parameters with tied embeddings."""
    return _preset(ModelConfig(n_layer=12, n_head=12, d_model=768, context=1024, vocab_size=GPT2_VOCAB),
                   TrainConfig(steps=5000, global_batch_tokens=524288, micro_batch_size=16, lr=6e-4,
                               min_lr=6e-5, warmup_steps=200), 500)


def gpt2_350m() -> Config:
    """GPT-2 medium shape (24 x 1024, 16 heads, 1024 context): ~350M parameters."""
    return _preset(ModelConfig(n_layer=24, n_head=16, d_model=1024, context=1024, vocab_size=GPT2_VOCAB),
                   TrainConfig(steps=10000, global_batch_tokens=524288, micro_batch_size=8, lr=3e-4,
                               min_lr=3e-5, warmup_steps=500), 500)


def one_b() -> Config:
    """~1.1B parameters (20 x 2048, 16 heads, 2048 context), RMSNorm + RoPE."""
    return _preset(ModelConfig(n_layer=20, n_head=16, d_model=2048, context=2048, vocab_size=GPT2_VOCAB,
                               norm="rmsnorm", pos="rope"),
                   TrainConfig(steps=20000, global_batch_tokens=1048576, micro_batch_size=4, lr=3e-4,
                               min_lr=3e-5, warmup_steps=1000, activation_checkpointing=True), 500)


def seven_b() -> Config:
    """~6.6B parameters (32 x 4096, 32 heads, 4096 context), sharded with FSDP2."""
    return _preset(ModelConfig(n_layer=32, n_head=32, d_model=4096, context=4096, vocab_size=GPT2_VOCAB,
                               norm="rmsnorm", pos="rope"),
                   TrainConfig(steps=50000, global_batch_tokens=4194304, micro_batch_size=1, lr=1.5e-4,
                               min_lr=1.5e-5, warmup_steps=2000, parallel="fsdp",
                               activation_checkpointing=True), 250)


def gpt2_2_7b() -> Config:
    """GPT-3 2.7B's shape in GPT-2's architecture (32 x 2560, 32 heads, 2048 context; Brown et al. 2020, table
    2.1): ~2.65B parameters. The layout here is the one for 8-GPU NVLink nodes (H100, H200, A100, B200); on other
    GPUs use the overrides gpu_train.sizing.memory.RECOMMENDED_LAYOUTS names for them (docs/trainer.md)."""
    return _preset(ModelConfig(n_layer=32, n_head=32, d_model=2560, context=2048, vocab_size=GPT2_VOCAB),
                   TrainConfig(steps=50000, global_batch_tokens=1048576, micro_batch_size=4, lr=1.6e-4,
                               min_lr=1.6e-5, warmup_steps=1000, parallel="fsdp", dp_shard=8,
                               dp_replicate=-1), 250)


PRESETS: dict[str, Callable[[], Config]] = {
    "tiny": tiny,
    "gpt2-124m": gpt2_124m,
    "gpt2-350m": gpt2_350m,
    "1b": one_b,
    "gpt2-2.7b": gpt2_2_7b,
    "7b": seven_b,
}


# ---------------------------------------------------------------------------------------------- parsing
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


class _WrongType(ConfigError):
    """A value of another type than the key's ("expected an integer, got 'x'"): a union tries its next member."""


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a YAML or command-line value to the key's declared type, or raise ConfigError naming the key.

    Text is read by the core's one parser (gpu_train.spec.values): booleans only true/false, whole numbers as
    Python integer literals, finite numbers; a string is kept exactly as typed, spaces included."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # int | Literal["auto"]: a named word, else the number
        number, words = typing.get_args(typ)
        if value in typing.get_args(words):
            return value
        try:
            return _coerce(key, value, number)
        except _WrongType:
            raise ConfigError(f"{key}: expected an integer or {', '.join(typing.get_args(words))}, got {value!r}") \
                from None
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))} (got {value!r})")
        return value
    if typ is str:
        if isinstance(value, str):
            return value
        raise _WrongType(f"{key}: expected a string, got {value!r}")
    parse, word = {bool: (parse_bool, "true or false"), int: (parse_int, "an integer"),
                   float: (parse_float, "a number")}.get(typ, (None, ""))
    if parse is None:
        raise ConfigError(f"{key}: unsupported type {typ}")
    if isinstance(value, str):
        try:
            return parse(value)
        except NonFiniteError:
            raise ConfigError(f"{key} must be a finite number (got {value})") from None
        except ValueTextError:
            raise _WrongType(f"{key}: expected {word}, got {value!r}") from None
    # A YAML value: already typed. bool is an int in Python, so it is checked first.
    if typ is bool and isinstance(value, bool):
        return value
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise _WrongType(f"{key}: expected {word}, got {value!r}")


def _apply(cfg: Config, key: str, raw: Any) -> Config:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{key}: keys are section.name, e.g. train.steps (sections: {', '.join(_sections())})")
    section, name = parts
    if section not in _sections():
        raise ConfigError(f"{key}: unknown section {section!r} (sections: {', '.join(_sections())})")
    sub = getattr(cfg, section)
    types_ = _field_types(type(sub))
    if name not in types_:
        raise ConfigError(f"{key}: unknown key (keys in {section}: {', '.join(types_)})")
    value = _coerce(key, raw, types_[name])
    return replace(cfg, **{section: replace(sub, **{name: value})})


def _sections() -> list[str]:
    return [f.name for f in fields(Config)]


def parse_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, value = text.split("=", 1)
    return key.strip(), value  # the value as typed: "eval.sample_prompt=def " keeps its space


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yamlfile.load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: top level must be a mapping of sections")
    flat: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: section {section!r} must be a mapping")
        for name, value in values.items():
            flat[f"{section}.{name}"] = value
    return flat


def build_config(
    preset: str = "tiny", config_file: Path | None = None, overrides: Iterable[str] = ()
) -> Config:
    """Preset, then the YAML file, then command-line overrides (last wins); validated as a whole."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    cfg = PRESETS[preset]()
    if config_file is not None:
        for key, value in load_yaml(config_file).items():
            cfg = _apply(cfg, key, value)
    for text in overrides:
        key, value = parse_override(text)
        cfg = _apply(cfg, key, value)
    # A plain path where a file:// URI is expected: the file:// URI of its absolute path, in the resolved config.
    if cfg.data.uri != "synthetic":
        cfg = replace(cfg, data=replace(cfg.data, uri=as_uri(cfg.data.uri)))
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, remote_uri=as_uri(cfg.checkpoint.remote_uri)))
    if cfg.train.budget_uri:
        cfg = replace(cfg, train=replace(cfg.train, budget_uri=as_uri(cfg.train.budget_uri)))
    if not cfg.metrics.port and os.environ.get(job_env.METRICS_PORT):
        try:
            cfg = _apply(cfg, "metrics.port", os.environ[job_env.METRICS_PORT])
        except ConfigError as exc:
            raise ConfigError(f"env {job_env.METRICS_PORT}: {exc}") from None
    validate(cfg)
    return cfg


MAX_PORT = 65535
MAX_SEED = 2**63 - 1  # torch.manual_seed takes up to 2**64 - 1; each rank seeds train.seed + 1 + rank
# Scheme -> what the rest of the URI must have. The storage layer (gpu_train/storage.py) does the same check
# when it opens the store; checking here as well lets a plan or a launch fail before any pod starts.
_URI_SCHEMES = ("file", "s3", "gs")


def _check_uri(key: str, value: str, *, extra: tuple[str, ...] = ()) -> None:
    if value in extra:
        return
    parsed = urlparse(value)
    allowed = ", ".join([*extra, *(f"{s}://" for s in _URI_SCHEMES)])
    if parsed.scheme not in _URI_SCHEMES:
        raise ConfigError(f"{key}: unsupported URI {value!r} (use {allowed})")
    if parsed.scheme == "file" and (parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/")):
        raise ConfigError(f"{key}: file URIs must be absolute, file:///abs/dir (got {value!r})")
    if parsed.scheme in ("s3", "gs") and not parsed.netloc:
        raise ConfigError(f"{key}: {value!r} names no bucket ({parsed.scheme}://BUCKET/prefix)")


def _check_endpoint(key: str, value: str) -> None:
    if not value:
        return
    parsed = urlparse(value)
    try:
        port_ok = parsed.port is None or 0 < parsed.port <= MAX_PORT
    except ValueError:
        port_ok = False
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port_ok:
        raise ConfigError(f"{key}: expected an http(s)://host[:port] URL (got {value!r})")


def _check_ranges(cfg: Config) -> None:
    """Each key alone: finite floats, counts and sizes > 0 or >= 0, ratios in their intervals."""
    m, t, wd = cfg.model, cfg.train, cfg.watchdog
    # Every float key: NaN or infinity never makes sense (a NaN train.lr crashes the scheduler, an infinite
    # one trains on NaN losses).
    for sec in fields(Config):
        sub = getattr(cfg, sec.name)
        for name, typ in _field_types(type(sub)).items():
            value = getattr(sub, name)
            if typ is float and not math.isfinite(value):
                raise ConfigError(f"{sec.name}.{name} must be a finite number (got {value})")
    positive = {
        "model.n_layer": m.n_layer, "model.n_head": m.n_head, "model.d_model": m.d_model,
        "model.context": m.context, "model.vocab_size": m.vocab_size, "model.mlp_ratio": m.mlp_ratio,
        "train.steps": t.steps, "train.global_batch_tokens": t.global_batch_tokens,
        "train.micro_batch_size": 1 if t.micro_batch_size == "auto" else t.micro_batch_size, "train.lr": t.lr, "checkpoint.keep": cfg.checkpoint.keep,
        "metrics.log_every": cfg.metrics.log_every, "tracking.log_every": cfg.tracking.log_every,
        "eval.batches": cfg.eval.batches, "watchdog.window": wd.window, "watchdog.floor_s": wd.floor_s,
        "watchdog.startup_s": wd.startup_s, "watchdog.checkpoint_s": wd.checkpoint_s, "watchdog.eval_s": wd.eval_s,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0 (got {value})")
    non_negative = {
        "train.warmup_steps": t.warmup_steps, "train.grad_clip": t.grad_clip,
        "train.loss_chunk_tokens": t.loss_chunk_tokens,
        "train.min_lr": t.min_lr, "train.weight_decay": t.weight_decay,
        "checkpoint.every_steps": cfg.checkpoint.every_steps, "metrics.port": cfg.metrics.port,
        "data.prefetch_shards": cfg.data.prefetch_shards, "data.cache_max_bytes": cfg.data.cache_max_bytes,
        "data.block_shards": cfg.data.block_shards, "eval.every_steps": cfg.eval.every_steps,
        "eval.micro_batch_size": cfg.eval.micro_batch_size,
        "eval.early_stopping_patience": cfg.eval.early_stopping_patience,
        "eval.sample_tokens": cfg.eval.sample_tokens, "watchdog.warmup_steps": wd.warmup_steps,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (got {value})")
    for key, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= value < 1.0:  # AdamW's own range (torch.optim.AdamW raises on anything else)
            raise ConfigError(f"{key} must be in [0, 1) (got {value})")
    if not 0.0 < cfg.data.cache_disk_fraction <= 1.0:
        raise ConfigError(f"data.cache_disk_fraction must be in (0, 1] (got {cfg.data.cache_disk_fraction})")


def validate(cfg: Config) -> None:
    """Every key in its range, then the keys that must agree with each other; ConfigError naming the key."""
    _check_ranges(cfg)
    m, t, wd = cfg.model, cfg.train, cfg.watchdog
    if cfg.eval.early_stopping_patience and not cfg.eval.every_steps:
        raise ConfigError(
            f"eval.early_stopping_patience={cfg.eval.early_stopping_patience} needs evaluations: set "
            "eval.every_steps > 0"
        )
    if wd.factor < 1.0:
        raise ConfigError(f"watchdog.factor must be >= 1 (got {wd.factor}): a step as long as the median is no hang")
    if wd.startup_s < wd.floor_s:
        raise ConfigError(f"watchdog.startup_s ({wd.startup_s}) must be >= watchdog.floor_s ({wd.floor_s})")
    if cfg.metrics.port > MAX_PORT:
        raise ConfigError(f"metrics.port must be a TCP port, 0..{MAX_PORT} (got {cfg.metrics.port})")
    if not 0 <= t.seed <= MAX_SEED:
        raise ConfigError(f"train.seed must be in 0..{MAX_SEED} (got {t.seed})")
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})")
    if m.pos == "rope" and (m.d_model // m.n_head) % 2:
        raise ConfigError(f"model.pos=rope needs an even head size (model.d_model / model.n_head = "
                          f"{m.d_model // m.n_head})")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1) (got {m.dropout})")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must be <= train.lr ({t.lr})")
    if t.global_batch_tokens % m.context:
        raise ConfigError(
            f"train.global_batch_tokens ({t.global_batch_tokens}) must be a multiple of model.context "
            f"({m.context})"
        )
    sequences = t.global_batch_tokens // m.context
    if t.micro_batch_size != "auto" and sequences % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_tokens / model.context = {sequences} sequences is not divisible by "
            f"train.micro_batch_size ({t.micro_batch_size})"
        )
    check_static(cfg)  # the parallel degrees that cannot work at any world size
    _check_uri("data.uri", cfg.data.uri, extra=("synthetic",))
    if cfg.data.read_mode == "direct" and urlparse(cfg.data.uri).scheme != "file":
        raise ConfigError(f"data.read_mode=direct memory-maps shards where they are and needs a file:// data.uri "
                          f"(got {cfg.data.uri!r}); use auto, disk or memory")
    if cfg.checkpoint.remote_uri:
        _check_uri("checkpoint.remote_uri", cfg.checkpoint.remote_uri)
    if cfg.train.budget_uri:
        _check_uri("train.budget_uri", cfg.train.budget_uri)
        if not urlparse(cfg.train.budget_uri).path.rstrip("/").rpartition("/")[2]:
            raise ConfigError(f"train.budget_uri: {cfg.train.budget_uri!r} names no object (./budget.json)")
    _check_endpoint("data.endpoint_url", cfg.data.endpoint_url)
    _check_endpoint("checkpoint.endpoint_url", cfg.checkpoint.endpoint_url)
    _check_endpoint("env TRAINER_S3_ENDPOINT_URL", os.environ.get("TRAINER_S3_ENDPOINT_URL", ""))


def static_problems(cfg: Any) -> list[str]:
    """What is wrong with the degrees whatever the world size (cfg: a trainer Config), each naming its setting."""
    m, t = cfg.model, cfg.train
    p: list[str] = []
    for key, value in (("train.tp", t.tp), ("train.pp", t.pp), ("train.pp_stages_per_rank", t.pp_stages_per_rank)):
        if value < 1:
            p.append(f"{key} must be >= 1 (got {value})")
    for key, value in (("train.dp_replicate", t.dp_replicate), ("train.dp_shard", t.dp_shard)):
        if value < 1 and value != -1:
            p.append(f"{key} must be >= 1, or -1 for the rest of the world (got {value})")
    if t.pp_microbatches < 0:
        p.append(f"train.pp_microbatches must be >= 0 (got {t.pp_microbatches})")
    if p:
        return p
    if t.dp_replicate == -1 and t.dp_shard == -1:
        p.append("train.dp_replicate=-1 and train.dp_shard=-1: only one of them can take the rest of the world")
    if t.parallel == "ddp" and (t.dp_replicate, t.dp_shard) != (1, -1):
        p.append(f"train.dp_replicate={t.dp_replicate}, train.dp_shard={t.dp_shard}: splitting data parallelism "
                 "into shard and replicate groups needs train.parallel=fsdp (ddp replicates over all of it)")
    if t.tp > 1:
        p += _tp_problems(m, t.tp)
    if t.pp > 1:
        p += _pp_problems(m, t)
    else:
        for key, value, default in (("train.pp_stages_per_rank", t.pp_stages_per_rank, 1),
                                    ("train.pp_microbatches", t.pp_microbatches, 0)):
            if value != default:
                p.append(f"{key}={value} needs train.pp > 1 (got train.pp={t.pp})")
    if t.compile and (t.tp > 1 or t.pp > 1):
        p.append(f"train.compile=true composes with ddp and fsdp alone, not with train.tp={t.tp} or "
                 f"train.pp={t.pp}; set train.compile=false")
    return p


def _tp_problems(m: Any, tp: int) -> list[str]:
    p = []
    if m.n_head % tp:
        p.append(f"train.tp={tp}: model.n_head {m.n_head} is not divisible by {tp} (each tensor-parallel rank "
                 "computes whole attention heads)")
    if (m.mlp_ratio * m.d_model) % tp:
        p.append(f"train.tp={tp}: the MLP width model.mlp_ratio x model.d_model = {m.mlp_ratio * m.d_model} is not "
                 f"divisible by {tp}")
    if m.vocab_size % tp:
        p.append(f"train.tp={tp}: model.vocab_size {m.vocab_size} is not divisible by {tp} (the loss is computed "
                 f"over vocabulary shards); pad it to {math.ceil(m.vocab_size / tp) * tp}")
    if m.context % tp:
        p.append(f"train.tp={tp}: model.context {m.context} is not divisible by {tp} (sequence parallelism splits "
                 "each sequence between the ranks)")
    return p


def _pp_problems(m: Any, t: Any) -> list[str]:
    p = []
    stages = t.pp * t.pp_stages_per_rank
    if t.pp_schedule == "interleaved_1f1b" and t.pp_stages_per_rank < 2:
        p.append(f"train.pp_schedule=interleaved_1f1b needs train.pp_stages_per_rank >= 2 (got "
                 f"{t.pp_stages_per_rank}); use 1f1b for one stage per rank")
    if t.pp_schedule != "interleaved_1f1b" and t.pp_stages_per_rank != 1:
        p.append(f"train.pp_stages_per_rank={t.pp_stages_per_rank} needs train.pp_schedule=interleaved_1f1b "
                 f"(got {t.pp_schedule}, one stage per rank)")
    elif m.n_layer % stages:
        split = f"train.pp={t.pp}" + (f" x train.pp_stages_per_rank={t.pp_stages_per_rank}"
                                     if t.pp_stages_per_rank > 1 else "")
        p.append(f"{split}: model.n_layer {m.n_layer} does not split into {stages} stages of equal size")
    if t.pp_microbatches and t.pp_microbatches < t.pp:
        p.append(f"train.pp_microbatches={t.pp_microbatches} is fewer than the train.pp={t.pp} stages: a stage "
                 "would idle through a whole schedule run")
    return p


def check_static(cfg: Any) -> None:
    """The first of static_problems as a ConfigError."""
    p = static_problems(cfg)
    if p:
        raise ConfigError(p[0])


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flatten(cfg: Config) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, sub in to_dict(cfg).items() for k, v in sub.items()}


def reference() -> list[tuple[str, str, Any]]:
    """(key, type, default) for every key, for --help and the docs."""
    rows = []
    for sec in fields(Config):
        sub = getattr(Config(), sec.name)
        for name, typ in _field_types(type(sub)).items():
            tname = ("|".join(typing.get_args(typ)) if typing.get_origin(typ) is Literal else
                     "|".join(a.__name__ if isinstance(a, type) else "|".join(typing.get_args(a))
                              for a in typing.get_args(typ)) if typing.get_origin(typ) in (typing.Union, types.UnionType)
                     else typ.__name__)
            rows.append((f"{sec.name}.{name}", tname, getattr(sub, name)))
    return rows
