"""The job environment: every variable a job's processes find set, whoever wrote the code they run.

Usage:
    from gpu_train.spec.env import JOB_ENV, CHECKPOINT_URI
    [v.name for v in JOB_ENV if v.source == "job"]       # what gpu_train.jobs.launch.launch_env sets

The bundled trainer and a team's own code get the same environment (docs/your-code.md has this table). Each
variable has one source:
- "job": gpu_train.jobs.launch.launch_env, from the job spec and where it runs: the JobSet's container
  environment on the cluster, the launcher's environment for `gpu-train run --local`; `when` says whether it is
  set everywhere ("") or only where the platform has the thing it names;
- "launcher": gpu-train-launch (trainer/launch.py) on each node, for the workers it starts through torchrun;
- "torchrun": torchrun itself (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers, in torch 2.13:
  the worker's place in the group and the restart count); listed so that the table is complete.
Besides these, a pod gets the pool's fabric variables (NCCL_*, FI_*, LD_LIBRARY_PATH: the platform contract's
`fabric.ncclEnv`), the cloud's (`podEnv`, e.g. AWS_REGION), and a writable HOME and compiler caches
(gpu_train.jobs.jobset.container_env), since the root filesystem is read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

JOB_NAME = "GPU_TRAIN_JOB_NAME"
RUN_DIR = "GPU_TRAIN_RUN_DIR"
CHECKPOINT_DIR = "GPU_TRAIN_CHECKPOINT_DIR"
CHECKPOINT_URI = "GPU_TRAIN_CHECKPOINT_URI"
DATASET_URI = "GPU_TRAIN_DATASET_URI"
DATA_CACHE_DIR = "GPU_TRAIN_DATA_CACHE_DIR"
DATA_ENDPOINT = "GPU_TRAIN_DATA_ENDPOINT"
TRACKING_URI = "MLFLOW_TRACKING_URI"  # MLflow's own name: its client reads it as it is
EXPERIMENT = "MLFLOW_EXPERIMENT_NAME"  # MLflow's own name too
METRICS_PORT = "TRAINER_METRICS_PORT"
CLOUD = "GPU_TRAIN_CLOUD"
REGION = "GPU_TRAIN_REGION"
IMAGE_DIGEST = "TRAINER_IMAGE_DIGEST"
DATA_WAIT = "TRAINER_DATA_WAIT_S"
DNS_TIMEOUT = "RDZV_DNS_TIMEOUT"
STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
FR_DUMP = "TORCH_FR_DUMP_TEMP_FILE"
SHUTDOWN = "TRAINER_SHUTDOWN_TIMEOUT_S"
EXIT_FILE = "TRAINER_EXIT_FILE"
STOP_FILE = "TRAINER_STOP_FILE"
LAUNCHER_PID = "TRAINER_LAUNCHER_PID"
AGENT_PID = "TRAINER_AGENT_PID"

Source = Literal["job", "launcher", "torchrun"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    source: Source
    meaning: str
    when: str = ""  # "" = always set; else where it is set


ON_CLUSTER = "on the cluster"
JOB_ENV: tuple[EnvVar, ...] = (
    EnvVar(JOB_NAME, "job", "the job's name (the JobSet's, torchrun's rendezvous id)"),
    EnvVar(RUN_DIR, "job", "this job's directory on the node's local NVMe (`runs/<job>` on your machine): outputs, "
                           "caches, the local copy of checkpoints"),
    EnvVar(CHECKPOINT_DIR, "job", "node-local checkpoint directory, `$GPU_TRAIN_RUN_DIR/checkpoints`: "
                                  "CheckpointManager's `local_dir`"),
    EnvVar(CHECKPOINT_URI, "job", "the job's prefix in the checkpoints bucket (`<bucket>/<team>/<job>`, or the "
                                  "spec's checkpointUri): CheckpointManager's `remote_uri`; empty on your machine "
                                  "unless the spec names a file:// one"),
    EnvVar(DATASET_URI, "job", "the dataset manifest (`<datasets bucket>/<job>/manifest.json`, or the spec's "
                               "datasetUri; `synthetic` or `--data` on your machine): open_dataset's `uri`"),
    EnvVar(DATA_CACHE_DIR, "job", "node-local shard cache for the dataset: open_dataset's `cache_dir`"),
    EnvVar(DATA_ENDPOINT, "job", "the platform's read cache (the Alluxio S3 proxy) that serves the dataset URI: "
                                 "open_dataset's `endpoint_url`", when="when the cache serves the dataset"),
    EnvVar(TRACKING_URI, "job", "the platform's MLflow server: Tracker's `tracking_uri`",
           when="when the platform runs MLflow"),
    EnvVar(EXPERIMENT, "job", "the job's name, as the MLflow experiment"),
    EnvVar(METRICS_PORT, "job", "Prometheus port of local rank 0; local rank r serves port + r, which the "
                                "platform scrapes every 15 s (the pod's metrics-<r> ports)", when=ON_CLUSTER),
    EnvVar(CLOUD, "job", "aws or gcp, for the carbon factors of measured energy", when=ON_CLUSTER),
    EnvVar(REGION, "job", "the cloud region", when=ON_CLUSTER),
    EnvVar(IMAGE_DIGEST, "job", "the sha256 digest of the job's image (an MLflow tag)", when=ON_CLUSTER),
    EnvVar(DATA_WAIT, "job", "seconds the launcher waits for the bundled trainer's dataset manifest"),
    EnvVar(DNS_TIMEOUT, "job", "seconds the launcher waits for the rendezvous host's DNS name"),
    EnvVar(STORE_SWITCH, "job", "`1`: a fresh rendezvous store every round, so a group restarted after a node loss "
                                "rendezvous cleanly"),
    EnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", "job", "`3`: a failed or timed-out collective ends the process"),
    EnvVar("TORCH_NCCL_DUMP_ON_TIMEOUT", "job", "`1`: NCCL's flight recorder dumps on a timeout"),
    EnvVar("TORCH_FR_BUFFER_SIZE", "job", "entries the flight recorder keeps"),
    EnvVar("TORCH_NCCL_ENABLE_MONITORING", "job", "`1`: NCCL's heartbeat monitor is on"),
    EnvVar(FR_DUMP, "job", "where flight recorder dumps go: `$GPU_TRAIN_RUN_DIR/nccl_trace_rank_`"),
    EnvVar(SHUTDOWN, "launcher", "seconds between SIGTERM and torchrun's SIGKILL: the final checkpoint must fit"),
    EnvVar(EXIT_FILE, "launcher", "where a worker writes its bad-input message before it stops the restarts "
                                  "(trainer.errors.stop_retries)"),
    EnvVar(STOP_FILE, "launcher", "where workers record how they stopped on a signal (trainer.errors.record_stop)"),
    EnvVar(LAUNCHER_PID, "launcher", "the launcher's pid (for stop_retries)"),
    EnvVar(AGENT_PID, "launcher", "the torchrun agent's pid: a worker whose parent is another process knows its "
                                  "agent died (trainer.distributed.bind_to_agent)"),
    EnvVar("RANK", "torchrun", "this worker's global rank"),
    EnvVar("LOCAL_RANK", "torchrun", "its rank on this node (its GPU)"),
    EnvVar("WORLD_SIZE", "torchrun", "workers in the group, which changes when nodes come and go"),
    EnvVar("LOCAL_WORLD_SIZE", "torchrun", "workers on this node"),
    EnvVar("GROUP_RANK", "torchrun", "this node's rank"),
    EnvVar("MASTER_ADDR", "torchrun", "the default process group's store host"),
    EnvVar("MASTER_PORT", "torchrun", "its port"),
    EnvVar("TORCHELASTIC_RESTART_COUNT", "torchrun", "how many times this node's agent restarted the workers"),
    EnvVar("TORCHELASTIC_MAX_RESTARTS", "torchrun", "the job's maxRestarts"),
    EnvVar("TORCHELASTIC_RUN_ID", "torchrun", "the rendezvous id (the job's name)"),
)


def names(source: Source | None = None, *, always: bool | None = None) -> set[str]:
    """The contract's variable names, of one source and, with `always`, those set everywhere (True) or not."""
    return {v.name for v in JOB_ENV if (source is None or v.source == source)
            and (always is None or (v.when == "") == always)}
