"""Checkpoint formats: a checkpoint of an older format is refused on resume with a line saying what to do, and
export still reads its fused query/key/value matrix.

Run: .venv/bin/pytest tests/trainer/test_preflight.py -q
"""

from __future__ import annotations

import torch

from gpu_train.spec.trainer_config import build_config, to_dict
from trainer.checkpoint.manifest import FORMAT_VERSION
from trainer.export import split_fused_qkv
from trainer.preflight import compatibility_problem


def test_a_checkpoint_with_one_fused_attention_matrix_is_refused_on_resume_and_named():
    cfg = build_config("tiny")
    manifest = {"format": 2, "config": to_dict(cfg), "trainer": {}}
    problem = compatibility_problem(cfg, manifest, "runs/x/checkpoints/step_000000010", "")
    assert problem is not None and problem.startswith("checkpoint runs/x/checkpoints/step_000000010 is in format 2")
    assert f"resumes format {FORMAT_VERSION}" in problem and "python -m trainer.export" in problem
    assert FORMAT_VERSION == 3


def test_export_splits_the_fused_matrix_into_query_key_and_value_rows():
    # nn.Linear(d, 3d) of the old model: output rows 0..d-1 were the query's, then the key's, then the value's.
    fused = torch.arange(12.0).view(6, 2)
    out = split_fused_qkv({"blocks.0.attn.qkv.weight": fused, "tok_emb.weight": torch.ones(1)})
    assert out["blocks.0.attn.q.weight"].tolist() == [[0, 1], [2, 3]]
    assert out["blocks.0.attn.k.weight"].tolist() == [[4, 5], [6, 7]]
    assert out["blocks.0.attn.v.weight"].tolist() == [[8, 9], [10, 11]]
    assert set(out) == {"blocks.0.attn.q.weight", "blocks.0.attn.k.weight", "blocks.0.attn.v.weight",
                        "tok_emb.weight"}
