"""`gpu-train platform`: the platform contract of a stack from its offline plan, for trying `lint`, `apply --dry-run`,
`submit --dry-run` and `sweep run --dry-run` without a cloud or a cluster.

Usage:
    gpu-train platform --stack aws-dev                         # runs the offline plan, writes platform.json
    gpu-train platform --stack-file my/Pulumi.my-dev.yaml -o my.json
    gpu-train platform --plan build/plan/aws-dev.json          # reads a plan already written (make plan)

The contract is the stack output `platform` (gpu_train.spec.contract), which a deployed stack publishes and
`pulumi stack output platform --json` prints. Without a deployment, the offline plan (`python -m infra.plan`:
the Pulumi program under Pulumi's mocks, docs/README "Plan offline") computes the same output. This command never
imports Pulumi: it runs the plan tool as a process of its own (the checkout with the infra extra), into a
temporary directory, or reads a plan document given with --plan; its last line says which it did. The plan's
account ids, cluster endpoint and certificate are the mocks' values, so the file is for the commands' offline
checks and dry runs, not for reaching a cluster.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpu_train.client.errors import ClientError
from gpu_train.spec.install import install_hint


def add_parser(sub: Any) -> None:
    p = sub.add_parser("platform", help="write a stack's platform contract from its offline plan (no cloud needed)",
                       description="Write the platform contract (the stack output `platform`) computed by the "
                                   "offline plan, for lint, apply --dry-run, submit --dry-run and sweep run "
                                   "--dry-run without a cloud. Its cluster endpoint and account ids are the plan's "
                                   "mocks.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--stack", help="a stack of stacks/ (stacks/Pulumi.<stack>.yaml): runs python -m infra.plan")
    which.add_argument("--stack-file", help="any stack settings file named Pulumi.<stack>.yaml: runs the plan on it")
    which.add_argument("--plan", metavar="FILE", help="a plan already written by python -m infra.plan "
                                                      "(build/plan/<stack>.json): read, nothing run")
    p.add_argument("--output", "-o", default="platform.json", help="where to write it (default ./platform.json)")


def _run_plan(args: Any) -> tuple[dict[str, Any], str]:
    """The plan document from `python -m infra.plan` run now, and what was run."""
    if importlib.util.find_spec("infra") is None or importlib.util.find_spec("pulumi") is None:
        raise ClientError("the offline plan runs the Pulumi program and needs it: "
                          f"{install_hint('infra')}; or pass --plan FILE, a plan written by python -m infra.plan")
    which = ["--stack", args.stack] if args.stack else ["--stack-file", str(Path(args.stack_file).resolve())]
    shown = f"python -m infra.plan {' '.join(which)}"
    print(f"gpu-train: running the offline plan ({shown}: the Pulumi program under mocks, no cloud)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-train-plan-") as out:
        proc = subprocess.run([sys.executable, "-m", "infra.plan", *which, "--out", out, "--quiet"],
                              capture_output=True, text=True)
        if proc.returncode != 0:  # the plan tool's own lines name the stack file and every bad key
            lines = [line.removeprefix("error: ") for line in proc.stderr.strip().splitlines()][-20:]
            raise ClientError("\n".join([f"the offline plan failed ({shown}, exit {proc.returncode}):", *lines]),
                              code=2 if proc.returncode == 2 else 1)
        written = Path(proc.stdout.strip().splitlines()[-1])
        return json.loads(written.read_text()), f"ran the offline plan ({shown})"


def _read_plan(path_text: str) -> tuple[dict[str, Any], str]:
    path = Path(path_text).expanduser()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ClientError(f"--plan {path_text}: no such file (python -m infra.plan --stack <stack> writes "
                          "build/plan/<stack>.json)") from None
    except (OSError, ValueError) as exc:
        raise ClientError(f"--plan {path_text}: not a plan document: {exc}") from None
    when = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return doc, f"read the existing plan {path} (written {when}; nothing was run)"


def platform(args: Any) -> int:
    from gpu_train.spec.contract import ContractError, PlatformContract

    doc, how = _read_plan(args.plan) if args.plan else _run_plan(args)
    source = args.plan or args.stack or args.stack_file
    contract = (doc.get("outputs") or {}).get("platform") if isinstance(doc, dict) else None
    if not isinstance(contract, dict):
        raise ClientError(f"{source}: the plan has no `platform` output (not a plan of this project's program?)")
    try:
        PlatformContract.from_document(contract, f"{source}: outputs.platform")
    except ContractError as exc:
        raise ClientError(str(exc)) from None
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(contract, indent=2, sort_keys=True) + "\n")
    print(f"gpu-train: {how}; wrote the platform contract of stack {doc.get('stack', '?')!r} to {out} (its cluster "
          "endpoint and account ids are the plan's mocks: for --platform with lint, apply --dry-run, submit "
          "--dry-run and sweep run --dry-run)", file=sys.stderr)
    return 0
