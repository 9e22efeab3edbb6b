"""The run's outputs once training stops: the final weights' hash, summary.json, loss.png, the registered model,
the end-of-run sample and the printed summary.

Usage (trainer/train.py, Trainer.finish):
    full = full_state_dict(model)                # collective: every rank calls it, rank 0 gets the weights
    summary = run_summary(status=..., params_sha256=state_sha256(full), ...)
    write_outputs(RunOutputs(cfg=cfg, run_dir=run_dir, ...), full, summary)   # rank 0 only

A failure while sampling is a warning, never a failed run: the run is already trained and saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from gpu_train.spec.trainer_config import Config
from trainer import flops
from trainer.energy import energy_line
from trainer.errors import BadInput, one_line
from trainer.evaluate import EvalState
from trainer.metrics import plot_loss
from trainer.model import GPT
from trainer.preflight import data_endpoint

log = logging.getLogger("trainer")

# The end-of-run sample decodes as `python -m trainer.sample` does by default.
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 40


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict in host memory on rank 0, {} elsewhere, for a model that is whole on
    every rank or sharded by FSDP2 (a pipeline stage holds part of the model: its runner's full_state_dict gathers
    the stages, trainer/pipeline.py).

    Collective: FSDP2 gathers its shards, so every rank must call it (rank 0 alone would wait forever).
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.get_rank() == 0 else {}


def state_sha256(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over a full state dict in sorted key order; the same value for DDP and FSDP."""
    h = hashlib.sha256()
    for key in sorted(sd):
        t = sd[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dataset_tokenizer(cfg: Config) -> Any:
    """The dataset's tokenizer (sha256-checked), for the registered model and the end-of-run sample."""
    from trainer.data.errors import DataError
    from trainer.export import dataset_tokenizer as read

    try:
        return read(cfg.data.uri, data_endpoint(cfg))
    except DataError as exc:
        raise BadInput(f"data.uri: the dataset's tokenizer: {exc}") from exc


def end_sample(cfg: Config, state: dict[str, torch.Tensor], tokenizer: Any, device: torch.device) -> str:
    """`eval.sample_tokens` tokens sampled from a full state dict (seeded by train.seed), decoded, with the
    prompt. On CUDA the copy is bf16 on the training device (the host may be far slower); on CPU fp32."""
    from trainer.sample import generate

    tok = tokenizer.build()
    with torch.device("meta"):
        model = GPT(cfg.model)
    if device.type == "cuda":
        model = model.to(dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    model.init_buffers()
    weights = dict(state)
    weights.setdefault("lm_head.weight", weights["tok_emb.weight"])
    model.load_state_dict(weights, strict=True)
    model.lm_head.weight = model.tok_emb.weight
    prompt = tok.encode(cfg.eval.sample_prompt).tolist() if cfg.eval.sample_prompt else [tok.eot_id]
    ids = generate(model, prompt, max_tokens=cfg.eval.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                   top_k=SAMPLE_TOP_K, vocab_limit=tok.vocab_size, stop_id=tok.eot_id,
                   generator=torch.Generator().manual_seed(cfg.train.seed))
    del model
    return cfg.eval.sample_prompt + tok.decode(ids)


def run_summary(*, status: str, step: int, tokens: int, loss: float, evals: EvalState, params_sha256: str | None,
                restarts: int, tokens_per_s: float, mfu: float | None, device: torch.device,
                signal: str | None = None) -> dict[str, Any]:
    """summary.json's fields (docs/trainer.md, "Run outputs"); `signal` is what stopped a preempted run."""
    return {
        "step": step, "tokens": tokens, "final_loss": loss if math.isfinite(loss) else None,
        "val_loss": evals.last, "best_val_loss": evals.best, "best_val_step": evals.best_step,
        "params_sha256": params_sha256, "restarts": restarts, "tokens_per_s": tokens_per_s, "mfu": mfu,
        "status": status, "signal": signal,
        # Rank 0's peak GPU memory (allocated by tensors), for sizing; None on CPU.
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


@dataclass(frozen=True)
class RunOutputs:
    """What the outputs are made from, besides the final weights and the summary."""

    cfg: Config
    run_dir: Path
    tokenizer: Any  # trainer.export.TokenizerSpec, or None when neither a sample nor registration was asked for
    tracker: Any  # trainer.tracking.Tracker
    checkpointer: Any  # trainer.checkpoint.CheckpointManager
    evals: EvalState
    first: tuple[int, float] | None  # (step, loss) of this launch's first step
    manifest_sha256: str
    device: torch.device


def write_outputs(out: RunOutputs, full: dict[str, torch.Tensor], summary: dict[str, Any]) -> None:
    """summary.json, loss.png, the artifacts and registered model in MLflow, the sample, the printed summary."""
    run_dir, tracker = out.run_dir, out.tracker
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    for name in ("loss.png", "summary.json", "config.json"):
        tracker.log_artifact(run_dir / name)
    finished = summary["status"] in ("completed", "stopped_early")
    registered = register(out, full, summary) if out.cfg.tracking.register_name and finished else None
    sample = None
    if out.cfg.eval.sample_tokens and finished:
        try:
            sample = end_sample(out.cfg, full, out.tokenizer, out.device)
        except Exception as exc:  # an output, never a reason to fail a finished run
            log.warning("no end-of-run sample (%s); try python -m trainer.sample --run-dir %s", one_line(str(exc)),
                        run_dir)
    print("\n".join(summary_lines(out, summary, registered, sample)), flush=True)


def register(out: RunOutputs, full: dict[str, torch.Tensor], summary: dict[str, Any]) -> str:
    """Write the final weights to RUN_DIR/model and register them; returns the model format.

    The layout loads without this repository (trainer/export.py): Hugging Face's GPT-2 layout where the
    architecture is GPT-2's, else safetensors with this trainer's names.
    """
    from trainer.export import write_model_dir

    cfg, model_dir = out.cfg, out.run_dir / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    registered = write_model_dir(full, cfg.model, out.tokenizer, model_dir, origin={
        "run_dir": str(out.run_dir), "step": summary["step"], "dataset_uri": cfg.data.uri,
        "params_sha256": summary["params_sha256"], "mlflow_run_id": out.tracker.run_id,
    })
    out.tracker.register_model(model_dir, cfg.tracking.register_name, {
        "dataset.uri": cfg.data.uri, "dataset.manifest_sha256": out.manifest_sha256,
        "params_sha256": summary["params_sha256"], "step": summary["step"], "model.format": registered,
    })
    return registered


def summary_lines(out: RunOutputs, summary: dict[str, Any], registered: str | None, sample: str | None) -> list[str]:
    """The human summary printed at the end of a run."""
    cfg, run_dir, ckpt, ev, first = out.cfg, out.run_dir, out.checkpointer, out.evals, out.first
    last = ckpt.saved[-1] if ckpt.saved else None
    lines = [
        "", "=" * 72,
        f"training {summary['status'].replace('_', ' ')}: {summary['step']}/{cfg.train.steps} steps, "
        f"{summary['tokens']:,} tokens, restarts {summary['restarts']}",
        "final loss      " + ("n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}")
        + (f"   (step {first[0]}: {first[1]:.4f})" if first else ""),
    ]
    if ev.last is not None:
        lines.append(f"validation loss {ev.last:.4f} at step {ev.last_step}   (best {ev.best:.4f} at step "
                     f"{ev.best_step})" if ev.best is not None else f"validation loss {ev.last:.4f}")
    lines += [
        f"throughput      {summary['tokens_per_s']:,.0f} tokens/s   MFU {flops.format_mfu(summary['mfu'])}",
        energy_line(summary),
        f"checkpoints     {ckpt.local_dir}" + (f"  (latest: {last.path.name})" if last else ""),
    ]
    if ckpt.remote_uri:
        lines.append(f"remote          {ckpt.remote_uri}")
    lines += [f"summary         {run_dir / 'summary.json'}", f"metrics         {run_dir / 'metrics.jsonl'}",
              f"loss curve      {run_dir / 'loss.png'}"]
    if registered:
        lines.append(f"model           {run_dir / 'model'} ({registered}, registered as {cfg.tracking.register_name})")
    if out.tracker.ui_hint():
        lines.append(f"mlflow          {out.tracker.ui_hint()}")
    if sample is not None:
        prompt = repr(cfg.eval.sample_prompt) if cfg.eval.sample_prompt else "the start of a document"
        lines += ["-" * 72, f"sample ({cfg.eval.sample_tokens} tokens from {prompt}, temperature "
                  f"{SAMPLE_TEMPERATURE}, top-k {SAMPLE_TOP_K}, seed train.seed):", sample.rstrip("\n")]
    lines.append("=" * 72)
    return lines
