"""Process group setup, device choice, seeding and per-rank RNG state.

Usage:
    from trainer.distributed import init_distributed
    env = init_distributed()        # reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK; world 1 without torchrun
    env.rank, env.world_size, env.device, env.is_cuda
    env = current_env()             # the same, for a loop that created the process group itself
    state = rng_state(); set_rng_state(state)

NCCL on CUDA, gloo on CPU. Without torchrun's environment the trainer runs as a single process with a
one-member gloo/NCCL group on a free localhost port, so every code path (DCP, collectives) is the same.

Under torchrun the workers must not share the agent's TCPStore: it outlives a restart of the worker group,
and in torch 2.13 the keys a new round writes collide with the last round's, so restarted gloo workers read
dead workers' addresses and fail in connectFullMesh. Nor can a per-worker key prefix fix it, because
TORCHELASTIC_RESTART_COUNT is counted per agent and differs between nodes after one of them fails. torch's
own switch, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, makes every rendezvous round
publish a fresh MASTER_ADDR:MASTER_PORT on which global rank 0 hosts a new store
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, DynamicRendezvousHandler.next_rendezvous and
use_agent_store; torch/distributed/rendezvous.py, _create_c10d_store). The launcher (trainer/launch.py) sets
it; a worker that finds the shared store with restarts allowed refuses to start.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import random
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from gpu_train.spec import env as job_env
from trainer.errors import BadInput, TrainingFailed

log = logging.getLogger("trainer.distributed")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    restart_count: int  # torchrun's TORCHELASTIC_RESTART_COUNT: failure restarts of this node's agent
    local_world_size: int = 1  # workers on this node
    under_torchrun: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def setup_logging(env: DistEnv) -> None:
    """Log lines on stderr that name their rank: INFO from one worker per node (what this node resumed from, what
    it downloaded), warnings from all."""
    logging.basicConfig(level=logging.INFO if env.local_rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a standalone rendezvous, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _is_torchrun(pid: int) -> bool:
    """Whether process `pid` runs torchrun (a container may run it as pid 1)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline


def bind_to_agent() -> None:
    """Under torchrun: ask Linux to SIGKILL this worker when its agent dies, and die now if it already has.

    torchrun starts each worker in a session of its own (torch/distributed/elastic/multiprocessing/
    subprocess_handler/subprocess_handler.py), so nothing else takes the workers down when the agent is
    killed (OOM killer, a bad-input stop from trainer.errors.stop_retries, the launcher killed): without this
    they would keep training with nobody to restart them. prctl(PR_SET_PDEATHSIG) is described in prctl(2); it
    acts on the parent's death after the call, so an agent that died earlier (while this worker imported torch)
    must be found by other means, checked after the call so that no death falls between the two:
    - under the launcher, trainer.torchrun hands down the agent's pid (TRAINER_AGENT_PID): a parent other than
      that process, while that process no longer exists, means the agent is gone (the parent is now the
      process that adopted this orphan: init or a subreaper);
    - without it, a parent of pid 1 that is not torchrun itself means the same. An orphan adopted by a subreaper
      other than pid 1 cannot be told from a worker of an agent without the launcher's pid; a parent that changed
      during the call is caught either way.
    """
    if not under_torchrun() or not os.path.exists("/proc/self"):
        return
    before = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): workers outlive a killed agent", ctypes.get_errno())
        return
    parent = os.getppid()
    agent = os.environ.get(job_env.AGENT_PID, "")  # set by trainer.torchrun, the launcher's torchrun: our parent
    if agent.isdigit():
        gone = parent != int(agent) and not _alive(int(agent))
    else:
        gone = parent != before or (parent == 1 and not _is_torchrun(1))
    if gone:
        os.kill(os.getpid(), signal.SIGKILL)


def check_store_mode() -> None:
    """Refuse the agent's shared TCPStore when the group may be restarted (see the module docstring)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts.isdigit() and int(restarts) == 0:
        log.warning("%s is not 1 in torchrun's environment: a restart of the worker group (a node joining) "
                    "would fail in gloo's connectFullMesh; use gpu-train-launch or set it", job_env.STORE_SWITCH)
        return
    raise BadInput(
        f"torchrun runs with --max-restarts={restarts} but without {job_env.STORE_SWITCH}=1 in its environment: a "
        "restarted worker group would reuse the agent's store and fail; start it through gpu-train-launch "
        f"(trainer/entrypoint.sh) or export {job_env.STORE_SWITCH}=1"
    )


def init_distributed(timeout_s: float = 600.0, nccl_env: dict[str, str] | None = None) -> DistEnv:
    """Join (or, standalone, create) the default process group and pick this worker's device.

    `timeout_s` is every collective's timeout on the default group (the trainer derives it from its watchdog,
    trainer/watchdog.py). `nccl_env` are TORCH_NCCL_* settings applied, unless the environment already has
    them, before the NCCL process group is created (ProcessGroupNCCL reads them in its constructor)."""
    torchrun = under_torchrun()
    if torchrun:
        check_store_mode()
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
        for key, value in (nccl_env or {}).items():
            os.environ.setdefault(key, value)
    else:
        device = torch.device("cpu")
        backend = "gloo"
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not dist.is_initialized():
        kwargs: dict = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(
        rank=rank, world_size=world, local_rank=local_rank, device=device, restart_count=restart_count,
        local_world_size=local_world, under_torchrun=torchrun,
    )


def current_env() -> DistEnv:
    """This process's place in the default process group (which must exist), for a loop that set it up itself:
    rank and world size from the group, local rank and node size from torchrun's environment, the local
    CUDA device when there is one."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return DistEnv(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device,
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), under_torchrun=under_torchrun(),
    )


def raise_agreed(fault: tuple[str, str] | None, world_size: int) -> NoReturn:
    """Some rank hit bad input or a failure; every rank raises the same: BadInput for the first ("bad", message)
    of any rank, else TrainingFailed for the first ("failed", message). Collective."""
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, fault)
    bad = [f[1] for f in every if f and f[0] == "bad"]
    if bad:
        raise BadInput(bad[0])
    raise TrainingFailed(next(f[1] for f in every if f))


def agree(error: str | None, world_size: int) -> str | None:
    """The first error any rank reports (every rank gets the same answer); None if there is none. Collective."""
    every: list[str | None] = [None] * world_size
    dist.all_gather_object(every, error)
    return next((e for e in every if e), None)


# Process groups left by shutdown(), kept until the process ends (shutdown's docstring says why).
_RETIRED: list[Any] = []


def shutdown() -> None:
    """Leave every process group (destroy_process_group: NCCL's communicators are shut down), keeping the groups'
    objects alive until the process ends. Freed at once, a gloo group can deadlock the process right after a
    collective: its worker thread frees the collective's tensors, which takes the GIL, while it holds the lock that
    the group's destructor waits for with the GIL held (found in a live stack of a rank that stayed up after a
    finished run on a loaded machine). The bundled trainer leaves with os._exit, so its groups are never freed; a
    script that returns frees them when the interpreter ends, long after its last collective."""
    if dist.is_initialized():
        # Every group, the default one included: torch keeps no public list of them.
        _RETIRED.extend(dist.distributed_c10d._world.pg_map)
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
