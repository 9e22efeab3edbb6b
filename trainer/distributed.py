"""Process group setup, device choice, seeding and per-rank RNG state.

Usage:
    from trainer.distributed import init_distributed
    env = init_distributed()        # reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK; world 1 without torchrun
    env.rank, env.world_size, env.device, env.is_cuda
    state = rng_state(); set_rng_state(state)

NCCL on CUDA, gloo on CPU. Without torchrun's environment the trainer runs as a single process with a
one-member gloo/NCCL group on a free localhost port, so every code path (DCP, collectives) is the same.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    restart_count: int  # torchrun's TORCHELASTIC_RESTART_COUNT: how often the group was restarted

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a standalone rendezvous, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Join (or, standalone, create) the default process group and pick this worker's device."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict = {"device_id": device} if backend == "nccl" else {}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Under torchrun the store is the agent's TCPStore, which survives a group restart. torch 2.13's
            # env:// handler does not prefix keys per restart, so restarted gloo workers read the dead
            # workers' addresses and fail in connectFullMesh. A prefix per restart round keeps rounds apart.
            client = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
            )
            kwargs.update(store=dist.PrefixStore(f"trainer/restart_{restart_count}", client), rank=rank,
                          world_size=world)
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    return DistEnv(
        rank=rank, world_size=world, local_rank=local_rank, device=device,
        restart_count=restart_count,
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic
        # (https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: a few CUDA kernels (e.g. some SDPA backward paths) have no deterministic variant;
        # on CPU everything used here is deterministic.
        torch.use_deterministic_algorithms(True, warn_only=True)


def rng_state() -> dict:
    """This process's python, numpy, torch and CUDA generator states (picklable)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
