"""Export a trained model as a directory that loads without this repository's code.

Run:
    python -m trainer.export --run-dir runs/make-train --out runs/make-train/export
    python -m trainer.export --checkpoint runs/x/checkpoints/step_000000200 --out out/ --format safetensors
    python -m trainer.export --run-dir runs/x --out out/hf --format hf-gpt2 --dtype bfloat16

Source: the newest checkpoint of ``--run-dir`` that verifies (``trainer.checkpoint.verify``: a manifest and
every file's sha256; each newer one skipped is named in a warning line), a given ``--checkpoint`` step
directory, or an exported ``--model-dir``. The weights are read on this one process with
``torch.distributed.checkpoint.load`` (no process group), which also reassembles FSDP-sharded checkpoints; the
model settings come from the config recorded in the checkpoint's manifest and the tokenizer from the checkpoint
itself (its manifest's ``tokenizer`` and, for BPE, its ``tokenizer.json``), so the training data is never read;
``--data-uri`` takes a dataset's tokenizer instead, as does a checkpoint written before checkpoints carried it.

Formats (``--format``):

- ``safetensors``: ``model.safetensors`` with this trainer's parameter names (the output embedding is tied
  to ``tok_emb.weight`` and stored once) and ``config.json``
  (``{"format": "gpu-train-gpt", "model": {...}, "tokenizer": {...}, "origin": {...}}``).
- ``hf-gpt2``: Hugging Face's GPT-2 layout (``config.json`` with ``model_type: gpt2`` and
  ``model.safetensors`` with ``transformer.*`` names; ``GPT2LMHeadModel.from_pretrained(dir)`` loads it).
  Only for the GPT-2 architecture: LayerNorm, learned positions, tied embeddings, tanh-GELU MLP. GPT-2's
  attention and MLP use ``Conv1D`` layers whose weights are stored (in, out), the transpose of
  ``nn.Linear``'s (out, in); GPT-2 has biases where this model has none, so they are written as zeros.
  (https://github.com/huggingface/transformers, models/gpt2/modeling_gpt2.py and pytorch_utils.Conv1D.)
- ``auto`` (default): ``hf-gpt2`` where the architecture allows, else ``safetensors``.

A BPE dataset's ``tokenizer.json`` is copied next to the weights (with a ``tokenizer_config.json`` in the
Hugging Face layout); a byte-level model's token ids are the UTF-8 bytes, 256 being end-of-text, and in the
Hugging Face layout that tokenizer is written out as a ``tokenizer.json`` too (``byte_tokenizer_json``), so
``AutoTokenizer`` and the serving runtimes load every export alike.

Exported weights hold attention's query, key and value as three matrices (``attn.q``, ``attn.k``, ``attn.v``),
whatever the trainer's own layout (one matrix head by head, ``attn.wqkv``, checkpoint format 4). Every older
layout is read too: checkpoint format 3 (three matrices), and checkpoints and exports written when attention had
one fused matrix of query rows, then key rows, then value rows (checkpoint format 2 and earlier,
``attn.qkv.weight``).

Over 400 lines because it is the one place that reads models from every source (checkpoint, exported directory)
and writes both layouts, each with its tokenizer: one mapping of weights and tokenizers for every export.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from gpu_train.spec.trainer_config import ModelConfig
from trainer.model import GPT, fuse_qkv, split_qkv

FORMAT = "gpu-train-gpt"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
FORMATS = ("auto", "safetensors", "hf-gpt2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(Exception):
    """A model source or setting that cannot be used; the message names it (one line, exit 2)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What decodes the model's ids: kind/name/sizes from the dataset manifest, the BPE's JSON if any."""

    kind: str = "byte"
    vocab_size: int = 257
    eot_id: int = 256
    name: str = ""
    json: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "file": TOKENIZER if self.json else None}  # fmt: skip

    def build(self) -> Any:  # -> trainer.data.tokenizer.Tokenizer
        from trainer.data.tokenizer import ByteTokenizer, tokenizer_from_json

        if self.kind == "byte":
            return ByteTokenizer()
        if self.json is None:
            raise ExportError(f"the {self.kind} tokenizer's {TOKENIZER} is missing")
        return tokenizer_from_json(self.json, self.eot_id, self.vocab_size, self.name, TOKENIZER)


@dataclass
class LoadedModel:
    model: GPT
    cfg: ModelConfig
    tokenizer: TokenizerSpec
    origin: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- pure parts
def model_config_from(data: dict[str, Any], where: str) -> ModelConfig:
    """A ModelConfig from a recorded dict; unknown or ill-typed keys are an ExportError naming them."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ExportError(f"{where}: model settings this trainer does not know: {', '.join(unknown)}")
    try:
        return ModelConfig(**data)
    except TypeError as exc:
        raise ExportError(f"{where}: bad model settings ({exc})") from exc


def gpt2_incompatibilities(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written in GPT-2's layout ([] when it can)."""
    out = []
    if cfg.norm != "layernorm":
        out.append(f"model.norm={cfg.norm} (GPT-2 uses layernorm)")
    if cfg.pos != "learned":
        out.append(f"model.pos={cfg.pos} (GPT-2 uses learned positions)")
    return out


def hf_gpt2_config(cfg: ModelConfig, eot_id: int) -> dict[str, Any]:
    """GPT2Config fields for ``cfg`` (names and meanings from transformers' configuration_gpt2.py)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.mlp_ratio * cfg.d_model,
        "activation_function": "gelu_new",  # GPT-2's tanh approximation of GELU = F.gelu(approximate="tanh")
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default, which trainer.model uses
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
    }


def to_hf_gpt2(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This model's state dict in GPT-2's names and shapes (Conv1D weights transposed, zero biases)."""
    problems = gpt2_incompatibilities(cfg)
    if problems:
        raise ExportError("not the GPT-2 architecture: " + "; ".join(problems))
    d = cfg.d_model
    state = split_model_qkv(state, cfg.n_head)

    def t(name: str) -> torch.Tensor:
        return state[name].detach().t().contiguous()

    def zeros(n: int, like: str) -> torch.Tensor:
        return torch.zeros(n, dtype=state[like].dtype)

    out = {
        "transformer.wte.weight": state["tok_emb.weight"],
        "transformer.wpe.weight": state["pos_emb.weight"],
        "transformer.ln_f.weight": state["norm_f.weight"],
        "transformer.ln_f.bias": state["norm_f.bias"],
    }
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        out.update({
            dst + "ln_1.weight": state[src + "norm1.weight"],
            dst + "ln_1.bias": state[src + "norm1.bias"],
            # GPT-2's c_attn is query, key and value side by side (Conv1D: in x 3 out).
            dst + "attn.c_attn.weight": torch.cat([t(src + f"attn.{w}.weight") for w in "qkv"], dim=1),
            dst + "attn.c_attn.bias": zeros(3 * d, src + "attn.q.weight"),
            dst + "attn.c_proj.weight": t(src + "attn.proj.weight"),
            dst + "attn.c_proj.bias": zeros(d, src + "attn.proj.weight"),
            dst + "ln_2.weight": state[src + "norm2.weight"],
            dst + "ln_2.bias": state[src + "norm2.bias"],
            dst + "mlp.c_fc.weight": t(src + "mlp.fc.weight"),
            dst + "mlp.c_fc.bias": zeros(cfg.mlp_ratio * d, src + "mlp.fc.weight"),
            dst + "mlp.c_proj.weight": t(src + "mlp.proj.weight"),
            dst + "mlp.c_proj.bias": zeros(d, src + "mlp.proj.weight"),
        })  # fmt: skip
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf_gpt2(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``to_hf_gpt2``; refuses non-zero biases, which this model cannot hold."""

    def get(name: str) -> torch.Tensor:
        for key in (name, name.removeprefix("transformer.")):
            if key in hf:
                return hf[key]
        raise ExportError(f"GPT-2 weights lack {name}")

    out = {
        "tok_emb.weight": get("transformer.wte.weight"),
        "pos_emb.weight": get("transformer.wpe.weight"),
        "norm_f.weight": get("transformer.ln_f.weight"),
        "norm_f.bias": get("transformer.ln_f.bias"),
    }
    for i in range(cfg.n_layer):
        src, dst = f"transformer.h.{i}.", f"blocks.{i}."
        for bias in ("attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"):
            if torch.count_nonzero(get(src + bias)):
                raise ExportError(f"GPT-2 weights have a non-zero {src + bias}: this model has no biases")
        out.update({
            dst + "norm1.weight": get(src + "ln_1.weight"),
            dst + "norm1.bias": get(src + "ln_1.bias"),
            **dict(zip((dst + f"attn.{w}.weight" for w in "qkv"), get(src + "attn.c_attn.weight").t().chunk(3),
                       strict=True)),
            dst + "attn.proj.weight": get(src + "attn.c_proj.weight").t(),
            dst + "norm2.weight": get(src + "ln_2.weight"),
            dst + "norm2.bias": get(src + "ln_2.bias"),
            dst + "mlp.fc.weight": get(src + "mlp.c_fc.weight").t(),
            dst + "mlp.proj.weight": get(src + "mlp.c_proj.weight").t(),
        })  # fmt: skip
    out["lm_head.weight"] = out["tok_emb.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def own_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This model's state dict for safetensors: the tied output embedding is stored once (as tok_emb), query, key
    and value as three matrices."""
    return {k: v.detach().contiguous() for k, v in split_model_qkv(state, cfg.n_head).items()
            if k != "lm_head.weight"}


# ---------------------------------------------------------------------------------------------- loading
FUSED_QKV = "attn.qkv.weight"  # checkpoint format 2 and earlier exports: query, key and value rows in one matrix


def split_fused_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights written when attention had one fused projection: each `attn.qkv.weight` (3d x d: the query's rows,
    then the key's, then the value's) becomes `attn.q.weight`, `attn.k.weight` and `attn.v.weight`."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(FUSED_QKV):
            base = key[: -len("qkv.weight")]
            out.update({f"{base}{w}.weight": part for w, part in zip("qkv", value.chunk(3), strict=True)})
        else:
            out[key] = value
    return out


MODEL_QKV = "attn.wqkv.weight"  # the model's own (checkpoint format 4): one matrix, head by head


def split_model_qkv(state: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """Each `attn.wqkv.weight` as `attn.q.weight`, `attn.k.weight` and `attn.v.weight` (trainer.model.split_qkv)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(MODEL_QKV):
            base = key[: -len("wqkv.weight")]
            out.update(zip((f"{base}{w}.weight" for w in "qkv"), split_qkv(value, n_head), strict=True))
        else:
            out[key] = value
    return out


def fuse_model_qkv(state: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """The inverse of `split_model_qkv`: each block's three matrices as its `attn.wqkv.weight`."""
    out = {k: v for k, v in state.items() if not k.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight"))}
    for key in state:
        if key.endswith("attn.q.weight"):
            base = key[: -len("q.weight")]
            out[base + "wqkv.weight"] = fuse_qkv(*(state[f"{base}{w}.weight"] for w in "qkv"), n_head)
    return out


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str) -> GPT:
    model = GPT(cfg)
    state = fuse_model_qkv(split_fused_qkv(dict(state)), cfg.n_head)
    state.setdefault("lm_head.weight", state.get("tok_emb.weight"))
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except (RuntimeError, AttributeError) as exc:
        raise ExportError(f"{where}: weights do not fit model settings {asdict(cfg)} ({exc})") from exc
    model.eval()
    return model


def newest_checkpoint(run_dir: Path, warn: Callable[[str], None] | None = None) -> Path:
    """The newest step directory under the run's checkpoint folder that verifies; `warn` gets one line for each
    newer one skipped, naming it and why."""
    from trainer.checkpoint.manifest import CheckpointInvalid, list_step_dirs, verify

    root = run_dir / "checkpoints"
    config_path = run_dir / "config.json"
    if config_path.is_file():
        try:
            local = json.loads(config_path.read_text()).get("checkpoint", {}).get("local_dir") or ""
        except (ValueError, AttributeError) as exc:
            raise ExportError(f"{config_path}: not a trainer config ({exc})") from exc
        if local:
            root = Path(local)
    skipped = []
    for step_dir in list_step_dirs(root):
        try:
            verify(step_dir)
        except CheckpointInvalid as exc:
            skipped.append((step_dir, str(exc)))
            continue
        for bad, why in skipped if warn is not None else ():
            warn(f"skipping checkpoint {bad}: {why}; using the older {step_dir.name}")
        return step_dir
    skipped = [why for _, why in skipped]
    detail = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    raise ExportError(f"{root}: no complete checkpoint{detail}")


def dataset_tokenizer(uri: str, endpoint_url: str | None = None, options: Any = None) -> TokenizerSpec:
    """The tokenizer of the dataset at ``uri`` (sha256-checked against its manifest); `options` are the store's
    (gpu_train.storage.StoreOptions)."""
    from trainer.data import open_tokenizer

    tok = open_tokenizer(uri, endpoint_url, options=options)
    return TokenizerSpec(tok.kind, tok.vocab_size, tok.eot_id, getattr(tok, "name", ""),
                         tok.to_json() if tok.kind != "byte" else None)  # fmt: skip


def checkpoint_tokenizer(step_dir: Path, info: Any) -> TokenizerSpec:
    """The tokenizer a checkpoint carries: its manifest's `tokenizer` description and, for BPE, the
    tokenizer.json beside its weights (verified with them)."""
    where = f"{step_dir}/manifest.json 'tokenizer'"
    if not isinstance(info, dict) or info.get("kind") not in ("byte", "bpe"):
        raise ExportError(f"{where}: not a tokenizer description (got {info!r})")
    try:
        spec = TokenizerSpec(kind=info["kind"], vocab_size=int(info["vocab_size"]), eot_id=int(info["eot_id"]),
                             name=str(info.get("name") or ""))
        if spec.kind == "byte":
            return spec
        text = (step_dir / str(info["file"])).read_text()
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise ExportError(f"{where}: unusable ({type(exc).__name__}: {exc})") from exc
    return TokenizerSpec(spec.kind, spec.vocab_size, spec.eot_id, spec.name, text)


def _old_checkpoint_tokenizer(step_dir: Path, uri: str, endpoint: str | None) -> TokenizerSpec:
    """For a checkpoint written before checkpoints carried their tokenizer: the dataset's, asked for once with
    short timeouts, or one line saying what to do."""
    from gpu_train.storage import StoreOptions

    try:
        return dataset_tokenizer(uri, endpoint, StoreOptions(max_attempts=2, connect_timeout=5.0, read_timeout=30.0))
    except Exception as exc:  # any storage or client failure: one line with the way out, never a traceback
        raise ExportError(
            f"{step_dir} does not carry its tokenizer (written before checkpoints did) and the dataset's could not be "
            f"read from {uri}{f' through {endpoint}' if endpoint else ''}: {type(exc).__name__}: {exc}; pass "
            "--data-uri (and --endpoint-url) naming a reachable copy of the dataset (its manifest.json and "
            "tokenizer.json are enough)") from exc


def load_checkpoint(
    step_dir: Path, *, data_uri: str | None = None, endpoint_url: str | None = None
) -> LoadedModel:
    """Model weights and tokenizer of a verified DCP checkpoint, read on this process alone. The tokenizer is the
    one the checkpoint carries; only `data_uri` (or a checkpoint written before they carried it) reads a
    dataset's."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.manifest import CheckpointInvalid, verify

    try:
        manifest = verify(step_dir)
    except CheckpointInvalid as exc:
        raise ExportError(str(exc)) from exc
    config = manifest.get("config") or {}
    cfg = model_config_from(config.get("model", {}), f"{step_dir}/manifest.json 'config.model'")
    model = GPT(cfg)
    state = {"model": model.state_dict()}
    if manifest.get("format", 0) < 4:  # written with three q/k/v matrices per block (format 3)
        state["model"] = split_model_qkv(state["model"], cfg.n_head)
    if manifest.get("format", 0) < 3:  # written with one fused q/k/v matrix of query rows, key rows, value rows
        fused = {k.replace("attn.q.weight", FUSED_QKV): torch.cat([v, v, v]) for k, v in state["model"].items()
                 if k.endswith("attn.q.weight")}
        state["model"] = {**{k: v for k, v in state["model"].items() if not k.endswith(("attn.q.weight",
                          "attn.k.weight", "attn.v.weight"))}, **fused}
    try:
        # No process group: DCP reads every shard itself, whatever the world size that wrote them.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(step_dir))
    except Exception as exc:  # DCP raises CheckpointException / RuntimeError with a long cause chain
        raise ExportError(f"{step_dir}: DCP could not load the model ({type(exc).__name__})") from exc
    model.load_state_dict(fuse_model_qkv(split_fused_qkv(state["model"]), cfg.n_head))
    model.eval()
    uri = data_uri or (config.get("data") or {}).get("uri") or "synthetic"
    endpoint = endpoint_url or (config.get("data") or {}).get("endpoint_url") or None
    origin = {"checkpoint": str(step_dir), "step": manifest["step"], "dataset_uri": uri}
    if data_uri is not None:
        tokenizer = dataset_tokenizer(uri, endpoint)
    elif "tokenizer" in manifest:
        tokenizer = checkpoint_tokenizer(step_dir, manifest["tokenizer"])
    else:
        tokenizer = _old_checkpoint_tokenizer(step_dir, uri, endpoint)
    return LoadedModel(model, cfg, tokenizer, origin)


def load_model_dir(model_dir: Path) -> LoadedModel:
    """A directory written by ``export`` (either format), or the registry's older ``model.pt`` layout."""
    from safetensors.torch import load_file

    config_path = model_dir / CONFIG
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{config_path}: unreadable model config ({exc})") from exc
    tok_json = (model_dir / TOKENIZER).read_text() if (model_dir / TOKENIZER).is_file() else None
    if config.get("model_type") == "gpt2":
        meta = config.get("gpu_train") or {}
        cfg = model_config_from(meta.get("model") or {}, f"{config_path} 'gpu_train.model'")
        tok_info = meta.get("tokenizer") or {}
        state = from_hf_gpt2(load_file(str(model_dir / WEIGHTS)), cfg)
        origin = meta.get("origin") or {}
    elif config.get("format") == FORMAT:
        cfg = model_config_from(config.get("model") or {}, f"{config_path} 'model'")
        tok_info = config.get("tokenizer") or {}
        state = load_file(str(model_dir / WEIGHTS))
        origin = config.get("origin") or {}
    elif (model_dir / "model.pt").is_file() and "model" in config:  # a trainer config next to torch.save
        cfg = model_config_from(config["model"], f"{config_path} 'model'")
        state = torch.load(model_dir / "model.pt", weights_only=True, map_location="cpu")
        uri = (config.get("data") or {}).get("uri") or "synthetic"
        return LoadedModel(
            _build(cfg, state, str(model_dir)), cfg, dataset_tokenizer(uri), {"model_dir": str(model_dir)}
        )
    else:
        raise ExportError(f"{config_path}: neither a {FORMAT} nor a Hugging Face GPT-2 config")
    spec = TokenizerSpec(
        kind=tok_info.get("kind", "byte"), vocab_size=int(tok_info.get("vocab_size", 257)),
        eot_id=int(tok_info.get("eot_id", 256)), name=tok_info.get("name", ""), json=tok_json,
    )  # fmt: skip
    return LoadedModel(_build(cfg, state, str(model_dir)), cfg, spec, {**origin, "model_dir": str(model_dir)})


def load(
    *, run_dir: Path | None = None, checkpoint: Path | None = None, model_dir: Path | None = None,
    data_uri: str | None = None, endpoint_url: str | None = None, warn: Callable[[str], None] | None = None,
) -> LoadedModel:  # fmt: skip
    """Exactly one of run_dir / checkpoint / model_dir; `warn` gets a line per newer checkpoint skipped."""
    given = [x for x in (run_dir, checkpoint, model_dir) if x is not None]
    if len(given) != 1:
        raise ExportError("give exactly one of --run-dir, --checkpoint, --model-dir")
    if model_dir is not None:
        return load_model_dir(model_dir)
    step_dir = checkpoint if checkpoint is not None else newest_checkpoint(run_dir, warn)  # type: ignore[arg-type]
    return load_checkpoint(step_dir, data_uri=data_uri, endpoint_url=endpoint_url)


# ---------------------------------------------------------------------------------------------- writing
def byte_tokenizer_json(eot_id: int) -> str:
    """The byte-level tokenizer as a ``tokenizers`` JSON: ids 0-255 are the UTF-8 bytes and ``eot_id`` is
    end-of-text. Hugging Face's byte-level pre-tokenizer maps each byte to one character of GPT-2's byte table
    (openai/gpt-2 src/encoder.py ``bytes_to_unicode``); a BPE over exactly those 256 characters with no merges
    gives every byte its own token, with the byte's value as its id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eot_id != 256:
        raise ExportError(f"a byte-level tokenizer's end-of-text id is 256 (got {eot_id})")
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok.to_str()


def _cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in tensors.items()}


def _write_tokenizer(spec: TokenizerSpec, out: Path, hf: bool, context: int) -> None:
    if spec.json is None:
        return
    (out / TOKENIZER).write_text(spec.json)
    if hf:  # what AutoTokenizer needs besides tokenizer.json
        eot = json.loads(spec.json)
        eot_text = next((t["content"] for t in eot.get("added_tokens", []) if t.get("id") == spec.eot_id),
                        "<|endoftext|>")  # fmt: skip
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
            "bos_token": eot_text, "eos_token": eot_text, "unk_token": eot_text,
        }, indent=1) + "\n")  # fmt: skip


def write_model_dir(
    state: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: TokenizerSpec, out: Path, *,
    fmt: str = "auto", dtype: str = "float32", origin: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    """Write weights + config (+ tokenizer) to ``out``; returns the format written."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if fmt == "auto":
        fmt = "safetensors" if gpt2_incompatibilities(cfg) else "hf-gpt2"
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf-gpt2" and tokenizer.kind == "byte" and tokenizer.json is None:
        tokenizer = replace(tokenizer, json=byte_tokenizer_json(tokenizer.eot_id))
    meta = {"model": asdict(cfg), "tokenizer": tokenizer.describe(), "origin": origin or {}}
    if fmt == "hf-gpt2":
        save_file(_cast(to_hf_gpt2(state, cfg), dtype), str(out / WEIGHTS), metadata={"format": "pt"})
        config = {**hf_gpt2_config(cfg, tokenizer.eot_id), "torch_dtype": dtype, "gpu_train": meta}
    else:
        save_file(_cast(own_weights(state, cfg), dtype), str(out / WEIGHTS), metadata={"format": "pt"})
        config = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": dtype,
            "tied_embeddings": True,
            **meta,
        }
    (out / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    _write_tokenizer(tokenizer, out, fmt == "hf-gpt2", cfg.context)
    # safetensors writes through a private temporary file (mode 0600) and keeps that mode; the weights get the
    # mode every other file here gets (0666 less the umask), so whoever may read config.json may read them.
    os.chmod(out / WEIGHTS, 0o666 & ~_umask())
    return fmt


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, which other threads would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


PROG = "python -m trainer.export"


def warn_line(prog: str) -> Callable[[str], None]:
    """One `PROG: warning: ...` line on stderr per message."""
    return lambda text: print(f"{prog}: warning: {' '.join(text.split())}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="a run directory: its newest verified checkpoint")
    src.add_argument("--checkpoint", type=Path, help="one checkpoint step directory")
    src.add_argument("--model-dir", type=Path, help="an exported model directory (re-export it)")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--format", choices=FORMATS, default="auto")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    ap.add_argument("--data-uri", default=None,
                    help="a dataset whose tokenizer to ship instead of the one the checkpoint carries")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for --data-uri")
    args = ap.parse_args(argv)
    from trainer.data.errors import DataError

    try:
        loaded = load(run_dir=args.run_dir, checkpoint=args.checkpoint, model_dir=args.model_dir,
                      data_uri=args.data_uri, endpoint_url=args.endpoint_url, warn=warn_line(PROG))  # fmt: skip
        fmt = write_model_dir(loaded.model.state_dict(), loaded.cfg, loaded.tokenizer, args.out,
                              fmt=args.format, dtype=args.dtype, origin=loaded.origin)  # fmt: skip
    except (ExportError, DataError) as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    n = loaded.model.num_params(non_embedding=False)
    print(f"exported {n / 1e6:.2f}M parameters ({fmt}, {args.dtype}) from "
          f"{loaded.origin.get('checkpoint') or loaded.origin.get('model_dir')} to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
