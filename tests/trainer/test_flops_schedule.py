"""MFU formula, GPU peak table and the learning-rate schedule.

Run: .venv/bin/pytest tests/trainer/test_flops_schedule.py -q
"""

from __future__ import annotations

import math

import pytest

from trainer.flops import flops_per_token, format_mfu, gpu_peak_flops, mfu
from trainer.train import lr_at


def test_flops_per_token_palm_formula():
    # GPT-2 124M: N = 85M non-embedding, L=12, H=12, Q=64, T=1024.
    n = 85_000_000
    assert flops_per_token(n, 12, 12, 64, 1024) == 6 * n + 12 * 12 * 12 * 64 * 1024


def test_mfu_uses_world_size_and_peak():
    f = flops_per_token(1_000_000, 2, 4, 16, 128)
    peak = gpu_peak_flops("NVIDIA H100 80GB HBM3")
    assert peak == 989.4e12
    one = mfu(2.0e6, f, peak, 1)
    assert one == pytest.approx(2.0e6 * f / 989.4e12)
    assert mfu(2.0e6, f, peak, 4) == pytest.approx(one / 4)


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
