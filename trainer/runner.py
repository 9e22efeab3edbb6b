"""How a step runs under a layout without a pipeline (DDP, FSDP2, tensor parallelism), and the pieces that place
a model on the (pp, dp_replicate, dp_shard, tp) DeviceMesh, which trainer/pipeline.py applies to each stage.

Usage (trainer/parallelize.py's build_model puts them together):
    mesh = build_mesh(layout, env)                       # init_device_mesh, tp innermost
    tensor_parallel(model, mesh["tp"])                   # Megatron-LM's split with sequence parallelism
    fully_shard_model([model], blocks, dp_mesh(mesh, layout), dtype)    # FSDP2 per block, then the root
    runner = StepRunner(layout, env, model, model, mesh=mesh)
    loss = runner.forward_backward(windows, micro_batches)
    norm = runner.clip_grad_norm_(cfg.train.grad_clip)   # the global gradient norm (a device tensor)

Tensor parallelism (Megatron-LM's split, https://arxiv.org/abs/1909.08053, with sequence parallelism,
https://arxiv.org/abs/2205.05198) through torch.distributed.tensor.parallel: the fused query/key/value matrix (its
rows head by head, trainer/model.py, so each rank gets whole heads) and the MLP's first matrix are split by columns,
each block's output projections by rows; norms and the residual stream are split along the sequence; the token embedding and the tied output layer are split along the vocabulary, and the loss is computed
on vocabulary shards (loss_parallel), so no rank ever holds a whole row of logits.

The gradient norm under tensor or pipeline parallelism is summed by hand (one all-reduce of the squared local
shards, each divided by the number of ranks holding the same shard): torch's clip_grad_norm_ needs every
gradient on one mesh, and here the tensor-parallel DTensors, the FSDP2 shards and the pipeline stages' plain
parameters sit on different (sub)meshes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from gpu_train.sizing.layout import MESH_DIMS, Layout
from trainer.distributed import DistEnv
from trainer.model import GPT


def build_mesh(layout: Layout, env: DistEnv) -> Any:
    """The (pp, dp_replicate, dp_shard, tp) DeviceMesh, tp innermost (gpu_train/sizing/layout.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, layout.shape, mesh_dim_names=MESH_DIMS)


def dp_mesh(mesh: Any, layout: Layout) -> Any:
    """The mesh FSDP2 shards (and, for HSDP, replicates) over."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


# ---------------------------------------------------------------------------------------------- tensor parallel
def _positions_to_sequence_shards(module: torch.nn.Module, tp_mesh: Any) -> None:
    """The learned position embedding: replicated weights; its (T, d) output split along the sequence like the
    token embeddings it is added to."""

    def inputs(_mod: torch.nn.Module, args: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

    def outputs(_mod: torch.nn.Module, out: DTensor, mesh: Any) -> DTensor:
        return out.redistribute(mesh, [Shard(0)])

    distribute_module(module, tp_mesh, None, inputs, outputs)


def tensor_parallel(model: GPT, tp_mesh: Any) -> None:
    """Split `model` (whole, or a pipeline stage's part) over `tp_mesh` (the module docstring)."""
    top: dict[str, Any] = {}
    if model.tok_emb is not None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    if model.norm_f is not None:
        top["norm_f"] = SequenceParallel()
        top["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)
    if model.pos_emb is not None:
        _positions_to_sequence_shards(model.pos_emb, tp_mesh)
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attn.wqkv": ColwiseParallel(),  # rows head by head: each rank's block of rows holds whole heads
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        # Between blocks (and pipeline stages) the residual stream is this rank's sequence shard as a plain tensor.
        parallelize_module(block, tp_mesh, PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
    if model.tok_emb is not None and model.lm_head is not None:
        # Both are split along the vocabulary (Shard(0) of the same weight): tie them again after distributing.
        model.lm_head.weight = model.tok_emb.weight


# ---------------------------------------------------------------------------------------------- data parallel
def fully_shard_model(roots: list[torch.nn.Module], blocks: list[torch.nn.Module], mesh: Any,
                      dtype: torch.dtype | None) -> None:
    """FSDP2 per block, then per root (the whole model, or each pipeline stage) for what the blocks leave."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Parameters gathered in bf16, gradients reduced in fp32
    # (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    for root in roots:
        fully_shard(root, mesh=mesh, mp_policy=mp)


# ---------------------------------------------------------------------------------------------- the step
# F.scaled_dot_product_attention's kernels by train.attention.
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def sdpa_backends(name: str, device_type: str) -> list[SDPBackend] | None:
    """The kernels train.attention=`name` allows, or None for torch's own choice: "auto", and any setting on a
    device other than CUDA (a CPU has the math kernel and a fused one of its own, which torch picks itself)."""
    if name == "auto" or device_type != "cuda":
        return None
    return [SDPA_BACKENDS[name]]


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a replicated scalar loss), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class StepRunner:
    """One step's forward and backward passes, the gradient norm and evaluation losses for one layout: the data
    parallel and tensor parallel runner; trainer/pipeline.py's PipelineRunner adds the pipeline. `data_rank` of
    `data_world` is the part of each global batch this rank reads (the ranks of a tensor-parallel group, and the
    stages of a pipeline, read the same part); `data_ranks` are the global ranks whose parts make the global
    batch, in order."""

    def __init__(self, layout: Layout, env: DistEnv, model: GPT, wrapped: torch.nn.Module, *, mesh: Any = None,
                 autocast_dtype: torch.dtype | None = None, attention: str = "auto") -> None:
        self.layout, self.env, self.model, self.wrapped, self.mesh = layout, env, model, wrapped, mesh
        self.attention = sdpa_backends(attention, env.device.type)
        self.autocast_dtype = autocast_dtype  # DDP only: FSDP2's mixed precision policy casts by itself
        tp, dp = layout.tp, layout.dp
        self.data_world = dp
        self.data_rank = (env.rank // tp) % dp
        self.data_ranks = [d * tp for d in range(dp)]  # pipeline rank 0, tensor-parallel rank 0

    def train(self) -> None:
        self.wrapped.train()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is not None:
            return torch.autocast(self.env.device.type, dtype=self.autocast_dtype)
        return contextlib.nullcontext()

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """Around forward and backward: the attention kernels of train.attention, and the loss over vocabulary
        shards under tensor parallelism."""
        stack = contextlib.ExitStack()
        if self.attention is not None:
            stack.enter_context(sdpa_kernel(self.attention))
        if self.layout.tp > 1:
            stack.enter_context(loss_parallel())
        return stack

    def grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Gradients are reduced across ranks on the last micro batch only (DDP's no_sync before it; FSDP2's
        set_requires_gradient_sync)."""
        if self.mesh is not None:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)  # under torch.compile, DDP is inside
        return ddp.no_sync() if not last and isinstance(ddp, DDP) else contextlib.nullcontext()  # one worker: no DDP

    def forward_backward(self, windows: torch.Tensor, micro_batches: int,
                         after_forward: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward and backward over this rank's micro batches (rows of context + 1 tokens), gradients synced on
        the last one; returns the mean micro-batch loss, scaled so that its sum over all ranks divided by the
        world size is the step's loss. `after_forward` runs once the last micro batch's loss is computed."""
        size = windows.shape[0] // micro_batches
        loss_sum = torch.zeros((), device=self.env.device)
        for micro in range(micro_batches):
            chunk, last = windows[micro * size:(micro + 1) * size], micro == micro_batches - 1
            with self.grad_sync(last), self.autocast(), self.loss_context():
                _, loss = self.wrapped(chunk[:, :-1], targets=chunk[:, 1:])
                if last and after_forward is not None:
                    after_forward()
                loss = loss / micro_batches
                loss.backward()
            loss_sum += local_value(loss.detach())
        return loss_sum

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global norm (over all ranks' shards, once per parameter); returns it, a
        device tensor: nothing here waits for the device (no error_if_nonfinite, whose check reads the norm on the
        host; a non-finite norm makes the step skipped instead, trainer/step_flags.py)."""
        if self.layout.tp == 1 and self.layout.pp == 1:  # DDP's plain tensors, or FSDP2's DTensors on one mesh
            return local_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True))
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self._global_sq_norm(params).sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def _global_sq_norm(self, params: list[torch.nn.Parameter], skip: set[int] | None = None) -> torch.Tensor:
        """Sum of squared gradient entries over every rank, each entry once: a rank's local shard counts divided
        by how many ranks hold the same shard (its mesh dimensions that replicate it). One all-reduce."""
        total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for p in params:
            if skip and id(p) in skip:
                continue
            g = p.grad
            if isinstance(g, DTensor):
                copies = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
                local = g.to_local()
            else:
                copies, local = self.layout.dp * self.layout.tp, g
            total += local.detach().double().pow(2).sum() / copies
        dist.all_reduce(total)
        return total

    def window_losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Evaluation: each window's mean next-token loss (B,), or None on a rank that computes none."""
        with self.autocast(), self.loss_context():
            logits = self.model(x)[0]
            per_token = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(0, 1),
                                                          reduction="none")
            return local_value(per_token).view(y.shape).mean(dim=1)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict in host memory on rank 0, {} elsewhere. Collective."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.env.rank == 0 else {}
