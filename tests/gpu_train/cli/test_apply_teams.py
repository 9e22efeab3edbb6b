"""`gpu-train apply --team NAME` with a name that is no team says so and names the teams, before anything else.

Run: .venv/bin/pytest tests/gpu_train/cli/test_apply_teams.py -q
"""

from __future__ import annotations

import json

import pytest

from gpu_train.cli import gitops
from gpu_train.client.errors import ClientError
from tests.gpu_train.cli.conftest import only_error_lines


def _jobs(tmp_path):
    for team in ("research", "platform"):
        (tmp_path / "jobs" / team).mkdir(parents=True)
        (tmp_path / "jobs" / team / "a.yaml").write_text(f"name: a\nteam: {team}\n")
    return tmp_path / "jobs"


def test_a_misspelled_team_is_named_with_the_platforms_teams(tmp_path, cli, doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    code, out, err = cli("apply", _jobs(tmp_path), "--team", "reserach", "--platform", platform, "--dry-run")
    teams = ", ".join(t["name"] for t in doc["teams"])
    assert code == 2 and only_error_lines(err) and out == ""
    assert err.strip() == f"gpu-train: error: --team 'reserach' is not a team of this platform (teams: {teams})"
    assert "no job specs" not in err


def test_without_a_readable_contract_the_team_folders_are_the_known_teams(tmp_path):
    def unreadable(team: str):
        raise ClientError(f"no platform contract in namespace team-{team}")

    jobs = _jobs(tmp_path)
    with pytest.raises(ClientError) as err:
        gitops.apply(None, str(jobs), teams=["reserach"], contracts=unreadable, prune=False, dry_run=True,
                     replace_running=False)
    assert str(err.value) == f"--team 'reserach' is not a team of {jobs}'s team folders (teams: platform, research)"
