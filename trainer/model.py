"""GPT-style decoder-only transformer. Knows nothing of distribution, storage or metrics.

Usage:
    from gpu_train.spec.trainer_config import ModelConfig
    from trainer.model import GPT
    model = GPT(ModelConfig(n_layer=2, n_head=4, d_model=64, context=64, vocab_size=264))
    logits, loss = model(x, targets=y)      # x, y: (B, T) int64

Pre-norm blocks (norm -> attention -> residual, norm -> MLP -> residual), causal attention through
F.scaled_dot_product_attention (which picks flash/memory-efficient kernels on GPU), input and output embeddings
tied, LayerNorm or RMSNorm, learned absolute positions or rotary embeddings (RoPE, https://arxiv.org/abs/2104.09864).

What lets other code split the model without knowing its insides (trainer/parallelize.py, trainer/pipeline.py):
- query, key and value are three projections (`attn.q`, `attn.k`, `attn.v`) and the head count is read from the
  projection's output width, so a tensor-parallel rank that holds some heads' columns runs the same code;
- `blocks` is a ModuleDict keyed by the block's index ("0", "1", ...): a pipeline stage that keeps some blocks
  keeps their names, so every parameter has the same name (`blocks.7.mlp.fc.weight`) in every layout;
- `forward` is `embed`, `run_blocks`, `logits`, `loss`, each usable alone by a stage that holds part of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpu_train.spec.trainer_config import ModelConfig


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    return nn.LayerNorm(dim)


def rope_tables(context: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (context, head_dim/2) for rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of a (B, H, T, h) tensor by position-dependent angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them, or this tensor-parallel rank's share (its columns of q, k and v).
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q(x), self.k(x), self.v(x)))
        if rope is not None:
            cos, sin = rope[0][:t], rope[1][:t]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg.norm, cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg.norm, cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm_f = make_norm(cfg.norm, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied input/output embeddings
        if cfg.pos == "rope":
            # Not persistent: derived from the config, so never part of a checkpoint.
            self.register_buffer("rope_cos", torch.empty(cfg.context, cfg.d_model // cfg.n_head // 2),
                                 persistent=False)
            self.register_buffer("rope_sin", torch.empty_like(self.rope_cos), persistent=False)
        self.activation_checkpointing = False
        self.init_buffers()
        self.reset_parameters()

    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute derived buffers, e.g. after `to_empty()` materialised a meta-device model; `device`: where
        to create those still on the meta device (when only parts of the model were materialised)."""
        if device is not None:
            for name, buf in list(self.named_buffers(recurse=False)):
                if buf.device.type == "meta":
                    self.register_buffer(name, torch.empty_like(buf, device=device), persistent=False)
        if self.cfg.pos == "rope":
            cos, sin = rope_tables(self.cfg.context, self.cfg.d_model // self.cfg.n_head)
            if self.rope_cos.device.type != "meta":
                self.rope_cos.copy_(cos)
                self.rope_sin.copy_(sin)

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights/biases keep their defaults
            std = 0.02
            if name.endswith("proj.weight"):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (tied weights once); non_embedding drops token and position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.rope_cos, self.rope_sin) if self.cfg.pos == "rope" else None

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token (and learned position) embeddings of (B, T) token ids."""
        _, t = idx.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds model.context {self.cfg.context}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        return self.drop(x)

    def run_blocks(self, x: torch.Tensor, blocks: Iterable[nn.Module] | None = None) -> torch.Tensor:
        """The residual stream through `blocks` (default: all of this model's, in order)."""
        rope = self.rope()
        for block in self.blocks.values() if blocks is None else blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy in fp32."""
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.logits(self.run_blocks(self.embed(idx)))
        return logits, None if targets is None else self.loss(logits, targets)
