"""On a CUDA machine (`python -m bench --gpu`): tokens/s, MFU and peak memory of gpt2-124m and
gpt2-350m in bf16 with torch.compile, under DDP and under FSDP2, against the same model in the bare
loop (bench/bare.py), all on this machine's GPUs in one run; then gpt2-350m under FSDP2 with tensor
parallelism (train.tp=2) and under pipeline parallelism (train.pp=2, 1F1B), against its FSDP2 row.

Usage: `python -m bench --only gpu --gpu` on a machine with at least one NVIDIA GPU. The tensor and
pipeline rows need two GPUs or more (one GPU per rank: NCCL refuses two ranks on one device); on a
machine with fewer, and without CUDA, each row says what it needs instead of a figure. MFU counts the same
FLOPs per token in every row (bench.common.preset_flops_per_token): a layout changes where they run, not
how many there are. TP and PP rows run without torch.compile (the trainer refuses compile with either).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import Figure, preset_flops_per_token, ratio
from bench.runs import ROOT, run_trainer, seconds_per_step, summary
from trainer.flops import gpu_peak_flops, mfu

FROM_STEP = 10


# (row, overrides): model parallel layouts of gpt2-350m (24 layers, 16 heads) on this machine's GPUs.
LAYOUTS = (
    ("FSDP2+TP", ["train.parallel=fsdp", "train.tp=2"]),
    ("PP", ["train.pp=2", "train.pp_schedule=1f1b", "train.activation_checkpointing=false"]),
)


def run(quick: bool = False) -> list[Figure]:
    if not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False here"
        return [*(Figure("gpu", f"{preset} {parallel} bf16+compile vs bare loop", None, "tokens/s/GPU",
                         notes=f"needs a CUDA device ({why})")
                  for preset in ("gpt2-124m", "gpt2-350m") for parallel in ("DDP", "FSDP")),
                *(Figure("gpu", f"gpt2-350m {row} bf16 vs FSDP2", None, "tokens/s/GPU",
                         notes=f"needs a CUDA device with 2 GPUs or more ({why})") for row, _ in LAYOUTS)]
    figures = _data_parallel(quick)
    return figures + _model_parallel(quick, fsdp=next(f for f in figures if f.name.startswith("gpt2-350m FSDP")))


def _model_parallel(quick: bool, fsdp: Figure) -> list[Figure]:
    """gpt2-350m under each of LAYOUTS, side by side with its FSDP2 row of this run."""
    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    if gpus < 2:
        return [Figure("gpu", f"gpt2-350m {row} bf16", None, "tokens/s/GPU",
                       notes=f"needs 2 GPUs or more, one per rank ({gpus}x {name} here)") for row, _ in LAYOUTS]
    peak, fpt, micro = gpu_peak_flops(name), preset_flops_per_token("gpt2-350m"), 8
    steps = 30 if quick else 60
    figures = []
    for row, layout in LAYOUTS:
        # The same global batch as the FSDP2 row; a pipeline runs it as micro batches of 8 per data-parallel rank.
        common = [f"train.steps={steps}", f"train.micro_batch_size={micro}", "train.precision=bf16",
                  f"train.global_batch_tokens={micro * 1024 * gpus}", "checkpoint.every_steps=0",
                  "metrics.log_every=10", "train.deterministic=false", *layout]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            events = run_trainer(run_dir, "gpt2-350m", common, nproc=gpus)
            tps_per_gpu = micro * 1024 * gpus / seconds_per_step(events, FROM_STEP) / gpus
            mem = summary(run_dir).get("peak_memory_gb")
        m = mfu(tps_per_gpu, fpt, peak, 1)
        figures.append(Figure("gpu", f"gpt2-350m {row} bf16 vs FSDP2", tps_per_gpu, "tokens/s/GPU", fsdp.value,
                              "FSDP2 bf16+compile, same GPUs", ratio(tps_per_gpu, fsdp.value),
                              notes=f"MFU {100 * m:.1f}%, peak mem {mem:.1f} GB, {gpus}x {name}"
                              if m is not None and mem is not None else f"{gpus}x {name}",
                              extra={"mfu": m, "peak_memory_gb": mem, "layout": layout}))
    return figures


def _data_parallel(quick: bool) -> list[Figure]:
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    peak = gpu_peak_flops(name)
    steps = 30 if quick else 60
    figures = []
    for preset, micro in (("gpt2-124m", 16), ("gpt2-350m", 8)):
        # One optimizer step = one micro batch per GPU, so bare (1 GPU) and ours compare per GPU.
        common = [f"train.steps={steps}", f"train.micro_batch_size={micro}", "train.precision=bf16",
                  "train.compile=true", f"train.global_batch_tokens={micro * 1024 * gpus}",
                  "checkpoint.every_steps=0", "metrics.log_every=10", "train.deterministic=false"]
        fpt = preset_flops_per_token(preset)
        out = subprocess.run([sys.executable, "-m", "bench.bare", "--preset", preset, "--steps", str(steps),
                              "--from-step", str(FROM_STEP), *common,
                              f"train.global_batch_tokens={micro * 1024}"],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        bare_tps = micro * 1024 / json.loads(out.stdout.strip().splitlines()[-1])["seconds_per_step"]
        for parallel in ("ddp", "fsdp"):
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(tmp) / "run"
                events = run_trainer(run_dir, preset, [*common, f"train.parallel={parallel}"], nproc=gpus)
                tps_per_gpu = micro * 1024 * gpus / seconds_per_step(events, FROM_STEP) / gpus
                mem = summary(run_dir).get("peak_memory_gb")
            m = mfu(tps_per_gpu, fpt, peak, 1)
            figures.append(Figure("gpu", f"{preset} {parallel.upper()} bf16+compile vs bare loop", tps_per_gpu,
                                  "tokens/s/GPU", bare_tps, "bare loop, 1 GPU", ratio(tps_per_gpu, bare_tps),
                                  ">= 45% MFU" if preset == "gpt2-124m" else "",
                                  (m is not None and m >= 0.45) if preset == "gpt2-124m" else None,
                                  notes=f"MFU {100 * m:.1f}%, peak mem {mem:.1f} GB, {gpus}x {name}"
                                  if m is not None and mem is not None else f"{gpus}x {name}",
                                  extra={"mfu": m, "peak_memory_gb": mem, "bare_mfu": mfu(bare_tps, fpt, peak, 1)}))
    return figures
