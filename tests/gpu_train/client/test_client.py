"""The Python client (gpu_train.client) with no cluster: a dry run from a contract file. Against a cluster (submit,
status, wait, pause, resume, cancel) it is tests/cluster/test_client.py; how it words an API server's refusals,
test_cluster.py.

Run: .venv/bin/pytest tests/gpu_train/client -q
"""

from __future__ import annotations

import json

from gpu_train.client import Client
from tests.gpu_train.cli.conftest import IMAGE, spec


def test_a_dry_run_with_a_contract_file_needs_no_cluster(tmp_path, doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    job = Client(platform=platform).submit(spec(tmp_path), dry_run=True)
    assert not job.submitted.created and job.manifest["kind"] == "JobSet"
    assert job.manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == IMAGE
    assert job.submitted.estimate.startswith("carbon: ~")
