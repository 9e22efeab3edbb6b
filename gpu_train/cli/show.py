"""What `gpu-train` prints for the client's answers (gpu_train.client): the command's only own logic.

Usage: `return show.job_status(client.status("gpt2-smoke"))` in gpu_train/cli/main.py; each function writes to
stdout (a dry run's JobSet alone, so that it pipes into `kubectl apply -f -`; its estimate to stderr) and returns
the exit status.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import yaml

from gpu_train.client.api import Job
from gpu_train.client.status import JobStatus, JobSummary


def submitted(job: Job, out=None) -> int:
    out = out or sys.stdout
    done = job.submitted
    assert done is not None  # Client.submit always returns what it rendered
    for note in done.notes:
        sys.stderr.write(f"gpu-train: note: {note}\n")
    if not done.created:
        out.write(yaml.safe_dump(dict(done.manifest), sort_keys=False))
        sys.stderr.write(f"{done.estimate}\n{done.memory}\n")  # stdout stays the JobSet alone
        return 0
    spec = done.job
    out.write(f"submitted job {spec.name!r} to {done.namespace}, queue {done.queue} (pool {spec.pool}, nodes "
              f"{spec.nodes})\n"
              f"  {done.estimate}\n"
              f"  {done.memory}\n"
              f"  gpu-train status {spec.name}     queue position, step, loss, tokens/s, ETA\n"
              f"  gpu-train logs {spec.name} -f    rank 0's log, live\n")
    return 0


def job_list(rows: list[JobSummary], team: str, out=None) -> int:
    out = out or sys.stdout
    if not rows:
        from gpu_train.spec.naming import team_namespace

        out.write(f"no jobs in {team_namespace(team)}\n")
        return 0
    table = [("NAME", "KIND", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH", "HASH")]
    table += [(r.name, r.kind, r.state, r.nodes, r.pool, r.age, r.commit, r.path, r.hash) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")
    return 0


def job_status(st: JobStatus, out=None) -> int:
    out = out or sys.stdout
    what = "data preparation" if st.kind == "prepare" else "job"
    out.write(f"{what} {st.name} in {st.namespace}: {st.state}\n")
    for note in st.notes:
        out.write(f"  {note}\n")
    for p in st.pods:
        out.write(f"  rank {p.rank}  {p.name}  {p.phase}  node {p.node}  restarts {p.restarts}\n")
    if st.progress:
        out.write(f"  {st.progress}\n")
    return 0


def paused(name: str, queue: str, out=None) -> int:
    (out or sys.stdout).write(f"paused job {name!r}: Kueue evicts it, its pods checkpoint and stop, its quota is "
                              f"released (`gpu-train resume {name}` queues it again)\n")
    return 0


def resumed(name: str, queue: str, out=None) -> int:
    (out or sys.stdout).write(f"resumed job {name!r}: it queues again in {queue} and continues from its newest "
                              "checkpoint\n")
    return 0


def cancelled(name: str, out=None) -> int:
    (out or sys.stdout).write(f"cancelled job {name!r}: its pods stop (SIGTERM, then a final checkpoint) and Kueue "
                              "releases its quota; its checkpoints stay in the bucket\n")
    return 0


def text(chunks: Iterable[str], out=None) -> int:
    out = out or sys.stdout
    for chunk in chunks:
        out.write(chunk)
        out.flush()
    return 0
