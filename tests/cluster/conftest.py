"""The cluster lane: a real control plane (tools/cluster: etcd, kube-apiserver, controller manager, scheduler, Kueue,
JobSet, kwok) built from upstream source and started once per run, with the platform's objects applied to it.

Run: .venv/bin/pytest tests/cluster -q      (or `make e2e`; `make test` runs it after the other tests)

Fixtures:
- `plane`: the running plane (tools.cluster.plane.Plane), with the charts' CRDs installed;
- `stack_objects`: every stack's (and the serving variant's) Kubernetes objects from its offline plan;
- `platform`: aws-dev's objects applied, its pools' kwok nodes Ready, its contract, and a kubeconfig per user:
  alice submits for research (group ml-research), bob for platform (ml-platform), vera in ml-platform views
  research, as the stack's RoleBindings say;
- `cli`: `gpu-train ARGS` in-process -> (exit status, stdout, stderr);
- `clean`: no JobSet or Workload in the team namespaces and no GPU reserved, before and after the test.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.plan_cache import plan_stacks
from tools import variants
from tools.cluster.nodes import pool_nodes
from tools.cluster.plane import Plane
from tools.cluster.platform import apply_plan, install_crds, plan_objects

ROOT = Path(__file__).resolve().parents[2]
STACK = SERVING = "aws-dev-serving"  # aws-dev with serving on: its objects are a superset of aws-dev's
PLANNED = ("aws-dev", "aws-prod", "gcp-dev", "gcp-prod", SERVING)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def plane():
    started = Plane.start(ROOT / "build" / "cluster" / f"lane-{os.getpid()}")
    install_crds(started)
    yield started
    started.stop()


@pytest.fixture(scope="session")
def plan_out(tmp_path_factory) -> Path:
    """The plans of PLANNED, made once per source tree with the other lane's (tests/plan_cache.py)."""
    out = tmp_path_factory.mktemp("cluster-plans")
    plan_stacks(PLANNED, out, lambda name, folder: variants.serving_stack_file(name, folder)
                if name in variants.SERVING else None)
    return out


@pytest.fixture(scope="session")
def stack_objects(plan_out) -> dict[str, list[dict[str, Any]]]:
    return {name: plan_objects(plan_out / name / "k8s") for name in PLANNED}


@dataclass
class Platform:
    plane: Plane
    contract: dict[str, Any]
    contract_file: Path
    stored: list[dict[str, Any]]
    kubeconfigs: dict[str, Path]
    nodes: list[dict[str, Any]]

    def core(self):
        from kubernetes import client, config

        return client.CoreV1Api(config.new_client_from_config(str(self.plane.admin_kubeconfig)))

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        res = self.plane.client().resources.get(api_version=api_version, kind=kind)
        try:
            return res.get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def list(self, api_version: str, kind: str, namespace: str | None = None, **selectors) -> list[dict]:
        res = self.plane.client().resources.get(api_version=api_version, kind=kind)
        return [i.to_dict() for i in res.get(namespace=namespace, **selectors).items]


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 90.0, every: float = 0.25) -> Any:
    """Poll `probe` until it returns something truthy (the signal), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="session")
def platform(plane, stack_objects, plan_out, tmp_path_factory) -> Platform:
    stored = apply_plan(plane, plan_out / STACK / "k8s")
    cm = next(o for o in stack_objects[STACK] if o["kind"] == "ConfigMap" and o["metadata"]["name"] ==
              "gpu-train-platform")
    contract = json.loads(next(iter(cm["data"].values())))
    contract_file = tmp_path_factory.mktemp("contract") / "platform.json"
    contract_file.write_text(json.dumps(contract))
    nodes = pool_nodes(contract)
    plane.add_nodes(nodes)
    p = Platform(plane, contract, contract_file, stored, {
        "alice": plane.user_kubeconfig("alice", ("ml-research",), "team-research"),
        "bob": plane.user_kubeconfig("bob", ("ml-platform",), "team-platform"),
        "vera": plane.user_kubeconfig("vera", ("ml-platform",), "team-research"),
        "mallory": plane.user_kubeconfig("mallory", ("contractors",), "team-research"),
    }, nodes)
    names = {n["metadata"]["name"] for n in nodes}
    wait_for("every kwok node Ready", lambda: names <= {
        n.metadata.name for n in p.core().list_node().items
        if any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))})
    return p


@pytest.fixture
def clean(platform):
    """Before and after the test: no JobSet and no Workload in the team namespaces, no GPU reserved by Kueue."""
    from tests.cluster.jobs import JOBSET, WORKLOAD, delete_jobset, gpu_usage

    def wipe():
        for ns in ("team-research", "team-platform"):
            for js in platform.list(*JOBSET, ns):
                delete_jobset(platform, js["metadata"]["name"], ns)
        wait_for("the team namespaces empty and their queues holding no GPUs", lambda: not any(
            platform.list(*kind, ns) for kind in (JOBSET, WORKLOAD) for ns in ("team-research", "team-platform"))
            and gpu_usage(platform, "team-research") == gpu_usage(platform, "team-platform") == 0)
    wipe()
    yield
    wipe()


def job_spec(tmp_path: Path, **over: Any) -> Path:
    """A job spec file for research's l4-spot pool."""
    settings: dict[str, Any] = {"name": "e2e", "team": "research", "pool": "l4-spot", "preset": "gpt2-124m",
                                "nodes": "1:1", "gpusPerNode": 1, "steps": 200, "globalBatchTokens": 65536,
                                "checkpointEvery": 50, "maxRestarts": 5}
    settings.update(over)
    path = tmp_path / f"{settings['name']}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path
