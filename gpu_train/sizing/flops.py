"""Model FLOPs per token and GPU peak throughput: what MFU and the carbon estimate's run time are computed from.

Usage:
    from gpu_train.sizing.flops import flops_per_token, gpu_peak_flops, shape_flops_per_token
    f = flops_per_token(non_embedding_params, n_layer, n_head, head_dim, context, lm_head_params=vocab * d_model)
    peak = gpu_peak_flops("NVIDIA H100 80GB HBM3")        # 989.4e12; also a catalog GPU type such as "H100"
    shape_flops_per_token(model_config)                  # the same count from a model config's shape alone

FLOPs per token follow the PaLM paper's accounting (https://arxiv.org/abs/2204.02311, appendix B):
6N for the forward and backward matmuls over the N parameters that take part in a matmul, plus
12 * L * H * Q * T for attention scores and values (L layers, H heads, head size Q, context T). N is the
non-embedding parameters plus the output projection (lm_head, vocab x d_model): its weight is the token
embedding's (tied), so it is not in the non-embedding count, but its matmul is real compute, and for
gpt2-124m leaving it out under-reports by 27%. The token and position embeddings are lookups, not matmuls.
The trainer (trainer/flops.py) counts N on the built model; the carbon estimate, which has no model, counts the
matmul weights of the shape (trainer/model.py: qkv 3d^2 and proj d^2 per attention, fc and proj 2 x mlp_ratio x d^2
per MLP, no biases), leaving out the norms' few parameters.
"""

from __future__ import annotations

from typing import Any

# Dense (no sparsity) BF16 tensor-core peaks in FLOP/s, per GPU, from the vendors' datasheets:
#  H100 SXM / PCIe, H200: https://www.nvidia.com/en-us/data-center/h100/ , /h200/  (989.4 / 756 / 989.4 TFLOPS;
#    the datasheets print 2x these "with sparsity")
#  A100: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (312)
#  B200: https://www.nvidia.com/en-us/data-center/dgx-b200/ (72 PFLOPS FP8 sparse per 8 GPUs -> 2.25 PF BF16 dense)
#  L4: https://www.nvidia.com/en-us/data-center/l4/ (242 sparse -> 121)
#  L40S: https://www.nvidia.com/en-us/data-center/l40s/ (733 sparse -> 362)
#  A10G (AWS g5): https://d1.awsstatic.com/product-marketing/ec2/NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf (125)
#  V100 has no BF16 tensor cores; its FP16 figure (125) is listed because autocast falls back to it there.
# Keys are matched as substrings of torch.cuda.get_device_name(), most specific first.
GPU_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM (HBM3) parts report e.g. "NVIDIA H100 80GB HBM3"
    ("H800", 989.4e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("V100", 125e12),
)


def gpu_peak_flops(device_name: str | None) -> float | None:
    """Dense BF16 peak FLOP/s for a CUDA device name, None for CPUs and unknown devices."""
    if not device_name:
        return None
    for key, peak in GPU_PEAK_BF16:
        if key.lower() in device_name.lower():
            return peak
    return None


def flops_per_token(non_embedding_params: int, n_layer: int, n_head: int, head_dim: int, context: int, *,
                    lm_head_params: int) -> int:
    """Training FLOPs per token: 6 * (non-embedding + lm_head parameters) + 12 * L * H * Q * T."""
    return 6 * (non_embedding_params + lm_head_params) + 12 * n_layer * n_head * head_dim * context


def model_flops_per_token(model: Any, non_embedding_params: int) -> int:
    """`flops_per_token` of a gpu_train.spec.trainer_config.ModelConfig (n_layer, n_head, d_model, context, vocab_size)."""
    return flops_per_token(non_embedding_params, model.n_layer, model.n_head, model.d_model // model.n_head,
                           model.context, lm_head_params=model.vocab_size * model.d_model)


def shape_flops_per_token(model: Any) -> int:
    """`flops_per_token` of a gpu_train.spec.trainer_config.ModelConfig from its shape alone (module docstring)."""
    d = model.d_model
    matmul = model.n_layer * (4 * d * d + 2 * model.mlp_ratio * d * d)
    return flops_per_token(matmul, model.n_layer, model.n_head, d // model.n_head, model.context,
                           lm_head_params=model.vocab_size * d)
