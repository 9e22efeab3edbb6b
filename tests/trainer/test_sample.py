"""Sampling: the decoding rules on a small model, and ``python -m trainer.sample`` on a real run directory.

Run: .venv/bin/pytest tests/trainer/test_sample.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_train.spec.trainer_config import ModelConfig
from trainer.model import GPT
from trainer.sample import generate
from trainer.sample import main as sample_main

REPO = Path(__file__).resolve().parents[2]
CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, context=16, vocab_size=264)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


def test_greedy_is_the_argmax_chain_over_the_last_context_tokens(model):
    prompt = [5, 17, 200, 3]
    got = generate(model, prompt, max_tokens=30, temperature=0)
    # Reference: call the model by hand, one step at a time, cropping to model.context.
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(30):
            logits, _ = model(torch.tensor([ids[-CFG.context :]]))
            want.append(int(logits[0, -1].argmax()))
            ids.append(want[-1])
    assert got == want and len(got) == 30  # 34 > context: the window slid


def test_sampling_is_seeded_and_top_1_is_greedy(model):
    def run(seed, **kw):
        return generate(model, [1, 2, 3], max_tokens=12, generator=torch.Generator().manual_seed(seed), **kw)

    assert run(0, temperature=1.0) == run(0, temperature=1.0)
    assert run(0, temperature=1.0) != run(1, temperature=1.0)
    assert run(0, temperature=1.0, top_k=1) == generate(model, [1, 2, 3], max_tokens=12, temperature=0)


class _Fixed(torch.nn.Module):
    """A 'model' whose next-token logits prefer id 260, then 10, then 11."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = CFG

    def forward(self, idx: torch.Tensor):
        logits = torch.full((1, idx.shape[1], CFG.vocab_size), -10.0)
        logits[..., 260], logits[..., 10], logits[..., 11] = 5.0, 4.0, 3.9
        return logits, None


def test_ids_beyond_the_tokenizer_are_never_sampled_and_eot_stops():
    m = _Fixed()
    assert generate(m, [0], max_tokens=3, temperature=0) == [260, 260, 260]
    assert generate(m, [0], max_tokens=3, temperature=0, vocab_limit=257) == [10, 10, 10]
    g = torch.Generator().manual_seed(0)
    drawn = generate(
        m, [0], max_tokens=200, temperature=1.0, top_k=2, vocab_limit=257, generator=g, stop_id=None
    )
    assert set(drawn) == {10, 11}  # top-2 inside the tokenizer's vocabulary
    assert generate(m, [0], max_tokens=50, temperature=0, vocab_limit=257, stop_id=10) == [10]
    with pytest.raises(ValueError, match="at least one token"):
        generate(m, [], max_tokens=1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sample") / "run"
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run), "train.steps=2",
         "checkpoint.every_steps=1", "tracking.enabled=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return run


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_cli_samples_from_the_newest_checkpoint_of_a_run(run_dir, capsys):
    args = [
        "--run-dir",
        str(run_dir),
        "--prompt",
        "the ",
        "--max-tokens",
        "16",
        "--num-samples",
        "2",
        "--no-stop",
    ]
    assert sample_main(args) == 0
    out, err = capsys.readouterr()
    assert "step_000000002" in err  # the newest of the two checkpoints
    samples = out.split("-" * 40 + "\n")
    assert len(samples) == 2 and all(s.startswith("the ") for s in samples)
    assert samples[0] != samples[1]  # two draws from one seeded generator
    assert sample_main(args) == 0
    assert capsys.readouterr().out == out  # the same seed gives the same text


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_cli_errors_are_one_line(run_dir, tmp_path, capsys):
    assert sample_main(["--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/checkpoints: no complete checkpoint" in err and len(err.strip().splitlines()) == 1
    assert sample_main(["--checkpoint", str(tmp_path / "step_000000001")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sample_main(["--run-dir", str(run_dir), "--temperature", "-1"])
