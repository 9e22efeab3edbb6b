"""Offline plan: run the real Pulumi program under mocks, with no CLI and no cloud.

Usage:
    python -m infra.plan --stack aws-dev                 # reads stacks/Pulumi.aws-dev.yaml
    python -m infra.plan --stack-file path/Pulumi.x.yaml # check any settings file before committing it
    python -m infra.plan --stack gcp-prod --out build/plan --quiet

Writes `OUT/<stack>.json`:
    {"project", "stack", "resources": [{"urn", "type", "name", "parent", "inputs"}], "outputs": {...},
     "registrations": {urn: {"provider", "id", "outputs", "dependencies"}},
     "invokes": [{"token", "args", "provider"}]}
with the engine's camelCase inputs and every secret replaced by "[secret]", and every Kubernetes
object as YAML under `OUT/<stack>/k8s/`. `registrations` holds what the engine knows beyond the
inputs: the provider reference each resource was registered with ("<provider urn>::<id>", null for
the default provider), its (mocked) id and provider-computed outputs (ARNs, names), and the URNs it
depends on; `invokes` lists every data-source call with the provider it went to. Prints resources
by type and the stack outputs. A bad configuration prints the error (every bad key) and exits with
status 2. What reads the plan documents lives outside the program: the policy pack's offline check
(`python -m policies.check`), the graph checks of `policies/plan/` and the chart and CRD checks of
`tools/validation/`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import runpy
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from gpu_train.spec import yamlfile
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.naming import PROJECT
from gpu_train.spec.settings import read

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "infra" / "__main__.py"
SECRET = "[secret]"
# The engine marks secret values with this signature key (see pulumi.runtime.rpc).
_SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
_SIG_KEY = "4dabf18193072939515e22adb298388d"


def stack_file_for(name: str) -> Path:
    return ROOT / "stacks" / f"Pulumi.{name}.yaml"


def read_stack_file(path: Path) -> tuple[str, dict[str, Any]]:
    """Return (stack name, raw config) from a `Pulumi.<stack>.yaml` settings file."""
    match = re.fullmatch(r"Pulumi\.(.+)\.yaml", path.name)
    if not match:
        raise SettingsError([f"{path}: a stack settings file must be named Pulumi.<stack>.yaml"])
    try:
        doc = yamlfile.load(path.read_text()) or {}
    except FileNotFoundError:
        raise SettingsError([f"{path}: no such stack settings file"]) from None
    except yaml.YAMLError as exc:
        raise SettingsError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(doc, dict):
        raise SettingsError([f"{path}: must have a top-level 'config:' mapping"])
    raw = doc.get("config")
    if not isinstance(raw, dict):
        raise SettingsError([f"{path}: must have a top-level 'config:' mapping"])
    return match.group(1), raw


def redact(value: Any) -> Any:
    """Replace engine-marked secrets (at any depth) by a fixed marker."""
    if isinstance(value, dict):
        if value.get(_SIG_KEY) == _SECRET_SIG:
            return _mask(value.get("value"))
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def _mask(value: Any) -> Any:
    """Keep a secret's shape (a Secret's stringData stays a mapping) but none of its values."""
    if isinstance(value, dict):
        return {k: _mask(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask(v) for v in value]
    return SECRET


def _plain(value: Any) -> Any:
    """Make mock state JSON-friendly: whole floats back to ints, unknowns to None."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def run_program(stack: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Validate settings, run infra/__main__.py under mocks and return the plan document."""
    import pulumi
    from pulumi.runtime import mocks as runtime_mocks
    from pulumi.runtime import settings as runtime_settings
    from pulumi.runtime.stack import run_pulumi_func
    from pulumi.runtime.sync_await import _sync_await

    from infra.mocks import MockContext, PlanMocks

    cfg = read(raw)  # fails here, before the program runs, on a value of the wrong type or range
    ctx = MockContext(region=cfg.region, project=cfg.project or "acme-ml")

    records: dict[str, dict[str, Any]] = {}
    registrations: dict[str, dict[str, Any]] = {}
    invokes: list[dict[str, Any]] = []

    class RecordingMonitor(runtime_mocks.MockMonitor):
        """Keeps each resource's inputs, parent, provider, computed outputs and dependencies, and every
        invoke with its provider, which the stock mock monitor drops."""

        def RegisterResource(self, request):  # noqa: N802 - gRPC method name
            response = super().RegisterResource(request)
            if request.type != "pulumi:pulumi:Stack":
                from pulumi.runtime import rpc

                inputs = rpc.deserialize_properties(request.object)
                records[response.urn] = {
                    "urn": response.urn,
                    "type": request.type,
                    "name": request.name,
                    "parent": request.parent or None,
                    "inputs": _plain(redact(inputs)),
                }
                state = self.resources[response.urn].state
                registrations[response.urn] = {
                    "provider": request.provider or None,
                    "id": response.id or None,
                    "outputs": _plain(redact({k: v for k, v in state.items() if k not in inputs})),
                    "dependencies": sorted(set(request.dependencies)),
                }
            return response

        def Invoke(self, request):  # noqa: N802 - gRPC method name
            from pulumi.runtime import rpc

            if request.tok != "pulumi:pulumi:getResource":
                invokes.append({"token": request.tok, "provider": request.provider or None,
                                "args": _plain(redact(rpc.deserialize_properties(request.args)))})
            return super().Invoke(request)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        pulumi.runtime.set_all_config({k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()})
        mocks = PlanMocks(ctx)
        pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack, preview=False,
                                 monitor=RecordingMonitor(mocks))

        _sync_await(run_pulumi_func(lambda: runpy.run_path(str(PROGRAM), run_name="__main__")))

        outputs: dict[str, Any] = {}
        root = runtime_settings.get_root_resource()
        for name, value in sorted(root.outputs.items()):
            out = pulumi.Output.from_input(value)
            resolved = _sync_await(out.future())
            outputs[name] = SECRET if _sync_await(out.is_secret()) else _plain(redact(resolved))
    finally:
        loop.close()
        asyncio.set_event_loop(None)  # a closed loop left current breaks the next Pulumi run in this process
    return {
        "project": PROJECT,
        "stack": stack,
        "resources": list(records.values()),
        "outputs": outputs,
        "registrations": registrations,
        "invokes": invokes,
    }


def kubernetes_objects(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every typed Kubernetes object in the plan (Helm releases and providers excluded)."""
    objects = []
    for res in plan["resources"]:
        typ = res["type"]
        if not typ.startswith("kubernetes:") or typ.startswith(("kubernetes:helm", "pulumi:providers")):
            continue
        inputs = res["inputs"]
        if "apiVersion" not in inputs or "kind" not in inputs:
            continue
        obj = {k: v for k, v in inputs.items() if v not in (None, {}, [])}
        objects.append(obj)
    return objects


def write_plan(plan: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stack = plan["stack"]
    path = out / f"{stack}.json"
    path.write_text(json.dumps(plan, indent=2, sort_keys=True))
    k8s_dir = out / stack / "k8s"
    if k8s_dir.exists():
        for old in k8s_dir.glob("*.yaml"):
            old.unlink()
    k8s_dir.mkdir(parents=True, exist_ok=True)
    for obj in kubernetes_objects(plan):
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or "cluster"
        fname = f"{ns}--{obj['kind']}--{meta.get('name', 'unnamed')}.yaml".lower()
        (k8s_dir / re.sub(r"[^a-z0-9.\-]+", "-", fname)).write_text(yaml.safe_dump(obj, sort_keys=False))
    return path


def summary(plan: dict[str, Any]) -> str:
    counts = Counter(r["type"] for r in plan["resources"])
    lines = [f"Plan for stack {plan['stack']}: {len(plan['resources'])} resources"]
    width = max((len(t) for t in counts), default=10)
    for typ, n in sorted(counts.items()):
        lines.append(f"  {typ:<{width}}  {n:>4}")
    lines.append("Outputs:")
    for name, value in plan["outputs"].items():
        text = value if isinstance(value, str) else json.dumps(value)
        lines.append(f"  {name}: {text if len(text) < 120 else text[:117] + '...'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.plan", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--stack", help="stack name: reads stacks/Pulumi.<stack>.yaml")
    which.add_argument("--stack-file", type=Path, help="any stack settings file named Pulumi.<stack>.yaml")
    parser.add_argument("--out", type=Path, default=Path("build/plan"), help="output directory")
    parser.add_argument("--quiet", action="store_true", help="print only the output path")
    args = parser.parse_args(argv)

    path = args.stack_file or stack_file_for(args.stack)
    started = time.perf_counter()
    try:
        stack, raw = read_stack_file(path)
        plan = run_program(stack, raw)
    except SettingsError as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    written = write_plan(plan, args.out)
    if not args.quiet:
        print(summary(plan))
        print(f"Kubernetes objects: {len(kubernetes_objects(plan))} (YAML in {args.out / plan['stack'] / 'k8s'})")
        print(f"Planned in {time.perf_counter() - started:.1f} s -> {written}")
    else:
        print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
