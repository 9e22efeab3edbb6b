"""A plain PyTorch loop on the platform: a small next-byte model trained with DistributedDataParallel, on the
trainer library's deterministic dataset and verified checkpoints.

Run (2 CPU workers, the built-in synthetic dataset; the same command resumes):
    gpu-train run --local examples/plain-loop/job.yaml
    python train.py --steps 20          # one process, no launcher: every place falls back to runs/local

What the library gives this loop (docs/your-code.md):
- JobEnv: where the launcher says to write and read (run directory, checkpoint directory and store, dataset);
- open_dataset + GlobalSampler: step s reads the same global batch at any world size, so a resumed job (after a
  killed worker, a preemption, or with fewer nodes) continues the exact sample order;
- CheckpointManager: asynchronous verified saves (keep 2), resume from the newest checkpoint every rank can load,
  past a damaged one, at any world size (the model, the optimizer, each rank's RNG and the sampler's position),
  with one line saying which (`resumed from .../step_000000010 at step 10`);
- Preemption: SIGTERM (or Ctrl-C) becomes a final checkpoint and exit 75, which the platform restarts;
- Watchdog: a step that hangs ends the worker with its stacks instead of holding the job forever;
- TrainerMetrics: each step's loss and throughput on this worker's Prometheus port, which the platform scrapes,
  and a loss line on rank 0 every --log-every steps;
- TrialBudget: as a sweep's trial (--budget-uri), hold at each rung with a checkpoint until promoted or stopped,
  reporting the validation loss there (examples/plain-loop/sweep.yaml).

At the end rank 0 writes result.json (the step, the world size, the sha256 of the final weights), and each step's
loss and sample indices go to steps.jsonl: what proves two runs trained the same model on the same samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer import (
    EXIT_RESUMABLE,
    CheckpointManager,
    GlobalSampler,
    JobEnv,
    Preemption,
    TrainerMetrics,
    TrialBudget,
    Watchdog,
    bind_to_agent,
    full_state_dict,
    init_distributed,
    open_dataset,
    read_step,
    seed_everything,
    setup_logging,
    shutdown,
    state_sha256,
)


class NextByte(nn.Module):
    """Embeds each byte of a window with its position and predicts the next one through a small MLP."""

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(h + self.mlp(h))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=8, help="windows per step over all ranks")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines on rank 0 (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-every", type=int, default=0, help="steps between validation losses (0: none)")
    p.add_argument("--val-batches", type=int, default=4, help="global batches of the val split per evaluation")
    p.add_argument("--budget-uri", default="", help="a sweep trial's budget object (the sweep passes "
                                                    "${trial.budgetUri}): hold there at each rung")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    job = JobEnv.from_environ()
    bind_to_agent()  # die with torchrun's agent rather than train on alone
    env = init_distributed()
    setup_logging(env)
    seed_everything(args.seed, deterministic=True)
    ds = open_dataset(job.dataset_uri, context=args.context, cache_dir=job.data_cache_dir,
                      endpoint_url=job.data_endpoint)
    sampler = GlobalSampler(ds.num_windows, global_batch=args.global_batch, seed=args.seed,
                            shard_windows=ds.shard_windows)
    model = NextByte(ds.vocab_size, args.context, args.width).to(env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = CheckpointManager(job.checkpoint_dir, job.checkpoint_uri, keep=2)
    resumed = ckpt.resume(model, optimizer, apply=lambda state: sampler.load_state_dict(state["sampler"]))
    if resumed is None and ckpt.model_touched:
        sys.exit(f"no checkpoint in {job.checkpoint_dir} could be loaded and a partial load changed the model; "
                 "the next launch starts afresh")
    trial = TrialBudget.open(args.budget_uri, rank=env.rank, world_size=env.world_size,
                             device=env.device) if args.budget_uri else None
    val = open_dataset(job.dataset_uri, context=args.context, cache_dir=job.data_cache_dir,
                       endpoint_url=job.data_endpoint, split="val") if (args.val_every or trial) else None
    val_sampler = val and GlobalSampler(val.num_windows, global_batch=args.global_batch, seed=0,
                                        shard_windows=val.shard_windows)

    def evaluate() -> float:
        """The mean loss over the same val batches every time, all-reduced: every rank gets the same number."""
        model.eval()
        total = torch.zeros((), device=env.device)
        with torch.no_grad():
            for s in range(args.val_batches):
                rows, _ = read_step(val, val_sampler, s, env.rank, env.world_size, end_step=args.val_batches)
                xy = torch.from_numpy(rows.astype("int64")).to(env.device)
                total += F.cross_entropy(model(xy[:, :-1]).flatten(0, 1), xy[:, 1:].flatten())
        model.train()
        dist.all_reduce(total)
        return total.item() / (args.val_batches * env.world_size)

    tokens_per_step = args.global_batch * args.context
    ddp = DistributedDataParallel(model)
    log = (job.run_dir / "steps.jsonl").open("a") if env.rank == 0 else None
    prometheus = TrainerMetrics(port=job.metrics_port, rank=env.rank, restarts=env.restart_count,
                                log_every=args.log_every)  # and a loss line on rank 0 every --log-every steps
    watchdog = Watchdog(rank=env.rank, local_rank=env.local_rank, dump_dir=job.run_dir / "watchdog")
    watchdog.start()
    step = sampler.next_step
    with Preemption(sigint=True, shutdown_timeout_s=job.shutdown_timeout_s) as preemption:
        while step < args.steps:
            watchdog.begin_step(step + 1)
            started = time.perf_counter()
            rows, _ = read_step(ds, sampler, step, env.rank, env.world_size, end_step=args.steps)
            xy = torch.from_numpy(rows.astype("int64")).to(env.device)
            loss = F.cross_entropy(ddp(xy[:, :-1]).flatten(0, 1), xy[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks
            optimizer.step()
            watchdog.phase("collective")
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            step += 1
            elapsed = time.perf_counter() - started
            watchdog.end_step(elapsed)
            prometheus.record_step(step=step, loss=mean.item() / env.world_size, step_s=elapsed,
                                   tokens=args.global_batch * args.context)
            if log is not None:
                log.write(json.dumps({"step": step - 1, "loss": mean.item() / env.world_size,
                                      "samples": sampler.global_batch(step - 1), "world_size": env.world_size,
                                      "restart": env.restart_count}) + "\n")
                log.flush()
            tokens = step * tokens_per_step
            at_budget = trial is not None and trial.reached(tokens) and step < args.steps
            if val is not None and (step == args.steps or at_budget or (args.val_every and step % args.val_every == 0)):
                val_loss = evaluate()
                prometheus.observe_eval(val_loss)
                if trial is not None:
                    trial.report(step, tokens, val_loss)
            stop = preemption.any_rank()
            if step % args.checkpoint_every == 0 or step == args.steps or stop or at_budget:
                with watchdog.allowance("checkpoint", watchdog.cfg.checkpoint_s):
                    ckpt.save(step, model, optimizer, {"step": step, "sampler": sampler.state_dict()}, vars(args),
                              block=stop or step == args.steps or at_budget)
            if at_budget and not stop:
                watchdog.disarm()  # waiting to be promoted is no hang
                stop = trial.hold(step, tokens, preemption)
            if stop:
                preemption.report(step, saved=True)
                break
    watchdog.stop()
    prometheus.close()
    ckpt.wait()
    full = full_state_dict(model)  # collective
    digest = state_sha256(full) if env.rank == 0 else None
    if env.rank == 0:
        (job.run_dir / "result.json").write_text(json.dumps(
            {"step": step, "world_size": env.world_size, "params_sha256": digest}) + "\n")
    if trial is not None and step == args.steps:
        trial.finish(step, step * tokens_per_step, digest)
    ckpt.close()
    if val is not None:
        val.close()
    ds.close()
    shutdown()
    return EXIT_RESUMABLE if step < args.steps else 0


if __name__ == "__main__":
    sys.exit(main())
