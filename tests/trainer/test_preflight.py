"""Checkpoint formats: a checkpoint of an older format (three query/key/value matrices per block, format 3, or one
matrix of query, key and value rows, format 2) is refused on resume with one line saying what to do, and export
still reads it into today's model, whose attention has one matrix head by head.

Run: .venv/bin/pytest tests/trainer/test_preflight.py -q
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from gpu_train.spec.trainer_config import build_config, to_dict
from trainer.checkpoint.manifest import FORMAT_VERSION, sha256_file
from trainer.export import load_checkpoint, split_fused_qkv, split_model_qkv
from trainer.model import GPT, fuse_qkv, split_qkv
from trainer.preflight import compatibility_problem


@pytest.mark.parametrize(("fmt", "layout"), [(3, "separate query, key and value matrices per block"),
                                             (2, "one fused query/key/value matrix per block")])
def test_a_checkpoint_of_an_older_attention_layout_is_refused_on_resume_in_one_line(fmt, layout):
    cfg = build_config("tiny")
    manifest = {"format": fmt, "config": to_dict(cfg), "trainer": {}}
    problem = compatibility_problem(cfg, manifest, "runs/x/checkpoints/step_000000010", "")
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"checkpoint runs/x/checkpoints/step_000000010 is in format {fmt} ({layout}")
    assert f"resumes format {FORMAT_VERSION}" in problem and "python -m trainer.export" in problem
    assert FORMAT_VERSION == 4
    assert compatibility_problem(cfg, {**manifest, "format": FORMAT_VERSION}, "x", "") is None


def test_the_fused_matrix_goes_head_by_head_so_a_block_of_rows_holds_whole_heads():
    n_head, d = 2, 4
    q, k, v = (torch.arange(16.0).view(d, d) + 100 * i for i in range(3))
    w = fuse_qkv(q, k, v, n_head)
    assert w.shape == (3 * d, d)
    head = d // n_head
    # The first half of the rows (tensor-parallel rank 0 of 2) is head 0's query, key and value rows.
    assert torch.equal(w[:3 * head], torch.cat([q[:head], k[:head], v[:head]]))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(w, n_head), (q, k, v), strict=True))


def test_export_splits_the_format_2_matrix_into_query_key_and_value_rows():
    # nn.Linear(d, 3d) of the format 2 model: output rows 0..d-1 were the query's, then the key's, then the value's.
    fused = torch.arange(12.0).view(6, 2)
    out = split_fused_qkv({"blocks.0.attn.qkv.weight": fused, "tok_emb.weight": torch.ones(1)})
    assert out["blocks.0.attn.q.weight"].tolist() == [[0, 1], [2, 3]]
    assert out["blocks.0.attn.k.weight"].tolist() == [[4, 5], [6, 7]]
    assert out["blocks.0.attn.v.weight"].tolist() == [[8, 9], [10, 11]]
    assert set(out) == {"blocks.0.attn.q.weight", "blocks.0.attn.k.weight", "blocks.0.attn.v.weight",
                        "tok_emb.weight"}


def _old_checkpoint(step_dir, model: GPT, cfg) -> None:
    """A format 3 checkpoint as that trainer wrote it: the model's state dict under the old names (attn.q, attn.k,
    attn.v) in DCP, with a manifest listing every file's size and sha256."""
    import torch.distributed.checkpoint as dcp

    old = split_model_qkv(model.state_dict(), cfg.model.n_head)
    assert "blocks.0.attn.q.weight" in old and "blocks.0.attn.wqkv.weight" not in old
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": old}, checkpoint_id=str(step_dir))
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in step_dir.iterdir()}
    (step_dir / "manifest.json").write_text(json.dumps({
        "format": 3, "step": 10, "world_size": 1, "config": to_dict(cfg), "trainer": {}, "files": files}))


def test_export_reads_a_checkpoint_written_with_the_old_parameter_names(tmp_path):
    cfg = build_config("tiny")
    torch.manual_seed(3)
    model = GPT(cfg.model)
    step_dir = tmp_path / "step_000000010"
    _old_checkpoint(step_dir, model, cfg)
    loaded = load_checkpoint(step_dir, data_uri="synthetic").model.state_dict()
    assert loaded.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name
