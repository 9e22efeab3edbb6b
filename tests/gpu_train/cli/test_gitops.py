"""`gpu-train lint`: a folder of job specs checked as `submit` checks one, every problem naming its file and field,
and the examples' jobs folder passing. `gpu-train apply` on a cluster is tests/cluster/test_gitops.py.

Run: .venv/bin/pytest tests/gpu_train/cli/test_gitops.py -q
"""

from __future__ import annotations

import yaml

from tests.gpu_train.cli.conftest import only_error_lines

SPEC = {"name": "gpt2-smoke", "team": "research", "pool": "l4-spot", "preset": "gpt2-124m", "nodes": "1:2",
        "gpusPerNode": 1, "steps": 200, "globalBatchTokens": 65536, "checkpointEvery": 50,
        "overrides": {"train.micro_batch_size": 8}}


def test_lint_names_file_and_field(tmp_path, cli, doc):
    import json

    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    jobs = tmp_path / "jobs" / "research"
    jobs.mkdir(parents=True)
    (jobs / "good.yaml").write_text(yaml.safe_dump({**SPEC, "name": "good"}))
    code, out, err = cli("lint", tmp_path / "jobs", "--platform", platform)
    assert code == 0, err
    assert "ok  " in out and "1 job spec passes every check" in out
    assert "carbon: ~" in out
    (jobs / "wrong-name.yaml").write_text(yaml.safe_dump({**SPEC, "name": "other"}))
    (jobs / "bad-steps.yaml").write_text(yaml.safe_dump({**SPEC, "name": "bad-steps", "steps": 0}))
    (jobs / "good.yml").write_text(yaml.safe_dump({**SPEC, "name": "good"}))
    (tmp_path / "jobs" / "platform").mkdir()
    (tmp_path / "jobs" / "platform" / "misfiled.yaml").write_text(yaml.safe_dump({**SPEC, "name": "misfiled"}))
    code, _, err = cli("lint", tmp_path / "jobs", "--platform", platform)
    assert code == 2 and only_error_lines(err)
    assert f"{jobs}/wrong-name.yaml: job.name 'other' does not match the file name 'wrong-name'" in err
    assert f"{jobs}/bad-steps.yaml: job.steps must be >= 1 (got 0)" in err
    assert f"{jobs}/good.yml: job 'good' of team 'research' is also defined in {jobs}/good.yaml" in err
    assert "misfiled.yaml: job.team 'research' does not match its folder 'platform'" in err


def test_the_example_jobs_folder_passes_lint(tmp_path, cli, doc):
    import json

    from tests.gpu_train.cli.conftest import ROOT

    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))  # the aws-dev example stack's pools and teams
    code, out, err = cli("lint", ROOT / "examples" / "jobs", "--platform", platform)
    assert code == 0, err
    assert "2 job specs pass every check" in out and out.count("carbon: ~") == 2
