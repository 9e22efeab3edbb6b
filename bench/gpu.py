"""On a CUDA machine (`python -m bench --gpu`): tokens/s, MFU and peak memory of gpt2-124m and
gpt2-350m in bf16 with torch.compile, under DDP and under FSDP2, against the same model in the bare
loop (bench/bare.py), all on this machine's GPUs in one run.

Usage: `python -m bench --only gpu --gpu` on a machine with at least one NVIDIA GPU.
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


def run(quick: bool = False) -> list[Figure]:
    if not torch.cuda.is_available():
        raise RuntimeError("the gpu section needs a CUDA device (torch.cuda.is_available() is False)")
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
                                  ">= 40% MFU" if preset == "gpt2-124m" else "",
                                  (m is not None and m >= 0.40) if preset == "gpt2-124m" else None,
                                  notes=f"MFU {100 * m:.1f}%, peak mem {mem:.1f} GB, {gpus}x {name}"
                                  if m is not None and mem is not None else f"{gpus}x {name}",
                                  extra={"mfu": m, "peak_memory_gb": mem, "bare_mfu": mfu(bare_tps, fpt, peak, 1)}))
    return figures
