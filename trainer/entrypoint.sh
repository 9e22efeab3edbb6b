#!/usr/bin/env bash
# Launch torchrun once the rendezvous host resolves: the image's entrypoint for the training job.
#
# Usage (what infra/k8s/training.py puts in the JobSet):
#     gpu-train-launch --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=c10d \
#         --rdzv-endpoint=JOB-worker-0-0.JOB:29400 ... -m trainer --preset gpt2-350m --run-dir DIR ...
# Every argument goes to torchrun unchanged.
#
# Why wait: JobSet publishes each pod's DNS name on the job's headless service only after the pod exists,
# and torchrun decides whether *this* pod hosts the c10d store by resolving the --rdzv-endpoint host and
# comparing it with its own addresses. If the name does not resolve yet, pod 0 wrongly thinks it is a
# client and every agent waits for a store nobody hosts. RDZV_DNS_TIMEOUT (seconds, default 600) bounds
# the wait; after it the launch fails with the host's name.
set -euo pipefail

endpoint=""
for arg in "$@"; do
    case "$arg" in
        --rdzv-endpoint=*|--rdzv_endpoint=*) endpoint="${arg#*=}" ;;
    esac
done

host="${endpoint%:*}"
if [[ -n "$host" ]]; then
    timeout_s="${RDZV_DNS_TIMEOUT:-600}"
    if ! [[ "$timeout_s" =~ ^[0-9]+$ ]]; then
        echo "gpu-train-launch: RDZV_DNS_TIMEOUT must be a whole number of seconds (got '$timeout_s')" >&2
        exit 2
    fi
    deadline=$((SECONDS + timeout_s))
    until getent hosts "$host" >/dev/null; do
        if (( SECONDS >= deadline )); then
            echo "gpu-train-launch: rendezvous host '$host' did not resolve within ${timeout_s}s" >&2
            exit 1
        fi
        sleep 2
    done
fi

exec torchrun "$@"
