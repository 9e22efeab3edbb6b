"""`gpu-train logs`' Cloud Logging filter, without a cluster. Logs read from a cluster (a rank's pod, then the log
store once the pod is gone: CloudWatch Logs on a local moto server, Cloud Logging from recorded answers) are
tested against the real control plane: tests/cluster/test_status_logs.py.

Run: .venv/bin/pytest tests/gpu_train/cli/test_logs.py -q
"""

from __future__ import annotations

import re

from gpu_train.client import logs as cli_logs
from gpu_train.spec import naming


def test_the_cloud_logging_pod_pattern_selects_only_that_rank():
    flt = cli_logs.cloud_logging_filter("c", naming.team_namespace("r"), "trainer", "llm", 1, "2026-01-01T00:00:00Z")
    pattern = re.search(r'pod_name=~"([^"]+)"', flt).group(1)
    assert re.fullmatch(pattern, "llm-worker-0-1-q8z2c")
    assert not re.fullmatch(pattern, "llm-worker-0-12-q8z2c") and not re.fullmatch(pattern, "llm2-worker-0-1-q8z2c")
