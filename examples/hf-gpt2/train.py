"""A Hugging Face `transformers` model on the platform: a GPT-2 built from a config (nothing downloaded), trained
with DistributedDataParallel on the trainer library's deterministic dataset, with verified checkpoints, a warmup
schedule saved beside them, and MLflow tracking where the platform runs it.

Run (2 CPU workers, the built-in synthetic byte dataset; the same command resumes):
    gpu-train run --local examples/hf-gpt2/job.yaml
    python train.py --steps 20          # one process, no launcher: every place falls back to runs/local

The library calls are the plain loop's (examples/plain-loop/train.py, docs/your-code.md): JobEnv for the places,
open_dataset + GlobalSampler for the sample order at any world size, CheckpointManager for the model, the
optimizer, each rank's RNG (so dropout replays exactly after a restart) and this loop's own state (the sampler's
position and the schedule), Preemption for SIGTERM, Tracker for MLflow (only when the job has a tracking URI),
TrainerMetrics for each step's loss and throughput on the worker's Prometheus port and a loss line on rank 0 every
--log-every steps; the checkpoint manager says in one line which step a launch resumed from.
At the end rank 0 writes result.json with the sha256 of the final weights, and steps.jsonl holds each step's
loss and sample indices.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

from trainer import (
    EXIT_RESUMABLE,
    CheckpointManager,
    GlobalSampler,
    JobEnv,
    Preemption,
    Tracker,
    TrainerMetrics,
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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=8, help="windows per step over all ranks")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warmup")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines on rank 0 (0: none)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    job = JobEnv.from_environ()
    bind_to_agent()
    env = init_distributed()
    setup_logging(env)
    seed_everything(args.seed, deterministic=True)
    ds = open_dataset(job.dataset_uri, context=args.context, cache_dir=job.data_cache_dir,
                      endpoint_url=job.data_endpoint)
    sampler = GlobalSampler(ds.num_windows, global_batch=args.global_batch, seed=args.seed,
                            shard_windows=ds.shard_windows)
    config = GPT2Config(vocab_size=ds.vocab_size, n_positions=args.context + 1, n_embd=args.width,
                        n_layer=args.layers, n_head=args.heads, bos_token_id=ds.eot_id, eos_token_id=ds.eot_id)
    model = GPT2LMHeadModel(config).to(env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    ckpt = CheckpointManager(job.checkpoint_dir, job.checkpoint_uri, keep=2)
    saved: dict = {}
    resumed = ckpt.resume(model, optimizer, apply=saved.update)
    if resumed is None and ckpt.model_touched:
        sys.exit(f"no checkpoint in {job.checkpoint_dir} could be loaded and a partial load changed the model; "
                 "the next launch starts afresh")
    if resumed is not None:
        sampler.load_state_dict(saved["sampler"])
        schedule.load_state_dict(saved["schedule"])
    tracker = Tracker.start(experiment=job.experiment, run_name=job.job_name, tracking_uri=job.tracking_uri,
                            run_dir=job.run_dir, resume_run_id=saved.get("mlflow_run_id"),
                            enabled=env.rank == 0 and bool(job.tracking_uri))
    tracker.log_params(vars(args))
    tracker.log_dataset(job.dataset_uri, ds.manifest_sha256)
    ddp = DistributedDataParallel(model)
    log = (job.run_dir / "steps.jsonl").open("a") if env.rank == 0 else None
    prometheus = TrainerMetrics(port=job.metrics_port, rank=env.rank, restarts=env.restart_count,
                                log_every=args.log_every)  # and a loss line on rank 0 every --log-every steps
    step = sampler.next_step
    with Preemption(sigint=True, shutdown_timeout_s=job.shutdown_timeout_s) as preemption:
        while step < args.steps:
            started = time.perf_counter()
            rows, _ = read_step(ds, sampler, step, env.rank, env.world_size, end_step=args.steps)
            ids = torch.from_numpy(rows.astype("int64")).to(env.device)
            loss = ddp(input_ids=ids, labels=ids).loss  # the model shifts the labels by one itself
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            step += 1
            metrics = {"loss": mean.item() / env.world_size, "lr": schedule.get_last_lr()[0]}
            tracker.log_metrics(metrics, step=step)
            prometheus.record_step(step=step, loss=metrics["loss"], tokens=args.global_batch * args.context,
                                   step_s=time.perf_counter() - started)
            if log is not None:
                log.write(json.dumps({"step": step - 1, **metrics, "samples": sampler.global_batch(step - 1),
                                      "world_size": env.world_size, "restart": env.restart_count}) + "\n")
                log.flush()
            stop = preemption.any_rank()
            if step % args.checkpoint_every == 0 or step == args.steps or stop:
                state = {"step": step, "sampler": sampler.state_dict(), "schedule": schedule.state_dict(),
                         "mlflow_run_id": tracker.run_id}
                ckpt.save(step, model, optimizer, state, {"args": vars(args), "model": config.to_dict()},
                          block=stop or step == args.steps)
            if stop:
                preemption.report(step, saved=True)
                break
    prometheus.close()
    ckpt.wait()
    full = full_state_dict(model)  # collective
    if env.rank == 0:
        (job.run_dir / "result.json").write_text(json.dumps(
            {"step": step, "world_size": env.world_size, "params_sha256": state_sha256(full)}) + "\n")
    tracker.close(status="FINISHED" if step == args.steps else "KILLED")
    ckpt.close()
    ds.close()
    shutdown()
    return EXIT_RESUMABLE if step < args.steps else 0


if __name__ == "__main__":
    sys.exit(main())
