"""The teams whose jobs the jobs workflow applies, and the target stack's cloud and region, as GitHub outputs.

Usage (.github/workflows/jobs.yml): `python tools/jobs_matrix.py jobs --stack aws-prod` prints
`teams=<json list>`, `cloud=aws|gcp` and `region=<region>` for `$GITHUB_OUTPUT`; a missing stack file or a jobs
folder without team folders exits 2 naming it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROJECT = "gpu-train"
ROOT = Path(__file__).resolve().parent.parent


class JobsMatrixError(ValueError):
    """The workflow cannot apply these jobs; the message names the file or folder."""


def jobs_matrix(jobs_dir: Path, stack: str, stack_dir: Path = ROOT / "stacks") -> dict[str, object]:
    import yaml

    if not stack:
        raise JobsMatrixError("no target stack: set the repository variable GPU_TRAIN_JOBS_STACK")
    path = stack_dir / f"Pulumi.{stack}.yaml"
    if not path.is_file():
        raise JobsMatrixError(f"{path}: no such stack file (GPU_TRAIN_JOBS_STACK={stack})")
    raw = (yaml.safe_load(path.read_text()) or {}).get("config") or {}
    cloud, region = raw.get(f"{PROJECT}:cloud"), raw.get(f"{PROJECT}:region")
    if cloud not in ("aws", "gcp") or not isinstance(region, str):
        raise JobsMatrixError(f"{path}: needs {PROJECT}:cloud aws|gcp and {PROJECT}:region")
    if not jobs_dir.is_dir():
        raise JobsMatrixError(f"{jobs_dir}: no such folder (jobs/<team>/<name>.yaml)")
    teams = sorted(p.name for p in jobs_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    return {"teams": teams, "cloud": cloud, "region": region}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tools/jobs_matrix.py", description=__doc__.splitlines()[0])
    parser.add_argument("jobs_dir", type=Path)
    parser.add_argument("--stack", default="")
    args = parser.parse_args(argv)
    try:
        found = jobs_matrix(args.jobs_dir, args.stack)
    except JobsMatrixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"teams={json.dumps(found['teams'])}")
    print(f"cloud={found['cloud']}")
    print(f"region={found['region']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
