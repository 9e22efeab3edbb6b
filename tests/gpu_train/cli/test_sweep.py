"""`gpu-train sweep`: the cluster path renders trials through the one renderer into the team's LocalQueue with the
sweep priority class, reading the platform contract from the fake API server and creating nothing; spec errors are
named with their field; status and replay read the journal.

Run: .venv/bin/pytest tests/gpu_train/cli/test_sweep.py -q
"""

from __future__ import annotations

import yaml

from gpu_train.jobs.jobset import PRIORITY_LABEL, QUEUE_LABEL
from gpu_train.spec import naming
from tests.gpu_train.cli.conftest import ALICE, only_error_lines

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


def test_dry_run_renders_the_first_trials_in_the_team_queue_with_the_sweep_priority(api, tmp_path, cli):
    kubeconfig = api.kubeconfig(tmp_path, ALICE, "team-research")
    code, out, err = cli("sweep", "run", sweep_file(tmp_path), "--dry-run", "--kubeconfig", kubeconfig)
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in docs] == ["lr-sweep-t000", "lr-sweep-t001", "lr-sweep-t002"]
    for d in docs:
        assert d["kind"] == "JobSet" and d["metadata"]["namespace"] == "team-research"
        assert d["metadata"]["labels"][QUEUE_LABEL] == naming.local_queue_name("research")
        assert d["metadata"]["labels"][PRIORITY_LABEL] == naming.priority_class_name("sweep")
        text = yaml.safe_dump(d)
        budget = f"s3://gpu-train-aws-dev-checkpoints/research/lr-sweep/{d['metadata']['name']}/budget.json"
        assert f"train.budget_uri={budget}" in text
        assert "train.steps=200" in text
    lrs = {next(a for a in yaml.safe_dump(d).split() if a.startswith("train.lr=")) for d in docs}
    assert len(lrs) == 3  # three different suggestions
    assert [r[0] for r in api.requests] == ["GET"]  # the contract, read; nothing created
    assert "queue " + naming.local_queue_name("research") in err


def test_a_search_bound_the_cluster_would_refuse_is_named(api, tmp_path, cli):
    kubeconfig = api.kubeconfig(tmp_path, ALICE, "team-research")
    space = {"train.micro_batch_size": {"distribution": "choice", "values": [8, 7]}}
    code, out, err = cli("sweep", "run", sweep_file(tmp_path, searchSpace=space), "--dry-run",
                         "--kubeconfig", kubeconfig)
    assert code != 0 and out == ""
    assert "train.micro_batch_size=7" in err and only_error_lines(err)


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
