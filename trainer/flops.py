"""MFU: model FLOPs utilisation from the throughput, FLOPs per token and the GPU's peak (gpu_train/sizing/flops.py).

Usage:
    from trainer.flops import flops_per_token, gpu_peak_flops, mfu
    f = flops_per_token(non_embedding_params, n_layer, n_head, head_dim, context, lm_head_params=vocab * d_model)
    peak = gpu_peak_flops("NVIDIA H100 80GB HBM3")        # 989.4e12, or None when unknown / CPU
    mfu(tokens_per_s, f, peak, world_size)               # ratio in [0, 1], or None

The FLOPs per token and the GPUs' peaks are defined in gpu_train/sizing/flops.py (PaLM's accounting), which the
carbon estimate shares. MFU ignores activation recomputation.
"""

from __future__ import annotations

import math

from gpu_train.sizing.flops import (  # noqa: F401 (the trainer's callers import them from here)
    GPU_PEAK_BF16,
    flops_per_token,
    gpu_peak_flops,
    model_flops_per_token,
)


def mfu(tokens_per_s: float, flops_token: float, peak_per_gpu: float | None, world_size: int) -> float | None:
    """Model FLOPs utilisation in [0, 1] over all GPUs of the job; None when the peak is unknown."""
    if peak_per_gpu is None or peak_per_gpu <= 0 or world_size <= 0 or not math.isfinite(tokens_per_s):
        return None
    return tokens_per_s * flops_token / (peak_per_gpu * world_size)


def format_mfu(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.1f}%"
