"""The bundled trainer's start-up line names the layout it really runs: the data, tensor and pipeline degrees and
how the model is spread (trainer/run.py).

Run: .venv/bin/pytest tests/trainer/test_run.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.sizing.layout import Layout
from trainer.run import layout_text, parallel_mode


@pytest.mark.parametrize(("layout", "mode"), [
    (Layout(pp=1, dp_replicate=2, dp_shard=1, tp=1), "ddp"),
    (Layout(pp=1, dp_replicate=1, dp_shard=4, tp=1), "fsdp"),
    (Layout(pp=1, dp_replicate=2, dp_shard=4, tp=1), "hsdp"),
    (Layout(pp=1, dp_replicate=1, dp_shard=1, tp=2), "tp + fsdp2 replicated"),
    (Layout(pp=2, dp_replicate=1, dp_shard=1, tp=1), "pp (gpipe) + fsdp2 replicated"),
    (Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2), "pp (gpipe) + tp + fsdp"),
])
def test_the_parallel_mode_is_what_the_runner_builds(layout, mode):
    assert parallel_mode(layout, "gpipe") == mode


def test_the_layout_text_names_every_degree():
    text = layout_text(Layout(pp=2, dp_replicate=3, dp_shard=1, tp=4), "1f1b")
    assert text == "dp=3 (replicate 3 x shard 1) x tp=4 x pp=2, pp (1f1b) + tp + fsdp2 replicated"
