"""The launch builder: torchrun's own parser reads its arguments as the JobSet, `run --local` and `make train` pass
them, a job's command in torchrun's module, script and --no-python forms, and the job environment
(gpu_train.spec.env): every variable of source "job" set by launch_env and nothing else, the rendezvous store,
the waits and NCCL's watchdog spelled in one place.

Run: .venv/bin/pytest tests/gpu_train/jobs/test_launch.py -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun

from gpu_train.jobs import launch
from gpu_train.spec import env as job_env
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
    site = launch.Site(run_dir=str(tmp_path), dataset_uri="synthetic")
    cmd, _ = launch.local(JOB, site, 2, nodes=NodeRange(1, 2), rdzv_conf=["last_call_timeout=1"])
    assert cmd[1:3] == ["-m", "trainer.launch"]
    parsed = torchrun.get_args_parser().parse_args(cmd[3:])
    assert (parsed.nnodes, parsed.rdzv_endpoint, parsed.rdzv_conf) == ("1:2", "localhost:0",
                                                                       "join_timeout=2400,last_call_timeout=1")
    assert parsed.shutdown_timeout == launch.shutdown_timeout_s()
    trainer = trainer_parser().parse_args(parsed.training_script_args)
    assert trainer.overrides == [launch.override_text(k, v) for k, v in
                                 trainer_settings(JOB, launch.bundled_settings(JOB, site)).items()]


def test_a_local_launch_has_one_precedence_tuning_then_the_callers_environment_then_the_jobs_places(tmp_path):
    site = launch.Site(run_dir=str(tmp_path / "run"), dataset_uri="synthetic")
    caller = {"PATH": "/usr/bin", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "GPU_TRAIN_RUN_DIR": "/elsewhere", "HOME": "/h"}
    _, env = launch.local(JOB, site, 1, environ=caller)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the caller retunes the launcher
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env[job_env.STORE_SWITCH] == "1"  # else its tuning
    assert env["GPU_TRAIN_RUN_DIR"] == site.run_dir  # the job's places win
    assert env["HOME"] == "/h"
    assert env["PATH"] == f"{Path(sys.executable).parent}{os.pathsep}/usr/bin"
    with pytest.raises(launch.LaunchSpecError, match="--nproc 0 must be >= 1"):
        launch.local(JOB, site, 0)


SITE = launch.Site(run_dir="/mnt/nvme/runs/llm", dataset_uri="s3://ds/llm/manifest.json")
FULL = launch.Site(run_dir="/mnt/nvme/runs/llm", dataset_uri="http://cache/ds/llm/manifest.json",
                   checkpoint_uri="s3://ck/research/llm", data_cache_dir="/mnt/nvme/cache/llm",
                   data_endpoint="http://cache:39999/api/v1/s3", tracking_uri="http://mlflow:5000", metrics_port=9400,
                   cloud="aws", region="us-east-1", image_digest="sha256:" + "a" * 64)


def test_the_environment_is_the_store_switch_the_waits_and_nccls_watchdog():
    env = launch.launch_env(JOB, SITE)
    assert env[job_env.STORE_SWITCH] == "1"
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


def test_launch_env_sets_exactly_job_envs_job_variables():
    """Everywhere: the variables JOB_ENV marks as always set; on the cluster (every place known) all of them."""
    assert set(launch.launch_env(JOB, SITE)) == job_env.names("job", always=True)
    full = launch.launch_env(JOB, FULL)
    assert set(full) == job_env.names("job")
    assert job_env.names("job", always=False) == {"GPU_TRAIN_DATA_ENDPOINT", "MLFLOW_TRACKING_URI",
                                                   "TRAINER_METRICS_PORT", "GPU_TRAIN_CLOUD", "GPU_TRAIN_REGION",
                                                   "TRAINER_IMAGE_DIGEST"}
    assert (full["GPU_TRAIN_CHECKPOINT_DIR"], full["GPU_TRAIN_CHECKPOINT_URI"]) == (
        "/mnt/nvme/runs/llm/checkpoints", "s3://ck/research/llm")
    assert (full["GPU_TRAIN_DATASET_URI"], full["GPU_TRAIN_DATA_ENDPOINT"]) == (
        "http://cache/ds/llm/manifest.json", "http://cache:39999/api/v1/s3")
    assert (full["MLFLOW_EXPERIMENT_NAME"], full["GPU_TRAIN_JOB_NAME"], full["TRAINER_METRICS_PORT"]) == (
        "llm", "llm", "9400")
    # Without a data cache directory of its own, the job's shard cache sits beside its run directory.
    assert launch.launch_env(JOB, SITE)["GPU_TRAIN_DATA_CACHE_DIR"] == "/mnt/nvme/runs/cache/llm"


def test_the_bundled_trainer_reads_the_same_places_as_settings():
    settings = launch.bundled_settings(JOB, FULL)
    env = launch.launch_env(JOB, FULL)
    assert settings == {"checkpoint.local_dir": env["GPU_TRAIN_CHECKPOINT_DIR"],
                        "checkpoint.remote_uri": env["GPU_TRAIN_CHECKPOINT_URI"], "data.uri": env["GPU_TRAIN_DATASET_URI"],
                        "data.cache_dir": env["GPU_TRAIN_DATA_CACHE_DIR"], "tracking.experiment": "llm",
                        "data.endpoint_url": env["GPU_TRAIN_DATA_ENDPOINT"]}


def _own(command: list[str]):
    job = read_job({"name": "own", "team": "research", "pool": "h100", "nodes": "1:2", "command": command}, key="job")
    args = launch.torchrun_args(job, nproc=2, endpoint="own-worker-0-0.own:29400", run_dir="/r",
                                settings={"train.steps": 5})
    return torchrun.get_args_parser().parse_args(args)  # torch's own parser, as the launcher reads them


@pytest.mark.parametrize(("command", "module", "no_python", "script", "rest"), [
    (["python", "-m", "pkg.train", "--lr", "3e-4"], True, False, "pkg.train", ["--lr", "3e-4"]),
    (["python3", "-m", "train"], True, False, "train", []),
    (["python", "train.py", "--steps", "40"], False, False, "train.py", ["--steps", "40"]),
    (["python", "-u", "train.py"], False, True, "python", ["-u", "train.py"]),
    (["bash", "-c", "echo $RANK"], False, True, "bash", ["-c", "echo $RANK"]),
    (["/opt/venv/bin/accelerate", "launch"], False, True, "/opt/venv/bin/accelerate", ["launch"]),
])
def test_a_command_maps_to_torchruns_module_script_or_no_python_form(command, module, no_python, script, rest):
    parsed = _own(command)
    assert (parsed.module, parsed.no_python, parsed.training_script, parsed.training_script_args) == (
        module, no_python, script, rest)
    # The bundled trainer's settings are its own: a job of its own code never gets them.
    assert not any("train.steps" in a for a in parsed.training_script_args)


def test_python_m_trainer_is_the_bundled_trainer_with_its_settings():
    parsed = _own(["python", "-m", "trainer"])
    assert parsed.module and parsed.training_script == "trainer"
    assert parsed.training_script_args == ["--preset", "gpt2-124m", "--run-dir", "/r", "train.steps=5"]


def test_the_layout_travels_as_trainer_settings_and_keeps_tensor_parallel_groups_on_one_node():
    """A job's layout is trainer overrides through the one launcher; torchrun gives a node's 8 workers consecutive
    ranks, and the mesh is torch's row-major arange over (pp, dp_replicate, dp_shard, tp), so each tensor-parallel
    group (the innermost dimension) is on one node and the pipeline stages are on different nodes."""
    import torch

    from gpu_train.sizing.layout import resolve_layout
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


def test_a_stop_signal_is_forwarded_once_to_the_child_and_the_handlers_come_back(tmp_path):
    import os
    import signal
    import sys
    import threading
    import time

    ready = tmp_path / "ready"
    child = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)\n")

    def stop_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_ready, daemon=True).start()
    code, forwarded = launch.run_forwarding([sys.executable, "-c", child], env=os.environ, preexec_fn=None)
    assert (code, forwarded) == (7, [signal.SIGTERM])
    assert signal.getsignal(signal.SIGTERM) is before
