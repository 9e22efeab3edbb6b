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
- query, key and value are one projection, `attn.wqkv`, whose rows go head by head (head 0's query, key and value
  rows, then head 1's, ...; `fuse_qkv` / `split_qkv` convert from and to three d x d matrices), and the head
  count is read from its output width: a tensor-parallel rank that holds a contiguous block of its rows holds
  whole heads and runs the same code, so one matmul serves every layout and the parameter has one name;
- `blocks` is a ModuleDict keyed by the block's index ("0", "1", ...): a pipeline stage that keeps some blocks
  keeps their names, so every parameter has the same name (`blocks.7.mlp.fc.weight`) in every layout;
- `forward` is `embed`, `run_blocks`, `logits`, `loss`, each usable alone by a stage that holds part of the model
  (or, with `loss_chunk_tokens` set, `embed`, `run_blocks` and `chunked_lm_loss`, which never builds the logits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

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


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_head: int) -> torch.Tensor:
    """`attn.wqkv.weight` (3d x d, head by head) from separate query, key and value matrices (d x d each)."""
    return torch.stack([w.reshape(n_head, -1, w.shape[-1]) for w in (q, k, v)], dim=1).reshape(-1, q.shape[-1])


def split_qkv(wqkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: (query, key, value) matrices of `attn.wqkv.weight`."""
    q, k, v = wqkv.reshape(n_head, 3, -1, wqkv.shape[-1]).unbind(1)
    return q.reshape(-1, wqkv.shape[-1]), k.reshape(-1, wqkv.shape[-1]), v.reshape(-1, wqkv.shape[-1])


class _ChunkedLMLoss(torch.autograd.Function):
    """Mean cross entropy of the logits `h @ w.T` against `targets`, `chunk` rows at a time: each chunk's logits
    exist only while its loss and its gradients (of h's rows and of w) are computed, in the forward pass; the
    backward pass only scales them. The same FLOPs as the unchunked output layer and loss, without its (tokens x
    vocabulary) logits in fp32 (3.3 GB for gpt2-124m at micro batch 16) or their gradient: the approach of Liger
    Kernel's fused linear cross entropy (https://arxiv.org/abs/2410.10989), in plain PyTorch."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int,
                dtype: torch.dtype) -> torch.Tensor:
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        wc = w.to(dtype)
        for i in range(0, n, chunk):
            hc, y = h[i:i + chunk].to(dtype), targets[i:i + chunk]
            logits = (hc @ wc.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            # d(loss)/d(logits) of a mean cross entropy: (softmax - one-hot) / n.
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(g.shape[0], device=g.device), y] -= 1.0
            g = g.div_(n).to(dtype)
            grad_h[i:i + chunk] = g @ wc
            grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(w.dtype))
        return loss / n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None


def chunked_lm_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of the output layer `w` over hidden states `h` (..., d), `chunk` tokens
    at a time (_ChunkedLMLoss); matmuls in the autocast dtype when autocast is on, as `nn.Linear` would run."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w.dtype
    return _ChunkedLMLoss.apply(h.flatten(0, -2), w, targets.flatten(), chunk, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)  # head by head (module docstring)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them, or this tensor-parallel rank's share (its rows of wqkv: whole heads).
        q, k, v = (z.transpose(1, 2) for z in self.wqkv(x).view(b, t, -1, 3, self.head_dim).unbind(3))
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
        self.loss_chunk_tokens = 0  # > 0: forward with targets computes the loss in chunks (chunked_lm_loss)
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
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, loss); with targets and loss_chunk_tokens > 0, (None, loss): the logits never exist whole."""
        h = self.run_blocks(self.embed(idx))
        if targets is not None and self.loss_chunk_tokens > 0:
            return None, chunked_lm_loss(self.norm_f(h), self.lm_head.weight, targets, self.loss_chunk_tokens)
        logits = self.logits(h)
        return logits, None if targets is None else self.loss(logits, targets)
