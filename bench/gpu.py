"""On a CUDA machine (`python -m bench --gpu`): tokens/s, MFU and peak memory of gpt2-124m and
gpt2-350m in bf16 with torch.compile, under DDP and under FSDP2, against the same model in the bare
loop (bench/bare.py) at the same micro batch, all on this machine's GPUs in one run, gpt2-124m also under
DDP at four times its preset's micro batch and at train.micro_batch_size=auto; then gpt2-350m under FSDP2 with tensor parallelism (train.tp=2) and under pipeline parallelism
(train.pp=2, 1F1B), against its FSDP2 row. Each row prints one line as it is measured; a run that fails
becomes a row naming the worker's error line, and the section goes on with the next. Each trainer run's
output is kept in build/bench/gpu-logs/.

Usage: `python -m bench --only gpu --gpu` (or `python -m bench.gpu`, the same rows as one script) on a machine with
at least one NVIDIA GPU. The tensor and
pipeline rows need two GPUs or more (one GPU per rank: NCCL refuses two ranks on one device); on a
machine with fewer, and without CUDA, each row says what it needs instead of a figure. MFU counts the same
FLOPs per token in every row (bench.common.preset_flops_per_token): a layout changes where they run, not
how many there are. TP and PP rows run without torch.compile (the trainer refuses compile with either).
Every data-parallel row sets its peak memory beside the plan-time estimate (gpu_train/sizing/memory.py).

The CPU-sized form (`python -m bench.gpu --cpu-sized`, or this section on a machine without CUDA): the same rows'
code on the tiny preset in fp32 without compile, 20 steps, micro batch 8, 32 and auto under DDP beside the bare
loop at the same batch, so the script is known to run before a GPU is lent; MFU and peak memory are n/a there.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.common import Figure, preset_flops_per_token, ratio, run_json
from bench.runs import ROOT, run_trainer, seconds_per_step, summary
from gpu_train.sizing.layout import resolve_layout
from gpu_train.sizing.memory import fitting_micro_batch, memory_per_gpu, sized
from gpu_train.spec import trainer_config as tcfg
from trainer.flops import gpu_peak_flops, mfu
from trainer.parallelize import worker_memory_bytes

FROM_STEP = 10


# (preset, micro batch, train.parallel values): gpt2-124m at the preset's micro batch and at four times it (larger
# matrix products per launch, a quarter of the per-step fixed costs per token, the same FLOPs per token).
# "auto": the micro batch the trainer picks by train.micro_batch_size=auto from the GPU's memory, up to AUTO_SEQUENCES
# per GPU, and the bare loop runs at that one.
DATA_PARALLEL = (("gpt2-124m", 16, ("DDP", "FSDP")), ("gpt2-124m", 64, ("DDP",)), ("gpt2-124m", "auto", ("DDP",)),
                 ("gpt2-350m", 8, ("DDP", "FSDP")))
AUTO_SEQUENCES = {True: 512, False: 64}  # by CUDA or not

# (row, overrides): model parallel layouts of gpt2-350m (24 layers, 16 heads) on this machine's GPUs.
LAYOUTS = (
    ("FSDP2+TP", ["train.parallel=fsdp", "train.tp=2"]),
    ("PP", ["train.pp=2", "train.pp_schedule=1f1b", "train.activation_checkpointing=false"]),
)


# The CPU-sized form (module docstring).
CPU_SIZED = (("tiny", 8, ("DDP",)), ("tiny", 32, ("DDP",)), ("tiny", "auto", ("DDP",)))


def run(quick: bool = False, cpu_sized: bool = False) -> list[Figure]:
    if cpu_sized or not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False here" if not torch.cuda.is_available() else "--cpu-sized"
        # The CPU-sized rows only when asked for: without CUDA, `make bench` lists the GPU rows and what they need.
        cpu = _data_parallel(True, rows=CPU_SIZED, cuda=False) if cpu_sized else []
        return [*cpu,
                *(Figure("gpu", f"{preset} {parallel} bf16+compile, micro batch {micro} vs bare loop", None,
                         "tokens/s/GPU", notes=f"needs a CUDA device ({why})")
                  for preset, micro, parallels in DATA_PARALLEL for parallel in parallels),
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
    # The same global batch as the FSDP2 row; a pipeline runs it as micro batches of 8 per data-parallel rank.
    common = [*_common(30 if quick else 60, micro, gpus, "gpt2-350m", True), "train.compile=false"]
    return [_trainer_row(f"gpt2-350m {row} bf16 vs FSDP2", "gpt2-350m", [*common, *layout], micro * 1024, gpus, peak,
                         fpt, fsdp.value, "FSDP2 bf16+compile, same GPUs", "") for row, layout in LAYOUTS]


def _data_parallel(quick: bool, rows: tuple = DATA_PARALLEL, cuda: bool = True) -> list[Figure]:
    gpus = torch.cuda.device_count() if cuda else 1
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peak = gpu_peak_flops(name) if cuda else None
    steps = 20 if not cuda else 30 if quick else 60
    kind = "bf16+compile" if cuda else "fp32"
    figures = []
    for preset, asked, parallels in rows:
        micro = _auto_micro(preset, gpus, cuda) if asked == "auto" else asked
        # One optimizer step = one micro batch per GPU, so bare (1 GPU) and ours compare per GPU.
        common = _common(steps, micro, gpus, preset, cuda)
        # With auto the trainer chooses again, from the same estimate and memory: the same micro batch.
        ours = [o if asked != "auto" or not o.startswith("train.micro_batch_size=") else "train.micro_batch_size=auto"
                for o in common]
        fpt = preset_flops_per_token(preset)
        context = tcfg.build_config(preset).model.context
        try:
            bare_tps = _bare(preset, steps, micro * context,
                             [*common, f"train.global_batch_tokens={micro * context}"])
        except subprocess.CalledProcessError as exc:
            bare_tps = None
            print(f"gpu: {preset} bare loop failed: {_last_line(exc.stderr)}", flush=True)
        for parallel in parallels:
            row = f"{preset} {parallel} {kind}, micro batch {'auto: ' if asked == 'auto' else ''}{micro} vs bare loop"
            target = ">= 45% MFU" if preset == "gpt2-124m" else ""
            overrides = [*ours, f"train.parallel={parallel.lower()}"]
            figures.append(_trainer_row(row, preset, overrides, micro * context, gpus, peak, fpt, bare_tps,
                                        f"bare loop, 1 {'GPU' if cuda else 'process'}, micro batch {micro}", target,
                                        estimate_gb=_estimate_gb(preset, overrides, gpus), device=name))
    return figures


def _common(steps: int, micro: int, gpus: int, preset: str, cuda: bool) -> list[str]:
    context = tcfg.build_config(preset).model.context
    return [f"train.steps={steps}", f"train.micro_batch_size={micro}",
            f"train.precision={'bf16' if cuda else 'fp32'}", f"train.compile={'true' if cuda else 'false'}",
            f"train.global_batch_tokens={micro * context * gpus}", "checkpoint.every_steps=0",
            "metrics.log_every=10", "train.deterministic=false"]


def _auto_micro(preset: str, gpus: int, cuda: bool) -> int:
    """The micro batch train.micro_batch_size=auto picks at AUTO_SEQUENCES per GPU: by GPU 0's memory, or on the
    CPU by this host's (trainer/parallelize.py worker_memory_bytes)."""
    context = tcfg.build_config(preset).model.context
    cfg = tcfg.build_config(preset, None, ["train.micro_batch_size=auto", "train.precision=bf16" if cuda else
                                           "train.precision=fp32",
                                           f"train.global_batch_tokens={AUTO_SEQUENCES[cuda] * context * gpus}"])
    capacity, _ = worker_memory_bytes(torch.device("cuda", 0) if cuda else torch.device("cpu"), 1)
    micro = fitting_micro_batch(cfg, gpus, capacity)
    print(f"gpu: {preset} train.micro_batch_size=auto: {micro} of {AUTO_SEQUENCES[cuda]} sequences per GPU", flush=True)
    return micro


def _estimate_gb(preset: str, overrides: list[str], gpus: int) -> float:
    """The plan-time memory estimate of one GPU for this run (gpu_train/sizing/memory.py), in GB."""
    cfg = tcfg.build_config(preset, None, overrides)
    return memory_per_gpu(sized(cfg, gpus, math.inf), resolve_layout(cfg.train, gpus)).total / 1e9


def _bare(preset: str, steps: int, tokens_per_step: int, overrides: list[str]) -> float:
    """Tokens/s of the bare loop (bench/bare.py) on one device, one micro batch per step."""
    # The trainer's workers run with OMP_NUM_THREADS=1 unless it is set (bench/runs.py); so does the bare loop.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    tps = tokens_per_step / run_json("bench.bare", ["--preset", preset, "--steps", str(steps), "--from-step",
                                                    str(FROM_STEP), *overrides], env=env)["seconds_per_step"]
    print(f"gpu: {preset} bare loop: {tps:,.0f} tokens/s", flush=True)
    return tps


def _trainer_row(row: str, preset: str, overrides: list[str], tokens: int, gpus: int, peak: float | None, fpt: float,
                 reference: float | None, reference_name: str, target: str, *, estimate_gb: float | None = None,
                 device: str | None = None) -> Figure:
    """One trainer run under torchrun on this machine's GPUs (or one CPU process), as a figure; a failed run is a
    row saying why. `tokens`: tokens per micro batch, one micro batch per step per rank."""
    name = device or torch.cuda.get_device_name(0)
    logs = ROOT / "build" / "bench" / "gpu-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        try:
            events = run_trainer(run_dir, preset, overrides, nproc=gpus,
                                 log=logs / (row.split(" vs ")[0].replace(" ", "_").replace("+", "-") + ".log"))
        except RuntimeError as exc:
            print(f"gpu: {row}: failed: {_last_line(str(exc))}", flush=True)
            return Figure("gpu", row, None, "tokens/s/GPU", reference, reference_name, target=target,
                          notes=f"failed: {_last_line(str(exc))}")
        tps_per_gpu = tokens * gpus / seconds_per_step(events, FROM_STEP) / gpus
        mem = summary(run_dir).get("peak_memory_gb")
    m = mfu(tps_per_gpu, fpt, peak, 1)
    est = f", estimate {estimate_gb:.3g} GB" if estimate_gb is not None else ""
    print(f"gpu: {row}: {tps_per_gpu:,.0f} tokens/s/GPU, MFU {m if m is None else round(100 * m, 1)}%, "
          f"peak memory {mem} GB{est}", flush=True)
    return Figure("gpu", row, tps_per_gpu, "tokens/s/GPU", reference, reference_name, ratio(tps_per_gpu, reference),
                  target, (m is not None and m >= 0.45) if target else None,
                  notes=f"MFU {100 * m:.1f}%, peak mem {mem:.1f} GB{est}, {gpus}x {name}"
                  if m is not None and mem is not None else f"{gpus}x {name}{est}",
                  extra={"mfu": m, "peak_memory_gb": mem, "estimate_gb": estimate_gb,
                         "reference_mfu": mfu(reference, fpt, peak, 1) if reference else None})


def _last_line(text: str) -> str:
    """The worker's own error line when there is one (torchrun's summary follows it), else the last line."""
    lines = [line.strip() for line in (text or "").splitlines() if any(c.isalnum() for c in line)]
    errors = [line for line in lines if "error" in line.lower() and "errors/__init__" not in line
              and "ChildFailedError" not in line and "pytorch.org" not in line and "error_file" not in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.__main__ import print_table

    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-sized", action="store_true", help="the tiny preset on the CPU (module docstring)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    figures = run(quick=args.quick, cpu_sized=args.cpu_sized)
    print_table(figures)
    return 0 if all(f.value is not None for f in figures if "needs a CUDA" not in f.notes) else 1


if __name__ == "__main__":
    raise SystemExit(main())

