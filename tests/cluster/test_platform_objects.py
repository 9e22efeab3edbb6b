"""Every Kubernetes object each stack's program creates outside Helm releases, applied to the real API server:
namespaces with their Pod Security levels, admission policies and bindings, RBAC, NetworkPolicies, Kueue's flavors,
queues and priority classes, ConfigMaps, the platform contract, PodMonitors, and serving's objects.

Run: .venv/bin/pytest tests/cluster/test_platform_objects.py -q
"""

from __future__ import annotations

import pytest
from kubernetes.dynamic.exceptions import ApiException

from tests.cluster.conftest import PLANNED, ROOT
from tools.cluster.plane import Plane
from tools.cluster.platform import install_crds


@pytest.fixture(scope="module")
def empty_plane(tmp_path_factory):
    """A plane of this module's own, where no stack was applied: each stack's objects are checked as a first
    `pulumi up` creates them, not as updates of another stack's (JobSets and other immutable fields would differ)."""
    plane = Plane.start(ROOT / "build" / "cluster" / f"empty-{tmp_path_factory.getbasetemp().name}")
    install_crds(plane)
    yield plane
    plane.stop()


@pytest.mark.parametrize("stack", PLANNED)
def test_the_real_api_server_accepts_every_object_of_the_plan(empty_plane, stack_objects, stack):
    """A server-side dry run (admission, schema, CEL rules, webhooks; nothing stored) of every object, with the
    stack's namespaces created first, as `pulumi up` creates them first."""
    plane = empty_plane
    objs = stack_objects[stack]
    namespaces = [o for o in objs if o["kind"] == "Namespace"]
    plane.apply(namespaces, manager=f"plan-{stack}")
    refused = []
    for obj in objs:
        if obj["kind"] == "Namespace":
            continue
        try:
            plane.apply([obj], dry_run=True, manager=f"plan-{stack}")
        except ApiException as e:  # the API server's own message is the finding
            refused.append(f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}: "
                           f"{e.status} {e.body}")
    assert not refused, "\n".join(refused)
    kinds = {o["kind"] for o in objs}
    assert {"ValidatingAdmissionPolicy", "ClusterQueue", "LocalQueue", "NetworkPolicy", "Role"} <= kinds


def test_the_stack_is_applied_and_read_back(platform):
    kinds = {o["kind"] for o in platform.stored}
    assert {"Namespace", "ClusterQueue", "ResourceFlavor", "WorkloadPriorityClass", "JobSet"} <= kinds
    ns = platform.get("v1", "Namespace", "team-research")
    labels = ns["metadata"]["labels"]
    # Enforce privileged (the NVMe hostPath), warn and audit restricted; the admission policies guard the rest.
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"
    for cq in (o for o in platform.stored if o["kind"] == "ClusterQueue"):
        assert platform.get("kueue.x-k8s.io/v1beta2", "ClusterQueue", cq["metadata"]["name"])


def test_kueue_reports_every_cluster_queue_active(platform):
    """Kueue marks a ClusterQueue Active only when every flavor it names exists: a queue that names a missing
    flavor, or a LocalQueue pointing at a missing ClusterQueue, would hold every job."""
    from tests.cluster.conftest import wait_for

    names = [o["metadata"]["name"] for o in platform.stored if o["kind"] == "ClusterQueue"]
    for name in names:
        wait_for(f"ClusterQueue {name} Active", lambda n=name: any(
            c["type"] == "Active" and c["status"] == "True" for c in
            (platform.get("kueue.x-k8s.io/v1beta2", "ClusterQueue", n).get("status") or {}).get("conditions", [])))
    for lq in (o for o in platform.stored if o["kind"] == "LocalQueue"):
        ns, name = lq["metadata"]["namespace"], lq["metadata"]["name"]
        wait_for(f"LocalQueue {ns}/{name} Active", lambda ns=ns, name=name: any(
            c["type"] == "Active" and c["status"] == "True" for c in
            (platform.get("kueue.x-k8s.io/v1beta2", "LocalQueue", name, ns).get("status") or {}).get(
                "conditions", [])))


def test_kueues_conversion_webhook_serves_the_older_api(platform):
    """The ClusterQueues are stored as v1beta2; reading them as v1beta1 goes through Kueue's conversion webhook on
    loopback."""
    for cq in (o for o in platform.stored if o["kind"] == "ClusterQueue"):
        old = platform.get("kueue.x-k8s.io/v1beta1", "ClusterQueue", cq["metadata"]["name"])
        assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
        assert old["spec"]["resourceGroups"][0]["flavors"][0]["name"] == \
            cq["spec"]["resourceGroups"][0]["flavors"][0]["name"]
