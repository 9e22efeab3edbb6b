"""The step without a host sync (trainer/step_flags.py): a step that must not be applied is skipped on the device
by the fused AdamW's `found_inf` (a private path of torch, pinned here), the run then stops with the one-line
divergence error and nothing saved of that step, and an ordinary step reads no tensor on the host.

Run: .venv/bin/pytest tests/trainer/test_step_flags.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from gpu_train.spec.trainer_config import build_config
from tests.trainer.launch import FAULTS, SMALL, run_trainer, step_records
from trainer.model import GPT
from trainer.parallelize import build_optimizer
from trainer.step_flags import StepFlags, StepValues


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    return params, moments


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for name, value in a[0].items():
        assert torch.equal(value, b[0][name]), name
    for i, state in a[1].items():
        for key, value in state.items():  # exp_avg, exp_avg_sq and the step counter
            assert torch.equal(value, b[1][i][key]), (i, key)


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_the_fused_adamw_leaves_a_skipped_step_out_exactly(poison):
    """The trainer's optimizer with `found_inf` from StepFlags.skip: a step with a non-finite loss or gradient norm
    changes no parameter, moment or step counter by a single bit; the next finite step is applied as usual."""
    cfg = build_config("tiny")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (2, 9))

    def step(nan: str | None) -> None:
        _, loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        if nan == "grad":
            model.tok_emb.weight.grad[0, 0] = float("nan")
        reduced = torch.stack([loss.detach() * (float("nan") if nan == "loss" else 1.0), *torch.zeros(4)])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.found_inf = StepFlags.skip(reduced, norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(None)
    before = _state(model, opt)
    step(poison)
    _assert_same(_state(model, opt), before)
    step(None)
    after = _state(model, opt)
    assert not torch.equal(after[0]["tok_emb.weight"], before[0]["tok_emb.weight"])
    assert all(s["step"].item() == 2 for s in after[1].values())


def test_skip_also_covers_bad_data_and_storage_failures():
    ok = torch.tensor([1.0, 0, 0, 0, 0])
    assert StepFlags.skip(ok, torch.tensor(0.5)).item() == 0.0
    assert StepFlags.skip(ok, None).item() == 0.0
    for i in (2, 3):  # bad data, a storage failure on some rank
        flagged = ok.clone()
        flagged[i] = 1.0
        assert StepFlags.skip(flagged, None).item() == 1.0
    assert StepFlags.skip(ok, torch.tensor(float("inf"))).item() == 1.0
    assert StepValues(1.0, False, False, False, False, float("nan")).diverged() == "gradient norm nan"
    assert StepValues(float("inf"), False, False, False, False, 0.0).diverged() == "loss inf"


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_a_diverged_step_is_not_applied_and_stops_the_run_before_any_save(tmp_path):
    """Step 5 (0-based 4) gets a NaN gradient on purpose, with a checkpoint due after every second step: its
    parameters, moments and step counters after its optimizer step are bit-identical to before it; the host reads
    its flags during step 6, so the run exits 2 with the one-line divergence error naming step 5 and never saves
    step 6 (which would hold the skipped step): the newest checkpoint is step 4's. (A diverged step that is itself
    due a checkpoint: tests/trainer/test_bad_input.py, test_diverging_run_stops_without_saving_the_diverged_step.)"""
    run_dir = tmp_path / "run"
    res = run_trainer(run_dir, None, [*SMALL, "train.steps=8", "checkpoint.every_steps=2",
                                      "checkpoint.async_save=false"],
                      module=FAULTS, env={"TRAINER_TEST_NAN_AT_STEP": "4"})
    assert res.returncode == 2, res.output[-3000:]
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if "error:" in line]
    assert len(errors) == 1, res.output[-3000:]
    assert "non-finite gradient norm nan at step 5: training diverged, the step was not applied" in errors[0]
    assert "the newest checkpoint is step 4" in errors[0]
    before = torch.load(run_dir / ".test-nan-before.pt", weights_only=False)
    after = torch.load(run_dir / ".test-nan-after.pt", weights_only=False)
    for name, value in before["params"].items():
        assert torch.equal(value, after["params"][name]), name
    for i, state in before["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after["optimizer"]["state"][i][key]), (i, key)
    from trainer.checkpoint import list_step_dirs

    assert max(int(p.name.split("_")[1]) for p in list_step_dirs(run_dir / "checkpoints")) == 4
    assert sorted(step_records(run_dir)) == [1, 2, 3, 4]  # the diverged step has no record


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_ordinary_steps_read_no_tensor_on_the_host(tmp_path):
    """50 steps with Tensor.item/tolist/cpu/__bool__/__float__/__int__ counted: none in any step (the late read
    of each step's flags is of host memory their non-blocking copy filled, trainer/step_flags.py); the start-up
    reads some (the agreement on a stop signal before the first step), which shows the counting works."""
    counts_file = tmp_path / "reads.json"
    res = run_trainer(tmp_path / "run", None, [*SMALL, "train.steps=50", "metrics.log_every=10",
                                               "checkpoint.every_steps=0"],
                      module=FAULTS, env={"TRAINER_TEST_COUNT_HOST_READS": str(counts_file)})
    assert res.returncode == 0, res.output[-3000:]
    counts = json.loads(counts_file.read_text())
    assert counts["start"] > 0
    steps = {int(k): v for k, v in counts["steps"].items()}
    assert sorted(steps) == list(range(49))  # written at step 49's first callback: steps 0 to 48, complete
    assert {s: n for s, n in steps.items() if n} == {}
