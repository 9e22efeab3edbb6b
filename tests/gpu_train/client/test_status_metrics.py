"""`gpu-train status`'s progress line read from what the trainer really serves: the exposition of
trainer/metrics.py's registry (prometheus_client's text format), after a step observed as the trainer observes it.
The cluster lane cannot show the pod proxy's answer (tests/cluster/test_status_logs.py says why), so the parsing is
held here against the producer rather than a hand-written text.

Run: .venv/bin/pytest tests/gpu_train/client/test_status_metrics.py -q
"""

from __future__ import annotations

from prometheus_client import generate_latest

from gpu_train.client import status
from trainer.metrics import TrainerMetrics


def test_the_progress_line_reads_the_trainers_own_exposition():
    prom = TrainerMetrics(port=0, rank=0)
    prom.observe_step(step=120, loss=3.41234, tokens=65536, step_s=4.0, data_wait_s=0.0, fwd_bwd_s=3.5,
                      optim_s=0.5, ckpt_block_s=0.0, tokens_per_s=16384.0, mfu=None, now=0.0)
    metrics = status.read_metrics(generate_latest(prom.registry).decode())
    assert metrics["trainer_step"] == 120 and metrics["trainer_tokens_per_second"] == 16384
    # 80 steps left x 65536 tokens / 16384 tokens/s = 320 s.
    assert status.progress(metrics, 200, 65536) == "step 120/200  loss 3.4123  tokens/s 16,384  ETA 0:05:20"


def test_a_trainer_before_its_first_step_shows_no_loss_or_rate_yet():
    """Before the first step the trainer serves its loss and throughput as NaN, not 0: status shows the step only."""
    metrics = status.read_metrics(generate_latest(TrainerMetrics(port=0, rank=0).registry).decode())
    assert status.progress(metrics, 200, 65536) == "step 0/200"
