"""FLOPs per token of every preset against hand-computed numbers, MFU, the GPU peak table and the
learning-rate schedule.

Run: .venv/bin/pytest tests/trainer/test_flops_schedule.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.common import preset_flops_per_token
from gpu_train.spec.trainer_config import PRESETS
from trainer.flops import flops_per_token, format_mfu, gpu_peak_flops, mfu
from trainer.model import GPT
from trainer.parallelize import lr_at


def _by_hand(n_layer: int, d: int, n_head: int, context: int, vocab: int, norm_params_per_layer: int) -> int:
    """Training FLOPs per token of our GPT, counted from its layer shapes (PaLM appendix B accounting).

    Per block: attention qkv (d x 3d) and output (d x d), MLP (d x 4d) and (4d x d), no biases: 12 d^2
    matmul weights, plus the two norms' own parameters. After the blocks: the final norm, then the output
    projection d x vocab, whose weight is the token embedding (tied) but which is a matmul all the same.
    6 FLOPs per matmul weight per token (forward 2, backward 4), plus 12 * L * H * Q * T for attention.
    """
    blocks = n_layer * (12 * d * d + norm_params_per_layer)
    final_norm = norm_params_per_layer // 2
    lm_head = d * vocab
    head_dim = d // n_head
    return 6 * (blocks + final_norm + lm_head) + 12 * n_layer * n_head * head_dim * context


# preset: (L, d, H, T, vocab, parameters of the two norms of a block: LayerNorm 2 x (weight + bias) = 4d,
# RMSNorm 2 x weight = 2d), and the same number worked out to the end.
PRESET_FLOPS = {
    "tiny": ((2, 64, 4, 64, 264, 4 * 64), 793_344),
    "gpt2-124m": ((12, 768, 12, 1024, 50304, 4 * 768), 854_885_376),
    "gpt2-350m": ((24, 1024, 16, 1024, 50304, 4 * 1024), 2_423_599_104),
    "1b": ((20, 2048, 16, 2048, 50304, 2 * 2048), 7_665_070_080),
    "7b": ((32, 4096, 32, 4096, 50304, 2 * 4096), 46_335_025_152),
}


@pytest.mark.parametrize("preset", list(PRESET_FLOPS))
def test_flops_per_token_counts_the_tied_output_projection(preset):
    shape, worked_out = PRESET_FLOPS[preset]
    assert _by_hand(*shape) == worked_out
    m = PRESETS[preset]().model
    assert (m.n_layer, m.d_model, m.n_head, m.context, m.vocab_size) == shape[:5]
    with torch.device("meta"):  # the real model's parameter count, no memory
        n = GPT(m).num_params(non_embedding=True)
    got = flops_per_token(n, m.n_layer, m.n_head, m.d_model // m.n_head, m.context,
                          lm_head_params=m.vocab_size * m.d_model)
    assert got == worked_out
    assert preset_flops_per_token(preset) == worked_out  # what the benchmarks use


def test_leaving_out_the_lm_head_under_reports_gpt2_124m_by_27_percent():
    without = 6 * 84_973_056 + 12 * 12 * 12 * 64 * 1024  # non-embedding parameters only
    assert without / PRESET_FLOPS["gpt2-124m"][1] == pytest.approx(0.7288, abs=1e-4)


def test_mfu_uses_world_size_and_peak():
    # gpt2-124m at 400k tokens/s on one H100 SXM: 400e3 x 854,885,376 / 989.4e12.
    peak = gpu_peak_flops("NVIDIA H100 80GB HBM3")
    assert peak == 989.4e12
    one = mfu(400e3, PRESET_FLOPS["gpt2-124m"][1], peak, 1)
    assert one == pytest.approx(0.345617, rel=1e-5)
    assert mfu(400e3, PRESET_FLOPS["gpt2-124m"][1], peak, 4) == pytest.approx(0.345617 / 4, rel=1e-5)


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989.4e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12), ("NVIDIA A10G", 125e12), ("NVIDIA B200", 2250e12),
])
def test_gpu_peak_table(name, peak):
    assert gpu_peak_flops(name) == peak


def test_mfu_is_na_on_cpu_and_unknown_devices():
    assert gpu_peak_flops(None) is None
    assert gpu_peak_flops("Some Future Accelerator") is None
    assert mfu(1e6, 1e9, None, 2) is None
    assert format_mfu(None) == "n/a"
    assert format_mfu(math.nan) == "n/a"
    assert format_mfu(0.4123) == "41.2%"


def test_lr_warmup_then_cosine_to_min():
    kw = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "total_steps": 14}
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.55)  # halfway through the decay: (1 + 0.1) / 2
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(100, **kw) == 0.1
    decay = [lr_at(s, **kw) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
