"""Pipeline parallelism: the model cut into stages of consecutive blocks, one (or, interleaved, several) per
pipeline rank, run by torch.distributed.pipelining's schedules over the micro batches of a step.

Usage (trainer/parallelize.py's build_model builds it when train.pp > 1):
    runner = PipelineRunner(cfg, layout, env, model, mesh, dtype)   # prunes `model` to this rank's stages
    loss = runner.forward_backward(windows, micro_batches)          # GPipe, 1F1B or interleaved 1F1B

Stages are built torchtitan's way (torchtitan/distributed/pipeline_parallel.py): each rank keeps the GPT it was
given, with only its own blocks (the ModuleDict keeps their indices, so `blocks.7.attn.wqkv.weight` has that name in
every layout), the embeddings on the first stage, the final norm and output layer on the last. Each stage is a
PipelineStageModule over those modules, the unit FSDP2 shards and torch's PipelineStage runs.

The token embedding and the output layer share one weight (tied embeddings). With a pipeline the first stage
uses it for the lookup and the last for the logits, so both hold it under its one name, `tok_emb.weight`, from
the same initial values and the same checkpoint, and after each step's backward passes the two copies' gradients
are summed between the two stages (Megatron-LM keeps its tied embeddings the same way,
https://arxiv.org/abs/2104.04473, section 4.1): both then take the same optimizer step. The gradient norm counts
the weight once.

Micro batches: a data-parallel rank's windows of a step are split into micro batches of train.micro_batch_size,
run train.pp_microbatches at a time (gpu_train/sizing/layout.py, pipeline_runs). The first stage reads the inputs,
the last the targets; every rank of the pipeline reads the same windows, so the global sample order is the same
in every layout. The loss is the mean over micro batches, as without a pipeline.

Evaluation runs the stages one after the other for each batch (no schedule: a forward pass has no backward to
overlap), passing the activations between ranks with send/recv on the pipeline group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from gpu_train.sizing.layout import Layout, pipeline_runs, rank_stages, stage_layers
from gpu_train.spec.trainer_config import Config
from trainer.distributed import DistEnv
from trainer.model import GPT
from trainer.runner import StepRunner, dp_mesh, fully_shard_model, local_value, tensor_parallel

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class PipelineStageModule(nn.Module):
    """One stage of a GPT: its blocks, with the embeddings first and the output layer last. The modules are the
    GPT's own (shared, not copied); the GPT itself is not a child, so parameter names stay the GPT's."""

    def __init__(self, model: GPT, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "gpt", model)
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in layers)
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        if last:
            # tok_emb too: its weight is lm_head's (tied), and FSDP2 must shard it where both names see it.
            self.tok_emb, self.norm_f, self.lm_head = model.tok_emb, model.norm_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpt: GPT = self.gpt
        h = gpt.embed(x) if self.first else x
        h = gpt.run_blocks(h, self.blocks)
        return gpt.logits(h) if self.last else h


def prune(model: GPT, keep: set[int], *, first: bool, last: bool) -> None:
    """Drop the blocks this rank does not hold, and the embeddings and output layer its stages do not use."""
    for key in list(model.blocks.keys()):
        if int(key) not in keep:
            del model.blocks[key]
    if not first:
        model.pos_emb = None
    if not first and not last:
        model.tok_emb = None
    if not last:
        model.norm_f = None
        model.lm_head = None


class PipelineRunner(StepRunner):
    """The StepRunner of a pipeline: builds this rank's stages and schedule, and runs a step through them."""

    def __init__(self, cfg: Config, layout: Layout, env: DistEnv, model: GPT, mesh: Any,
                 dtype: torch.dtype | None) -> None:
        super().__init__(layout, env, model, model, mesh=mesh, attention=cfg.train.attention)
        t = cfg.train
        pp_mesh = mesh["pp"]
        self.pp_group, self.pp_rank = pp_mesh.get_group(), pp_mesh.get_local_rank()
        self.n_stages = layout.pp * t.pp_stages_per_rank
        self.stage_ids = rank_stages(self.pp_rank, layout.pp, t.pp_stages_per_rank)
        layers = stage_layers(cfg.model.n_layer, self.n_stages)
        self.first = 0 in self.stage_ids
        self.last = self.n_stages - 1 in self.stage_ids
        prune(model, {i for s in self.stage_ids for i in layers[s]}, first=self.first, last=self.last)
        self.stage_modules = [PipelineStageModule(model, layers[s], first=s == 0, last=s == self.n_stages - 1)
                        for s in self.stage_ids]
        if layout.tp > 1:
            tensor_parallel(model, mesh["tp"])
        fully_shard_model(self.stage_modules, list(model.blocks.values()), dp_mesh(mesh, layout), dtype)
        for module in self.stage_modules:
            module.to_empty(device=env.device)  # each FSDP2 root re-registers its sharded parameters
        model.init_buffers(device=env.device)
        self.act_dtype = dtype or torch.float32
        self.per_run, self.runs = pipeline_runs(cfg, layout)
        stages = [PipelineStage(m, s, self.n_stages, env.device, group=self.pp_group)
                  for m, s in zip(self.stage_modules, self.stage_ids, strict=True)]
        schedule = SCHEDULES[t.pp_schedule]
        self.schedule = schedule(stages if t.pp_schedule == "interleaved_1f1b" else stages[0], self.per_run,
                                 loss_fn=self._loss)
        self.tied_group = self._tied_group()

    def _tied_group(self) -> Any:
        """The group of the first and the last stage's ranks with this rank's data and tensor coordinates."""
        step = self.env.world_size // self.layout.pp  # ranks per pipeline stage
        pairs = [[c, (self.layout.pp - 1) * step + c] for c in range(step)]
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        return group

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return GPT.loss(logits, targets) / self.runs

    def train(self) -> None:
        self.model.train()
        for module in self.stage_modules:
            module.train()

    def forward_backward(self, windows: torch.Tensor, micro_batches: int,
                         after_forward: Callable[[], None] | None = None) -> torch.Tensor:
        """The step's micro batches through the schedule, `runs` schedule runs of `per_run` micro batches; the
        loss contribution is the last stage's mean loss times the number of stages (every rank's sum divided by
        the world size is then the mean over data-parallel ranks). `after_forward` runs after the last run."""
        rows = windows.shape[0] // self.runs
        loss_sum = torch.zeros((), device=self.env.device)
        for run in range(self.runs):
            chunk = windows[run * rows:(run + 1) * rows]
            losses: list[torch.Tensor] = []
            with self.loss_context():
                args = (chunk[:, :-1],) if self.first else ()
                target = chunk[:, 1:] if self.last else None
                self.schedule.step(*args, target=target, losses=losses if self.last else None)
            for loss in losses:
                loss_sum += local_value(loss.detach()) / self.per_run
        if after_forward is not None:
            after_forward()
        self._sum_tied_gradients()
        return loss_sum * self.layout.pp if self.last else loss_sum

    def _tied_weight(self) -> nn.Parameter | None:
        return self.model.tok_emb.weight if self.model.tok_emb is not None else None

    def _sum_tied_gradients(self) -> None:
        weight = self._tied_weight()
        if weight is None or weight.grad is None:
            return
        grad = weight.grad
        with torch.no_grad():
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tied_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm over every stage's gradients, the tied weight counted on the first stage only."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        tied = self._tied_weight()
        skip = {id(tied)} if tied is not None and self.last and not self.first else set()
        norm = self._global_sq_norm(params, skip).sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    # ------------------------------------------------------------------------------------------ evaluation
    def window_losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Each window's mean loss on the last stage's ranks (None on the others), the stages run in order."""
        h: torch.Tensor | None = None
        shape = (x.shape[0], x.shape[1] // self.layout.tp, self.model.cfg.d_model)
        for stage in range(self.n_stages):
            if stage not in self.stage_ids:
                continue
            module = self.stage_modules[self.stage_ids.index(stage)]
            if stage == 0:
                h = x
            else:
                h = torch.empty(shape, dtype=self.act_dtype, device=self.env.device)
                dist.recv(h, group=self.pp_group, group_src=(stage - 1) % self.layout.pp)
            with self.loss_context():
                out = module(h)
                if stage == self.n_stages - 1:
                    per_token = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten(0, 1),
                                                                  reduction="none")
                    return local_value(per_token).view(y.shape).mean(dim=1)
            dist.send(out.contiguous(), group=self.pp_group, group_dst=(stage + 1) % self.layout.pp)
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's full weights, gathered (FSDP and tensor parallel shards) on the stage's first rank and sent
        to rank 0 over rank 0's pipeline group. Collective."""
        leader = self.env.rank % (self.env.world_size // self.layout.pp) == 0  # data and tensor coordinates 0
        part: dict[str, torch.Tensor] = {}
        for key, value in get_model_state_dict(self.model).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if leader:
                part[key] = full.detach().cpu()
        if not leader:
            return {}
        parts: list[Any] = [None] * self.layout.pp if self.env.rank == 0 else []
        dist.gather_object(part, parts if self.env.rank == 0 else None, group=self.pp_group, group_dst=0)
        if self.env.rank != 0:
            return {}
        return {k: v for p in parts for k, v in p.items()}
