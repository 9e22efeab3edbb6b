"""Shared fixtures: every stack in stacks/ planned through the plan tool, once per source tree (tests/plan_cache.py).

Usage: a test takes `plans` (dict stack -> plan document) or `plan_dir` (where JSON + k8s YAML are).
Each stack is planned in its own process (`python -m infra.plan`), exactly as a user runs it, so
Pulumi runtime state never leaks between stacks or into other tests.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.plan_cache import plan_stacks
from tools import variants as serving_variants

ROOT = Path(__file__).resolve().parent.parent
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))


def shared_dir(tmp_path_factory, worker_id: str, name: str, build: Callable[[Path], None]) -> Path:
    """A directory `build` fills once per test run. Under pytest-xdist (`make test` runs two workers) the first
    worker to ask builds it in the run's common temporary directory while the others wait on its lock, then all
    read the same files (pytest-xdist's documented way to share a session fixture)."""
    if worker_id == "master":
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    out = tmp_path_factory.getbasetemp().parent / name
    with FileLock(str(out) + ".lock"):
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


def stack_file(name: str, folder: Path) -> Path | None:
    """The stack file of a fabric or serving variant, written in `folder`; None for a stack of stacks/."""
    if name in SERVING_VARIANTS:
        return serving_variants.serving_stack_file(name, folder)
    return variant_stack_file(name, folder) if name in VARIANTS else None


def _plan_stacks(out: Path) -> None:
    plan_stacks(STACKS, out, stack_file)


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory, worker_id) -> Path:
    return shared_dir(tmp_path_factory, worker_id, "plan", _plan_stacks)


@pytest.fixture(scope="session")
def stack_plans(plan_dir) -> dict[str, dict]:
    """Every stack's plan. Session-wide fixtures depend on this one, never on `plans`: a directory's
    conftest may narrow `plans` (tests/infra/aws: only the aws stacks), and a session fixture built
    from a narrowed `plans` would keep that narrowing for the whole session."""
    return {s: json.loads((plan_dir / f"{s}.json").read_text()) for s in STACKS}


@pytest.fixture(scope="session")
def plans(stack_plans) -> dict[str, dict]:
    return stack_plans


# Fixtures that run the Pulumi program (python -m infra.plan) for every stack: their tests are integration tests.
PLAN_FIXTURES = frozenset({"plan_dir", "stack_plans", "plans", "variant_plan_dir", "variant_plans", "serving_plans",
                           "all_plans"})


def pytest_collection_modifyitems(config, items):
    """`make test-fast` runs what is not marked `integration`: a test is an integration test when it plans the
    stacks, starts real training or servers (marked `slow`), or its module says so (`pytestmark`)."""
    for item in items:
        if PLAN_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _fresh_pulumi_root():
    """Each test that sets Pulumi mocks must get a new root stack resource and no pending outputs: both, left behind
    by an earlier test, belong to that test's event loop. `set_mocks` keeps the runtime's set of pending output
    tasks (its MockSettings does not renew it), and a program run waits for every task in that set, so one from an
    earlier test's loop, which no loop runs any more, would hold the next run in this process forever."""
    if "pulumi" in sys.modules:
        from pulumi.runtime import settings

        settings.ROOT.set(None)
        settings.SETTINGS.outputs.clear()
    yield


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """run(args) -> (status, stdout, stderr) of `gpu-train ARGS` in this process, with HOME in tmp_path (no stray
    kubeconfig); the CLI tests and the cluster lane share it."""
    from gpu_train.cli.main import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KUBECONFIG", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


def resources_of(plan: dict, type_token: str) -> list[dict]:
    """All resources of one Pulumi type token in a plan."""
    return [r for r in plan["resources"] if r["type"] == type_token]


# Variants of the prod stacks on the other fabric machine types: the same settings with every GPU
# pool (and so the job) moved to another instance type. Planned like the real stacks.
VARIANTS = {
    "aws-prod-p4d": ("aws-prod", "p4d.24xlarge"),
    "aws-prod-p5en": ("aws-prod", "p5en.48xlarge"),
    "gcp-prod-a3high": ("gcp-prod", "a3-highgpu-8g"),
    "gcp-prod-a3ultra": ("gcp-prod", "a3-ultragpu-8g"),
}


def variant_stack_file(name: str, out_dir: Path) -> Path:
    """Write stacks/Pulumi.<base>.yaml with every GPU pool on the variant's instance type."""
    import yaml

    base, instance_type = VARIANTS[name]
    doc = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{base}.yaml").read_text())
    for pool in doc["config"]["gpu-train:gpuPools"]:
        pool["instanceType"] = instance_type
    path = out_dir / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# The dev stacks with serving enabled (tools/variants.py: examples/serving.yaml's block added), planned like the
# fabric variants: their plans hold cert-manager, KServe, its CRDs and the stack's InferenceService.
SERVING_VARIANTS = tuple(sorted(serving_variants.SERVING))


def _plan_variants(out: Path) -> None:
    plan_stacks([*sorted(VARIANTS), *SERVING_VARIANTS], out, stack_file)


@pytest.fixture(scope="session")
def variant_plan_dir(tmp_path_factory, worker_id) -> Path:
    return shared_dir(tmp_path_factory, worker_id, "variant-plan", _plan_variants)


@pytest.fixture(scope="session")
def variant_plans(variant_plan_dir) -> dict[str, dict]:
    return {s: json.loads((variant_plan_dir / f"{s}.json").read_text()) for s in sorted(VARIANTS)}


@pytest.fixture(scope="session")
def serving_plans(variant_plan_dir) -> dict[str, dict]:
    return {s: json.loads((variant_plan_dir / f"{s}.json").read_text()) for s in SERVING_VARIANTS}


@pytest.fixture(scope="session")
def all_plans(stack_plans, variant_plans, serving_plans) -> dict[str, dict]:
    """The four stacks, the fabric variants and the serving variants, by stack name."""
    return {**stack_plans, **variant_plans, **serving_plans}
