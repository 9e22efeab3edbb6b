"""The platform contract as a typed document: what the stack writes reads back as it was, and a document the
command cannot use is refused in one line per problem, naming the file and the key.

Run: .venv/bin/pytest tests/gpu_train/spec/test_contract.py -q
"""

from __future__ import annotations

import copy
import json

import pytest

from gpu_train.spec.contract import ContractError, PlatformContract
from tests.gpu_train.cli.conftest import contract_doc


def test_a_document_reads_back_as_it_was_written():
    doc = contract_doc()
    contract = PlatformContract.from_json(json.dumps(doc), "platform.json")
    assert contract.document() == doc
    assert contract.source == "platform.json"
    assert contract.pool("l4-spot").allocatable is not None and contract.team("research").namespace == "team-research"
    # The NCCL environment keeps its order in the document: a list, not an object.
    assert isinstance(doc["pools"][0]["fabric"]["ncclEnv"], list)


def test_logs_are_one_of_the_two_stores():
    contract = PlatformContract.from_document(contract_doc(), "p")
    assert contract.logs.kind == "cloudwatch" and contract.logs.groups["team-research"].endswith("team-research")
    gke = copy.deepcopy(contract_doc())
    gke["logs"] = {"kind": "cloud-logging", "project": "ml-prod", "cluster": "gpu-train-gcp-prod"}
    assert PlatformContract.from_document(gke, "p").logs.project == "ml-prod"


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(apiVersion="gpu-train.io/v2"), "p: apiVersion/kind are 'gpu-train.io/v2'/'PlatformContract'"),
    (lambda d: d.pop("pools"), "p: pools is required"),
    (lambda d: d["pools"][0].update(gpusPerNode="eight"), "p: pools[0].gpusPerNode"),
    (lambda d: d.update(logs={"kind": "papertrail"}), "p: logs"),
])
def test_a_document_the_command_cannot_use_names_the_key(edit, message):
    doc = copy.deepcopy(contract_doc())
    edit(doc)
    with pytest.raises(ContractError) as err:
        PlatformContract.from_document(doc, "p")
    assert message in str(err.value), str(err.value)
    assert "Traceback" not in str(err.value)


def test_a_missing_pool_or_team_lists_what_there_is():
    contract = PlatformContract.from_document(contract_doc(), "p")
    with pytest.raises(ContractError, match=r"pool 'h100' is not on this platform \(pools: l4-spot, l40s-spot\)"):
        contract.pool("h100")
    with pytest.raises(ContractError, match=r"team 'nlp' is not on this platform \(teams: research, platform\)"):
        contract.team("nlp")
