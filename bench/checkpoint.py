"""Checkpoint: how long the training loop is blocked by an asynchronous checkpoint vs a synchronous
one, and checkpoint write and load throughput, through the trainer's own CheckpointManager (DCP).

Usage: `python -m bench --only checkpoint`. Runs in this process as a one-worker job (gloo); the
model is GPT-2 124M with AdamW state (about 1.5 GB per checkpoint).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import Figure, ratio
from gpu_train.spec import trainer_config as tcfg
from trainer.checkpoint import CheckpointManager, list_step_dirs
from trainer.distributed import init_distributed
from trainer.model import GPT
from trainer.parallelize import build_optimizer


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(quick: bool = False) -> list[Figure]:
    cfg = tcfg.gpt2_124m()
    if quick:
        cfg = tcfg.build_config("gpt2-124m", None, ["model.n_layer=2", "model.d_model=256", "model.n_head=4"])
    repeats = 1 if quick else 3
    env = init_distributed()
    try:
        model = GPT(cfg.model)
        opt = build_optimizer(model, cfg, env.device)
        x = torch.randint(0, cfg.model.vocab_size, (1, 129))
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()  # AdamW state exists from here on, as in a real checkpoint
        sync_block, async_block, write_mbs, load_mbs = [], [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            mgr = CheckpointManager(Path(tmp) / "ckpt", "", keep=2, env=env, async_save=True)
            step = 0
            for _ in range(repeats):
                step += 1
                sync_block.append(mgr.save(step, model, opt, {"step": step}, {}, block=True))
                rec = mgr.saved[-1]
                size = _dir_bytes(rec.path)
                write_mbs.append(size / rec.duration_s / 1e6)
                step += 1
                async_block.append(mgr.save(step, model, opt, {"step": step}, {}))
                mgr.wait()
                t0 = time.perf_counter()
                mgr.load(list_step_dirs(mgr.local_dir)[0], model, opt)
                load_mbs.append(size / (time.perf_counter() - t0) / 1e6)
            mgr.close()
    finally:
        dist.destroy_process_group()
    s, a = statistics.median(sync_block), statistics.median(async_block)
    gb = size / 1e9
    return [
        Figure("checkpoint", "loop blocked by an async checkpoint vs a sync one", a, "s", s, "sync save",
               ratio(a, s), "<= 10%", ratio(a, s) <= 0.10, notes=f"{gb:.2f} GB, median of {repeats}"),
        Figure("checkpoint", "checkpoint write (DCP + manifest with sha256)", statistics.median(write_mbs), "MB/s",
               notes="local disk"),
        Figure("checkpoint", "checkpoint load (DCP, verified)", statistics.median(load_mbs), "MB/s",
               notes="local disk, page cache warm"),
    ]
