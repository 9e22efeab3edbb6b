"""The three waits of a job start must nest (gpu_train/spec/job.py timeout_problems): a GPU node starts within
Kueue's pods-ready timeout, and torchrun's agents wait for their peers at least that long.

Run: .venv/bin/pytest tests/gpu_train/spec/test_job_timeouts.py -q
"""

from __future__ import annotations

from gpu_train.spec import job


def test_the_timeouts_must_nest():
    assert job.timeout_problems(rendezvous_s=35 * 60, key="k") == []
    assert job.PODS_READY_TIMEOUT_S >= job.GPU_NODE_STARTUP_S
    short_rdzv = job.timeout_problems(rendezvous_s=600, key="gpu-train:job.rendezvousTimeoutMinutes")
    assert short_rdzv and short_rdzv[0].startswith("gpu-train:job.rendezvousTimeoutMinutes is 10 minutes")
    short_ready = job.timeout_problems(rendezvous_s=3600, key="k", node_startup_s=1200, pods_ready_s=600)
    assert short_ready and "shorter than a GPU node's start" in short_ready[0]
