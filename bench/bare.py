"""The reference for the overhead benchmark: a bare PyTorch training loop, nothing else.

Usage: `python -m bench.bare --preset tiny --steps 60 model.n_layer=4 ...` prints one JSON line,
{"seconds_per_step": ..., "from_step": ..., "to_step": ...}.

Same model (chunked loss and attention kernel included), optimizer, learning-rate schedule, gradient
accumulation, clipping, batch and precision as `python -m trainer` with the same preset and overrides; no
process group, no DDP wrapper, no sampler or dataset (batches are drawn once up front), no metrics, no
checkpoints, and no host read of any tensor in a step (neither does the trainer's step). Timed like the
trainer's metrics log: wall clock between the end of step `from_step` and the end of the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator

import torch
from torch.nn.attention import sdpa_kernel

from gpu_train.spec import trainer_config as tcfg
from trainer.model import GPT
from trainer.parallelize import build_optimizer, lr_at
from trainer.runner import sdpa_backends


class BareLoop:
    """The bare loop's model, optimizer and batches for a trainer config; `step(k)` trains 1-based step k."""

    def __init__(self, cfg: tcfg.Config) -> None:
        self.cfg = cfg
        self.device = device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.train.seed)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
        model = GPT(cfg.model).to(device)
        model.loss_chunk_tokens = cfg.train.loss_chunk_tokens  # the same output layer and loss as the trainer's
        self.model = torch.compile(model) if cfg.train.compile else model
        self.opt = build_optimizer(self.model, cfg, device)
        b = cfg.train.global_batch_tokens // cfg.model.context
        self.accum = b // cfg.train.micro_batch_size
        self.data = torch.randint(0, cfg.model.vocab_size, (self.accum, cfg.train.micro_batch_size,
                                                            cfg.model.context + 1), device=device)
        self.bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
        self.kernels = sdpa_backends(cfg.train.attention, device.type)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.bf16:
                stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
            if self.kernels is not None:
                stack.enter_context(sdpa_kernel(self.kernels))
            yield

    def step(self, step: int) -> None:
        t = self.cfg.train
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps)
        for m in range(self.accum):
            with self.autocast():
                _, loss = self.model(self.data[m, :, :-1], self.data[m, :, 1:])
            (loss / self.accum).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bare")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--from-step", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    loop = BareLoop(tcfg.build_config(args.preset, None, args.overrides))
    start = None
    for step in range(1, args.steps + 1):
        loop.step(step)
        if step == args.from_step:
            loop.sync()
            start = time.perf_counter()
    loop.sync()
    elapsed = time.perf_counter() - start
    print(json.dumps({"seconds_per_step": elapsed / (args.steps - args.from_step),
                      "from_step": args.from_step, "to_step": args.steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
