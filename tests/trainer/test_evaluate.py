"""Validation loss: fixed windows, rank shares that add up to the single-process result, FSDP-safe padding.

Run: .venv/bin/pytest tests/trainer/test_evaluate.py -q
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_train.spec.trainer_config import ModelConfig
from trainer.data import open_dataset
from trainer.evaluate import eval_windows, evaluate, rank_share, reduce_eval
from trainer.model import GPT

CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, context=32, vocab_size=264)


@pytest.fixture(scope="module")
def val():
    return open_dataset("synthetic", context=CFG.context, split="val")


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(CFG)


def test_eval_windows_are_spread_evenly_and_fixed():
    assert eval_windows(10, 5).tolist() == [0, 2, 4, 6, 8]
    assert eval_windows(7, 3).tolist() == [0, 2, 4]  # floor(i * 7 / 3)
    assert eval_windows(4, 100).tolist() == [0, 1, 2, 3]  # never more windows than the split has
    with pytest.raises(ValueError):
        eval_windows(0, 3)


@pytest.mark.parametrize(("n", "world", "sizes"), [(10, 3, [4, 3, 3]), (2, 4, [1, 1, 0, 0]), (8, 2, [4, 4])])
def test_rank_shares_are_contiguous_and_differ_by_at_most_one(n, world, sizes):
    spans = [rank_share(n, r, world) for r in range(world)]
    assert [hi - lo for lo, hi in spans] == sizes
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(spans[i][1] == spans[i + 1][0] for i in range(world - 1))


def test_single_process_loss_is_the_mean_of_the_models_own_window_losses(val, model):
    part = evaluate(model, val, batches=3, micro_batch_size=4)
    assert part.windows == 12
    # Reference: the model's own loss (what training reports), one window at a time.
    ref = []
    with torch.no_grad():
        for i in eval_windows(val.num_windows, 12):
            xy = torch.from_numpy(val.batch([int(i)]))
            ref.append(model(xy[:, :-1], targets=xy[:, 1:])[1].item())
    assert part.loss == pytest.approx(float(np.mean(ref)), rel=1e-6)
    assert 4.0 < part.loss < 7.0  # an untrained model: about ln(264) = 5.58
    assert reduce_eval(part) == part.loss  # no process group: nothing to reduce


@pytest.mark.parametrize("world", [2, 3, 5])
def test_rank_parts_add_up_to_the_single_process_result(val, model, world):
    whole = evaluate(model, val, batches=2, micro_batch_size=5)
    parts = [evaluate(model, val, batches=2, micro_batch_size=5, rank=r, world=world) for r in range(world)]
    assert sum(p.windows for p in parts) == whole.windows == 10
    assert sum(p.loss_sum for p in parts) == pytest.approx(whole.loss_sum, rel=1e-6)  # float32 batching


def test_every_rank_runs_the_same_number_of_forward_passes(val, model):
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    counts = []
    for rank in range(4):  # 6 windows over 4 ranks: shares 2, 2, 1, 1; micro batches of 2
        calls.clear()
        evaluate(model, val, batches=3, micro_batch_size=2, rank=rank, world=4)
        counts.append(len(calls))
    handle.remove()
    assert counts == [1, 1, 1, 1]
    calls.clear()
    # 3 windows over 4 ranks: rank 3 has none but still runs one (uncounted) forward pass.
    parts = [evaluate(model, val, batches=1, micro_batch_size=3, rank=r, world=4) for r in range(4)]
    assert [p.windows for p in parts] == [1, 1, 1, 0] and parts[3].loss_sum == 0.0
    assert math.isnan(parts[3].loss)


def test_model_mode_is_restored_and_no_gradients_are_made(val, model):
    model.train()
    evaluate(model, val, batches=1, micro_batch_size=2)
    assert model.training and all(p.grad is None for p in model.parameters())
    model.eval()
    evaluate(model, val, batches=1, micro_batch_size=2)
    assert not model.training


def test_autocast_context_is_entered_for_each_forward(val, model):
    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(1)
        yield

    evaluate(model, val, batches=3, micro_batch_size=2, autocast=ctx)
    assert len(entered) == 3
    bf16 = evaluate(model, val, batches=1, micro_batch_size=2,
                    autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))  # fmt: skip
    fp32 = evaluate(model, val, batches=1, micro_batch_size=2)
    assert bf16.loss == pytest.approx(fp32.loss, abs=0.05) and bf16.loss != fp32.loss


def test_a_trained_model_scores_lower_on_held_out_text(val):
    torch.manual_seed(0)
    m = GPT(CFG)
    before = evaluate(m, val, batches=4, micro_batch_size=8).loss
    train = open_dataset("synthetic", context=CFG.context)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(30):
        xy = torch.from_numpy(train.batch(rng.integers(0, train.num_windows, 16).tolist()))
        loss = m(xy[:, :-1], targets=xy[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert evaluate(m, val, batches=4, micro_batch_size=8).loss < before - 1.0


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    m = GPT(CFG)
    ds = open_dataset("synthetic", context=CFG.context, split="val")
    loss = reduce_eval(evaluate(m, ds, batches=3, micro_batch_size=3, rank=rank, world=world))
    with open(f"{out}.{rank}", "w") as f:
        f.write(repr(loss))
    dist.destroy_process_group()


@pytest.mark.slow
def test_reduce_over_a_real_process_group_matches_one_process(val, tmp_path):
    torch.manual_seed(0)
    want = evaluate(GPT(CFG), val, batches=3, micro_batch_size=3).loss
    init = f"file://{tmp_path / 'rdzv'}"
    out = str(tmp_path / "loss")
    torch.multiprocessing.start_processes(_worker, args=(2, init, out), nprocs=2, join=True,
                                          start_method="spawn")  # fmt: skip
    got = [float(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert got[0] == got[1] == pytest.approx(want, rel=1e-6)
