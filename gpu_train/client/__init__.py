"""The Python client of the platform: submit a job spec, follow it, pause, resume or cancel it, or run it on this
machine. `gpu-train` (gpu_train.cli) is built on it: the command parses arguments and prints, nothing more.

Usage:
    from gpu_train.client import Client, run_local
    job = Client(team="research").submit("job.yaml")        # -> Job: status(), logs(), pause(), resume(), cancel()
    run_local("job.yaml", nproc=2)                          # the spec under local torchrun; the launcher's exit code

Modules: api (Client, Job), jobs (spec reading, checks, rendering, create, pause/resume, cancel), status (list,
state, queue position, progress), logs (a rank's log from its pod or the log store), local (`run --local`),
cluster (the kubeconfig session, the contract, API errors as one line), errors (ClientError, and the quieting of
the kubernetes client's log records), gitrepo (a spec's git provenance).
It imports neither Pulumi nor torch, and each name in PUBLIC is imported when first used: importing
`gpu_train.client.errors` alone (what `gpu-train` does for every command) does not import the `kubernetes` client.
"""

from __future__ import annotations

import importlib
from typing import Any

PUBLIC = {"Client": "api", "Job": "api", "ClientError": "errors", "Submitted": "jobs", "read_spec": "jobs",
          "run_local": "local", "JobStatus": "status", "JobSummary": "status", "PodState": "status"}
__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_train.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gpu_train.client.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
