"""The step's agreement without a host sync: one all-reduce of the step's flags, the decision whether the step is
applied taken on the device, and the host told one step later through a non-blocking copy.

Usage (trainer/train.py):
    flags = StepFlags(device, world_size)
    reduced = flags.reduce(loss_sum, stop=..., bad=..., failed=..., sigint=...)   # collective, no host read
    norm = runner.clip_grad_norm_(max_norm)                                       # a device tensor
    optimizer.found_inf = flags.skip(reduced, norm)     # 1.0: the fused AdamW leaves this step out entirely
    optimizer.step()
    pending = flags.send(reduced, norm)                 # copy to host memory, nothing waits for it
    ...                                                 # the next step's forward and backward are queued
    values = pending.values()                           # waits for that copy only (done long before, usually)

Why. Reading the all-reduced flags (and then the gradient norm) on the host before the optimizer step made the
accelerator wait for the host each step: the queue drained, then filled again (about 6 ms per step of gpt2-124m
on an H100, docs/performance.md). Here nothing in a step reads a tensor on the host: a step that must not be
applied (a non-finite loss or gradient norm, bad data or a storage failure on any rank) is skipped by the fused
AdamW kernel through its `found_inf` argument, the GradScaler's path (torch/optim/adam.py, `_fused_adam`: the
kernel returns without touching parameters or moments, and the step counters it raised are lowered again), and
the host learns of it, and of a stop signal on any rank, when it reads the copy one step later. The copy goes
to pinned memory where CUDA is available, so it runs asynchronously; elsewhere it is an ordinary copy.

The host values (`StepValues`): the step's loss (the mean over ranks), whether any rank got a stop signal (and
whether one was SIGINT), bad data or a storage failure, and the global gradient norm (0 without clipping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepValues:
    """One step's agreed flags as host numbers."""

    loss: float
    stop: bool
    bad: bool
    failed: bool
    sigint: bool
    grad_norm: float

    def diverged(self) -> str | None:
        """What went non-finite ("loss nan", "gradient norm inf"), or None."""
        if not math.isfinite(self.loss):
            return f"loss {self.loss}"
        if not math.isfinite(self.grad_norm):
            return f"gradient norm {self.grad_norm}"
        return None


class PendingValues:
    """A step's flags on their way to the host: `values()` waits for the copy (not for later work) and reads it."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None, world_size: int) -> None:
        self._host, self._event, self._world_size = host, event, world_size
        self._values: StepValues | None = None

    def ready(self) -> bool:
        return self._values is not None or self._event is None or self._event.query()

    def values(self) -> StepValues:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            # The copy has landed in host memory: a view of it, not a transfer (no Tensor read method, either).
            v = self._host.numpy().tolist()
            self._values = StepValues(loss=v[0] / self._world_size, stop=v[1] > 0, bad=v[2] > 0, failed=v[3] > 0,
                                      sigint=v[4] > 0, grad_norm=v[5])
        return self._values


class StepFlags:
    """Builds, reduces and sends one step's flags (module docstring); one per trainer."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device, self.world_size = device, world_size
        self._cuda = device.type == "cuda"

    def _to_device(self, values: list[float]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.float32)
        if not self._cuda:
            return host.to(self.device)
        # From pageable memory a host-to-device copy waits for the device queue; from pinned memory it does not.
        return host.pin_memory().to(self.device, non_blocking=True)

    def reduce(self, loss_sum: torch.Tensor, *, stop: bool, bad: bool, failed: bool, sigint: bool) -> torch.Tensor:
        """[loss sum, stop, bad, failed, sigint] summed over every rank. Collective; reads nothing on the host."""
        host_flags = self._to_device([float(stop), float(bad), float(failed), float(sigint)])
        flags = torch.cat([loss_sum.detach().float().reshape(1), host_flags])
        if self.world_size > 1:  # one worker agrees with itself
            dist.all_reduce(flags)
        return flags

    @staticmethod
    def skip(reduced: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """1.0 when the step must not be applied (a non-finite loss or gradient norm, bad data or a storage failure
        on any rank), else 0.0: a 0-dim float32 tensor on the device (the step counters' shape), the fused AdamW's
        `found_inf`."""
        bad = ~torch.isfinite(reduced[0]) | (reduced[2] > 0) | (reduced[3] > 0)
        if norm is not None:
            bad = bad | ~torch.isfinite(norm.float())
        return bad.float().reshape(())

    def send(self, reduced: torch.Tensor, norm: torch.Tensor | None) -> PendingValues:
        """Start copying the step's flags (and gradient norm) to the host; nothing waits for the copy here."""
        grad_norm = norm.detach().float().reshape(1) if norm is not None else torch.zeros(1, device=self.device)
        values = torch.cat([reduced, grad_norm.to(reduced.device)])
        if not self._cuda:
            return PendingValues(values.clone(), None, self.world_size)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingValues(host, event, self.world_size)
