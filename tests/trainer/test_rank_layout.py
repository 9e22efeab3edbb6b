"""The layout a worker trains under at its world size: refused when tensor parallelism would span nodes, and one
warning line when FSDP2 has nothing to shard.

Run: .venv/bin/pytest tests/trainer/test_rank_layout.py -q
"""

from __future__ import annotations

import logging

import pytest
import torch

from gpu_train.sizing.layout import Layout
from gpu_train.spec.trainer_config import build_config
from trainer.distributed import DistEnv
from trainer.errors import BadInput
from trainer.parallelize import rank_layout


def env(world: int, local: int, rank: int = 0) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank % local, device=torch.device("cpu"), restart_count=0,
                   local_world_size=local)


def test_fsdp_alone_says_once_that_ddp_is_faster(caplog):
    fsdp = build_config("tiny", overrides=["train.parallel=fsdp"])
    with caplog.at_level(logging.WARNING, logger="trainer.parallelize"):
        assert rank_layout(fsdp, env(1, 1)) == Layout(pp=1, dp_replicate=1, dp_shard=1, tp=1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "train.parallel=fsdp" in line and "train.parallel=ddp" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.parallelize"):
        rank_layout(fsdp, env(2, 2))  # two workers: FSDP2 shards over both
        rank_layout(build_config("tiny", overrides=["train.parallel=ddp"]), env(1, 1))
    assert not caplog.records


def test_tensor_parallelism_may_not_span_two_nodes():
    tp = build_config("tiny", overrides=["train.tp=2", "train.parallel=fsdp"])
    with pytest.raises(BadInput, match="train.tp=2 does not divide the 1 workers"):
        rank_layout(tp, env(2, 1))
