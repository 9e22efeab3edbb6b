"""`gpu-train sweep`: spec errors are named with their field; status reads the journal; the embedded default sweep
is the example. (The cluster path, rendering trials from the cluster's contract, is tests/cluster/test_sweeps.py.)

Run: .venv/bin/pytest tests/gpu_train/cli/test_sweep.py -q
"""

from __future__ import annotations

import yaml

SWEEP = {
    "name": "lr-sweep",
    "trialTemplate": {"name": "lr-sweep", "team": "research", "pool": "l4-spot", "preset": "gpt2-124m",
                      "nodes": "1:2", "gpusPerNode": 1, "steps": 200, "globalBatchTokens": 65536,
                      "checkpointEvery": 50, "maxRestarts": 5, "overrides": {"train.micro_batch_size": 8}},
    "searchSpace": {"train.lr": {"distribution": "logUniform", "min": 1e-4, "max": 1e-2}},
    "algorithm": {"name": "random", "seed": 1, "earlyStopping": {"name": "asha", "minTokens": 655360}},
    "trialConfig": {"numTrials": 6, "parallelTrials": 3},
}


def sweep_file(tmp_path, **over):
    doc = {**SWEEP, **over}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_spec_error_names_the_file_and_field(tmp_path, cli):
    bad = sweep_file(tmp_path, trialConfig={"numTrials": 6, "parallelTrials": 9})
    code, _, err = cli("sweep", "run", bad, "--dry-run", "--platform", tmp_path / "none.json")
    assert code != 0
    assert f"{bad}: trialConfig.parallelTrials 9 is more than numTrials 6" in err


def test_status_without_a_journal_says_how_to_start(tmp_path, cli):
    code, _, err = cli("sweep", "status", sweep_file(tmp_path), "--runs", tmp_path / "runs")
    assert code != 0 and "has no journal" in err and "gpu-train sweep run" in err


def test_the_embedded_default_sweep_is_the_example():
    from pathlib import Path

    from gpu_train.cli.sweep import DEFAULT_SWEEP

    example = Path(__file__).resolve().parents[3] / "examples" / "sweep-tiny.yaml"
    assert yaml.safe_load(example.read_text()) == DEFAULT_SWEEP


def test_without_a_spec_status_reads_the_default_sweeps_journal(tmp_path, cli):
    code, _, err = cli("sweep", "status", "--runs", tmp_path)
    assert code != 0 and f"sweep 'sweep-tiny' has no journal in {tmp_path / 'sweep-tiny'}" in err


def test_a_cluster_sweep_needs_a_spec(tmp_path, cli):
    code, _, err = cli("sweep", "run", "--platform", tmp_path / "p.json")
    assert code != 0 and "a sweep on the cluster needs a spec file" in err
