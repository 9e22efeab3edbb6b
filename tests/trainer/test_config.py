"""Config presets, YAML files and overrides: unknown keys and wrong types are rejected naming the key.

Run: .venv/bin/pytest tests/trainer/test_config.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gpu_train.sizing.layout import batch_layout
from gpu_train.spec.trainer_config import PRESETS, ConfigError, build_config, flatten, to_dict
from tests.trainer.launch import ROOT, child_env
from trainer.model import GPT


def test_overrides_are_typed():
    cfg = build_config("tiny", overrides=["train.steps=7", "train.lr=1e-3", "train.compile=false",
                                          "model.norm=rmsnorm", "checkpoint.remote_uri=s3://b/p"])
    assert (cfg.train.steps, cfg.train.lr, cfg.train.compile) == (7, 1e-3, False)
    assert cfg.model.norm == "rmsnorm" and cfg.checkpoint.remote_uri == "s3://b/p"


@pytest.mark.parametrize(("override", "needle"), [
    ("train.stepz=3", "train.stepz: unknown key"),
    ("optim.lr=3", "optim.lr: unknown section"),
    ("steps=3", "steps: keys are section.name"),
    ("train.steps=ten", "train.steps: expected an integer"),
    ("train.steps=1.5", "train.steps: expected an integer"),
    ("train.lr=fast", "train.lr: expected a number"),
    ("train.compile=maybe", "train.compile: expected true or false"),
    ("train.parallel=tp", "train.parallel: must be one of ddp, fsdp"),
    ("model.norm=batchnorm", "model.norm: must be one of layernorm, rmsnorm"),
    ("train.steps", "expected section.key=value"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=None) as err:
        build_config("tiny", overrides=[override])
    assert needle in str(err.value)


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 11\n  lr: 0.002\nmodel:\n  pos: rope\n")
    cfg = build_config("tiny", f, ["train.steps=12"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.pos) == (12, 0.002, "rope")
    f.write_text("train:\n  steps: eleven\n")
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        build_config("tiny", f)
    f.write_text("train:\n  nope: 1\n")
    with pytest.raises(ConfigError, match="train.nope: unknown key"):
        build_config("tiny", f)


def test_cross_key_checks_name_both_keys():
    with pytest.raises(ConfigError, match=r"model.d_model \(64\) must be divisible by model.n_head \(5\)"):
        build_config("tiny", overrides=["model.n_head=5"])
    with pytest.raises(ConfigError, match="train.global_batch_tokens .* model.context"):
        build_config("tiny", overrides=["train.global_batch_tokens=100"])
    with pytest.raises(ConfigError, match="train.min_lr"):
        build_config("tiny", overrides=["train.min_lr=1.0"])


def test_batch_layout_keeps_global_batch_and_names_keys_when_not_divisible():
    cfg = build_config("tiny", overrides=["train.global_batch_tokens=1536", "model.context=64",
                                          "train.micro_batch_size=4"])
    assert batch_layout(cfg, 1) == (24, 6)
    assert batch_layout(cfg, 2) == (24, 3)
    assert batch_layout(cfg, 3) == (24, 2)
    with pytest.raises(ConfigError) as err:
        batch_layout(cfg, 4)
    msg = str(err.value)
    assert "train.global_batch_tokens" in msg and "train.micro_batch_size" in msg and "world size (4)" in msg


def test_resolved_config_round_trips(tmp_path):
    """The resolved config a run writes (config.json, and in every checkpoint) rebuilds the same config when
    handed back as --config, whatever preset it is laid over."""
    cfg = build_config("1b", overrides=["train.steps=5"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_dict(cfg)))
    assert build_config("tiny", path) == cfg
    assert flatten(cfg)["model.d_model"] == 2048


@pytest.mark.parametrize(("preset", "low", "high"), [
    ("gpt2-124m", 123e6, 126e6),
    ("gpt2-350m", 350e6, 360e6),
    ("1b", 1.0e9, 1.2e9),
    # 32 blocks x 12 x 2560^2 = 2.517e9, token embeddings 50304 x 2560 = 0.129e9, positions 2048 x 2560 = 0.005e9
    ("gpt2-2.7b", 2.64e9, 2.66e9),
    ("7b", 6.3e9, 7.0e9),
])
def test_preset_parameter_counts(preset, low, high):
    cfg = build_config(preset)
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(cfg.model)
    n = model.num_params(non_embedding=False)
    assert low <= n <= high, f"{preset}: {n / 1e6:.1f}M parameters"
    assert cfg.model.vocab_size == 50304


def test_every_preset_is_valid_and_seven_b_uses_fsdp():
    for name in PRESETS:
        build_config(name)
    assert build_config("7b").train.parallel == "fsdp"


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_cli_rejects_unknown_key_and_wrong_type_with_exit_code_2():
    for bad, needle in (("train.bogus=1", "train.bogus: unknown key"),
                        ("train.steps=x", "train.steps: expected an integer")):
        proc = subprocess.run([sys.executable, "-m", "trainer", bad], cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert needle in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "checkpoint.every_steps" in proc.stdout and "--preset" in proc.stdout


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_vocab_smaller_than_dataset_is_a_config_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--run-dir", str(tmp_path / "run"), "model.vocab_size=100",
         "train.steps=1", "tracking.enabled=false"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "model.vocab_size (100) is smaller than the vocabulary of dataset synthetic (257" in proc.stderr
