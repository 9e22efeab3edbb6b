"""The one launcher: torchrun's own parser reads its arguments as the JobSet, `run --local` and `make train` pass
them, and the environment spells the rendezvous store, the waits and NCCL's watchdog in one place.

Run: .venv/bin/pytest tests/gpu_train/jobs/test_launch.py -q
"""

from __future__ import annotations

import torch.distributed.run as torchrun

from gpu_train.jobs import launch
from gpu_train.spec.job import NodeRange, read_job, trainer_settings
from trainer.__main__ import parser as trainer_parser

JOB = read_job({"name": "llm", "team": "research", "pool": "h100", "preset": "tiny", "nodes": "2:4",
                "maxRestarts": 7, "rendezvousTimeoutMinutes": 40, "dataWaitMinutes": 3}, key="job")


def test_the_arguments_are_torchruns_then_the_trainers():
    args = launch.torchrun_args(JOB, nproc=8, endpoint="llm-worker-0-0.llm:29400", run_dir="/mnt/nvme/runs/llm",
                                settings=trainer_settings(JOB), shutdown_timeout=launch.shutdown_timeout_s())
    parsed = torchrun.get_args_parser().parse_args(args)  # torch's own parser, as the launcher reads them
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend, parsed.rdzv_endpoint) == (
        "2:4", "8", "c10d", "llm-worker-0-0.llm:29400")
    assert (parsed.rdzv_id, parsed.max_restarts, parsed.rdzv_conf) == ("llm", 7, "join_timeout=2400")
    # 300 s of grace less a 15 s margin for torchrun to reap its workers before the kubelet's SIGKILL.
    assert parsed.shutdown_timeout == 285
    assert parsed.module and parsed.training_script == "trainer"
    trainer = trainer_parser().parse_args(parsed.training_script_args)
    assert trainer.preset == "tiny" and str(trainer.run_dir) == "/mnt/nvme/runs/llm"
    assert trainer.overrides[:3] == ["train.steps=1000", "train.global_batch_tokens=524288",
                                     "checkpoint.every_steps=200"]


def test_local_runs_use_the_same_arguments_on_this_machine(tmp_path):
    cmd = launch.local_command(JOB, nproc=2, run_dir=tmp_path, settings=trainer_settings(JOB), nodes=NodeRange(1, 2),
                               rdzv_conf=["last_call_timeout=1"])
    assert cmd[1:3] == ["-m", "trainer.launch"]
    parsed = torchrun.get_args_parser().parse_args(cmd[3:])
    assert (parsed.nnodes, parsed.rdzv_endpoint, parsed.rdzv_conf) == ("1:2", "localhost:0",
                                                                       "join_timeout=2400,last_call_timeout=1")
    assert parsed.shutdown_timeout == launch.shutdown_timeout_s()


def test_the_environment_is_the_store_switch_the_waits_and_nccls_watchdog():
    env = launch.launch_env(JOB)
    assert env[launch.STORE_SWITCH] == "1"
    assert (env["TRAINER_DATA_WAIT_S"], env["RDZV_DNS_TIMEOUT"]) == ("180", "2400")
    # torch 2.13's names (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp): tear down without a communicator
    # abort, keep and dump the flight recorder, keep the heartbeat monitor.
    assert {k: env[k] for k in launch.nccl_env()} == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                                                      "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000",
                                                      "TORCH_NCCL_ENABLE_MONITORING": "1"}


def test_a_grace_period_too_short_for_torchrun_is_refused():
    import pytest

    with pytest.raises(launch.LaunchSpecError, match="leaves torchrun no time"):
        launch.shutdown_timeout_s(15)


def test_the_layout_travels_as_trainer_settings_and_keeps_tensor_parallel_groups_on_one_node():
    """A job's layout is trainer overrides through the one launcher; torchrun gives a node's 8 workers consecutive
    ranks, and the mesh is torch's row-major arange over (pp, dp_replicate, dp_shard, tp), so each tensor-parallel
    group (the innermost dimension) is on one node and the pipeline stages are on different nodes."""
    import torch

    from gpu_train.spec.layout import resolve_layout
    from gpu_train.spec.trainer_config import build_config

    job = read_job({"name": "llm", "team": "research", "pool": "h100", "preset": "gpt2-350m", "nodes": "2:4",
                    "globalBatchTokens": 1048576, "overrides": {"train.tp": 4, "train.pp": 2,
                                                                 "train.parallel": "fsdp"}}, key="job")
    args = launch.torchrun_args(job, nproc=8, endpoint="llm-worker-0-0.llm:29400", run_dir="/runs/llm",
                                settings=trainer_settings(job))
    parsed = torchrun.get_args_parser().parse_args(args)
    trainer = trainer_parser().parse_args(parsed.training_script_args)
    assert {"train.tp=4", "train.pp=2", "train.parallel=fsdp"} <= set(trainer.overrides)
    cfg = build_config(trainer.preset, overrides=trainer.overrides)
    for nodes in (2, 3, 4):
        layout = resolve_layout(cfg.train, nodes * int(parsed.nproc_per_node))
        mesh = torch.arange(layout.world).view(layout.shape)
        node_of = mesh // 8
        assert (node_of == node_of[..., :1]).all()  # every tp group on one node
        assert layout.dp == nodes  # pp x tp = 8 GPUs: the data-parallel degree is what the nodes add
    assert layout.shape == (2, 1, 4, 4)
