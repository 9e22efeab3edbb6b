"""The YAML reader of the files users write refuses a key given twice, naming it and both lines, wherever such a
file is read: job specs, sweep specs, service specs and trainer config files (stack files: tests/infra/test_plan.py).

Run: .venv/bin/pytest tests/gpu_train/spec/test_yamlfile.py -q
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpu_train.cli.service_spec import build_spec
from gpu_train.client.errors import ClientError
from gpu_train.spec import yamlfile
from gpu_train.spec.errors import ConfigError, SettingsError
from gpu_train.spec.job import read_job_file
from gpu_train.spec.sweep import load_sweep
from gpu_train.spec.trainer_config import load_yaml

ROOT = Path(__file__).resolve().parents[3]


def test_a_key_given_twice_is_refused_with_the_key_and_both_lines():
    with pytest.raises(yamlfile.DuplicateKeyError) as err:
        yamlfile.load("a: 1\nb:\n  c: 2\n  d: 3\n  c: 4\n")
    assert str(err.value) == "key 'c' is given twice in one mapping, on lines 3 and 5 (keep one)"
    with pytest.raises(yamlfile.DuplicateKeyError, match="key 'a' is given twice in one mapping, on line 1 "):
        yamlfile.load("{a: 1, a: 2}")


def test_unique_keys_and_merges_read_as_yaml_safe_load_reads_them():
    text = "base: &b {x: 1, y: 2}\nderived:\n  <<: *b\n  y: 3\nlist: [1, {x: 1}, {x: 1}]\n"
    assert yamlfile.load(text) == {"base": {"x": 1, "y": 2}, "derived": {"x": 1, "y": 3},
                                   "list": [1, {"x": 1}, {"x": 1}]}


def twice(text: str, key: str, value: str) -> tuple[str, int, int]:
    """The text with `key: ...`'s line given again right after it; (text, its line, the copy's line)."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines.insert(i + 1, f"{indent}{key}: {value}")
    return "\n".join(lines) + "\n", i + 1, i + 2


def test_job_sweep_service_and_trainer_files_with_a_key_twice_are_refused(tmp_path):
    job, first, second = twice((ROOT / "examples" / "tiny.yaml").read_text(), "steps", "5")
    (tmp_path / "job.yaml").write_text(job)
    with pytest.raises(SettingsError, match=f"key 'steps' is given twice in one mapping, on lines {first} and {second}"):
        read_job_file(tmp_path / "job.yaml")
    sweep, first, second = twice((ROOT / "examples" / "sweep-tiny.yaml").read_text(), "seed", "8")
    (tmp_path / "sweep.yaml").write_text(sweep)
    with pytest.raises(SettingsError, match=f"key 'seed' is given twice in one mapping, on lines {first} and {second}"):
        load_sweep(tmp_path / "sweep.yaml")
    (tmp_path / "service.yaml").write_text("name: chat\nteam: research\nname: chat2\n")
    with pytest.raises(ClientError, match="key 'name' is given twice in one mapping, on lines 1 and 3"):
        build_spec(argparse.Namespace(), spec_file=str(tmp_path / "service.yaml"), name="", team="", model="")
    (tmp_path / "trainer.yaml").write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="key 'lr' is given twice in one mapping, on lines 2 and 3"):
        load_yaml(tmp_path / "trainer.yaml")
