"""The stacks the deploy workflow deploys: every stack file that sets `gpu-train:deploy: true`, as GitHub outputs.

Usage (.github/workflows/deploy.yml): `python tools/deploy_matrix.py [stacks]` prints
`nonprod=<json>`, `prod=<json>`, `all=<json>` and `aws=<true|false>` for `$GITHUB_OUTPUT`; a file it cannot use
exits 2 naming it. The other stack files are examples: planned and tested, never deployed.
"""

from __future__ import annotations

import json
from pathlib import Path

PROJECT = "gpu-train"


class DeployMatrixError(ValueError):
    """A stack file marked for deployment that the workflows cannot deploy; the message names it."""


def deploy_matrix(stack_dir: Path) -> dict[str, list[dict[str, str]]]:
    """The stacks the workflows deploy: every `Pulumi.<stack>.yaml` in `stack_dir` that sets
    `gpu-train:deploy: true`, as GitHub Actions matrix entries ({"stack", "cloud", "region"}) split into
    {"nonprod", "prod"}. The other files are examples: planned and tested, never deployed."""
    import yaml

    out: dict[str, list[dict[str, str]]] = {"nonprod": [], "prod": []}
    for path in sorted(stack_dir.glob("Pulumi.*.yaml")):
        stack = path.name[len("Pulumi."):-len(".yaml")]
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise DeployMatrixError(f"{path}: not valid YAML: {exc}") from None
        raw = doc.get("config") if isinstance(doc, dict) else None
        if not isinstance(raw, dict) or raw.get(f"{PROJECT}:deploy") is not True:
            continue
        cloud, environment = raw.get(f"{PROJECT}:cloud"), raw.get(f"{PROJECT}:environment")
        region = raw.get(f"{PROJECT}:region")
        if cloud not in ("aws", "gcp") or environment not in ("dev", "staging", "prod") or not isinstance(region, str):
            raise DeployMatrixError(f"{path}: a stack marked deploy: true needs {PROJECT}:cloud aws|gcp, "
                               f"{PROJECT}:environment dev|staging|prod and {PROJECT}:region "
                               f"(got {cloud!r}, {environment!r}, {region!r})")
        runner = raw.get(f"{PROJECT}:deployRunner")
        if cloud == "aws" and not (isinstance(runner, dict) and runner.get("kind") == "codebuild"):
            raise DeployMatrixError(f"{path}: an AWS stack marked deploy: true needs {PROJECT}:deployRunner.kind "
                               "codebuild (the runner inside its VPC that the workflows run on)")
        out["prod" if environment == "prod" else "nonprod"].append({"stack": stack, "cloud": cloud, "region": region})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="tools/deploy_matrix.py")
    parser.description = ("print the stacks marked deploy: true as GitHub outputs (nonprod=<json>, prod=<json>, "
                          "all=<json>, aws=<true|false>)")
    parser.add_argument("stack_dir", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "stacks")
    args = parser.parse_args(argv)
    try:
        found = deploy_matrix(args.stack_dir)
    except DeployMatrixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"nonprod={json.dumps(found['nonprod'])}")
    print(f"prod={json.dumps(found['prod'])}")
    print(f"all={json.dumps(found['nonprod'] + found['prod'])}")
    uses_aws = any(e["cloud"] == "aws" for e in found["nonprod"] + found["prod"])
    print(f"aws={'true' if uses_aws else 'false'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
