#!/usr/bin/env bash
# gpu-train-launch: the image's entrypoint for every training job. Every argument is torchrun's, the job's command
# last: `-m trainer ...` (the bundled trainer), `-m pkg.mod ...`, `script.py ...` or `--no-python argv...`.
#
# Usage (what gpu_train/jobs/jobset.py puts in the JobSet):
#     gpu-train-launch --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=c10d \
#         --rdzv-endpoint=JOB-worker-0-0.JOB:29400 --shutdown-timeout=285 ... -m trainer --preset gpt2-350m ...
#     gpu-train-launch --nnodes=1:2 --nproc-per-node=8 ... train.py --lr 3e-4          # a team's own script
#
# It hands over to trainer/launch.py (python -m trainer.launch), which checks the bundled trainer's inputs and
# waits for its dataset manifest (TRAINER_DATA_WAIT_S), waits for the rendezvous host's DNS name
# (RDZV_DNS_TIMEOUT), runs torchrun and maps its end to the exit code: 0 completed, 2 bad input (never retried),
# anything else retry. trainer/launch.py sets the launcher's environment (gpu_train.jobs.launch: the
# rendezvous-store switch, NCCL's watchdog settings) for every caller.
# GPU_TRAIN_PYTHON picks the interpreter (default python3 on PATH: the image's venv; `make train` passes .venv's).
set -euo pipefail

exec "${GPU_TRAIN_PYTHON:-python3}" -m trainer.launch "$@"
