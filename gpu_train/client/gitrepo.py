"""Where a spec file stands in git: its path in the repository and the commit it is at, for the provenance
annotations `gpu-train submit` and `gpu-train apply` put on a JobSet (gpu_train.jobs.jobset.Provenance).

Usage: `provenance(Path("jobs/research/a.yaml"), applied=True)` -> Provenance(path="jobs/research/a.yaml",
commit="<40 hex>", applied=True). Runs the `git` command line; without git, or outside a repository, the path stays
as given and the commit is unknown.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpu_train.jobs.jobset import Provenance


def _git(cwd: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(path: Path, *, applied: bool = False, commit: str = "") -> Provenance:
    """The spec file's path relative to its git repository and the commit it is at; outside a repository the path
    as given and no commit, and no commit either when the file differs from that commit."""
    path = Path(path).resolve()
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if top is None:
        return Provenance(path=str(path), commit=commit, applied=applied)
    rel = str(path.relative_to(Path(top).resolve()))
    head = commit or _git(Path(top), "rev-parse", "HEAD") or ""
    dirty = _git(Path(top), "status", "--porcelain", "--", rel)
    return Provenance(path=rel, commit="" if dirty else head, applied=applied)
