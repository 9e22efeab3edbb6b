"""The Python client of the platform: submit a job spec, follow it, pause, resume or cancel it, or run it on this
machine. `gpu-train` (gpu_train.cli) is built on it: the command parses arguments and prints, nothing more.

Usage:
    from gpu_train.client import Client, run_local
    job = Client(team="research").submit("job.yaml")        # -> Job: status(), logs(), pause(), resume(), cancel()
    run_local("job.yaml", nproc=2)                          # the spec under local torchrun; the launcher's exit code

Modules: api (Client, Job), jobs (spec reading, checks, rendering, create, pause/resume, cancel), status (list,
state, queue position, progress), logs (a rank's log from its pod or the log store), local (`run --local`),
cluster (the kubeconfig session, the contract, API errors as one line), gitrepo (a spec's git provenance).
It imports neither Pulumi nor torch.
"""

from gpu_train.client.api import Client, Job
from gpu_train.client.cluster import ClientError
from gpu_train.client.jobs import Submitted, read_spec
from gpu_train.client.local import run_local
from gpu_train.client.status import JobStatus, JobSummary, PodState

__all__ = ["Client", "ClientError", "Job", "JobStatus", "JobSummary", "PodState", "Submitted", "read_spec",
           "run_local"]
