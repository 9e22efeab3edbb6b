"""The platform's own controllers in a team namespace, on the real control plane: the serving route and the
promotion loop the stack installs, and a sweep controller a member submits, each admitted (Pod Security and the
admission policies) and running on a system node; and each controller's identity able to do its work with only its
own Role, in its own namespace and nowhere else.

Run: .venv/bin/pytest tests/cluster/test_controllers.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes.dynamic.exceptions import ForbiddenError

from gpu_train.jobs.sweep_platform import controller_name
from gpu_train.spec import naming
from tests.cluster.conftest import wait_for
from tests.cluster.jobs import NS, service_account_kubeconfig
from tests.gpu_train.cli.test_sweep import SWEEP


def running_pods_of(platform, prefix: str, ns: str = NS) -> list:
    return [p for p in platform.core().list_namespaced_pod(ns).items
            if p.metadata.name.startswith(prefix) and p.status.phase == "Running"]


@pytest.mark.parametrize("deployment", ["chat-route", "serving-promoter"])
def test_the_stacks_serving_controllers_are_admitted_and_run_on_a_system_node(platform, deployment):
    pods = wait_for(f"a Running pod of {deployment}", lambda: running_pods_of(platform, deployment + "-"))
    node = platform.core().read_node(pods[0].spec.node_name)
    assert node.metadata.labels.get(naming.SYSTEM_LABEL) == "true"


def test_the_inference_service_is_stored_against_kserves_crd(platform):
    isvc = next(o for o in platform.stored if o["kind"] == "InferenceService")
    stored = platform.get(isvc["apiVersion"], "InferenceService", isvc["metadata"]["name"], NS)
    assert stored["spec"]["predictor"] == isvc["spec"]["predictor"] | stored["spec"]["predictor"]


def test_a_members_sweep_controller_is_admitted_and_runs(platform, cli, tmp_path):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump(SWEEP))
    code, out, err = cli("sweep", "submit", spec, "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    name = controller_name(SWEEP["name"])
    pods = wait_for(f"the sweep controller {name} Running", lambda: running_pods_of(platform, name + "-"))
    assert pods[0].spec.service_account_name == naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT
    assert platform.core().read_node(pods[0].spec.node_name).metadata.labels.get(naming.SYSTEM_LABEL) == "true"


def _allowed(platform, kubeconfig: Path, obj: dict) -> bool:
    try:
        platform.plane.apply([obj], dry_run=True, kubeconfig_path=kubeconfig, manager="role-check")
        return True
    except ForbiddenError:
        return False


def _trial(ns: str) -> dict:
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "role-probe", "namespace": ns},
            "spec": {"replicatedJobs": [{"name": "w", "replicas": 1, "template": {"spec": {"template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}}}}]}}


def test_the_sweep_controller_may_manage_trials_in_its_namespace_only(platform):
    me = service_account_kubeconfig(platform, naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT)
    dyn = platform.plane.client(me)
    cm = dyn.resources.get(api_version="v1", kind="ConfigMap")
    assert cm.get(name=naming.PLATFORM_CONFIGMAP, namespace=NS)  # the platform contract, by name
    with pytest.raises(ForbiddenError):
        cm.get(namespace=NS)  # no other ConfigMap
    dyn.resources.get(api_version="kueue.x-k8s.io/v1beta2", kind="Workload").get(namespace=NS)
    assert not _allowed(platform, me, _trial("team-platform"))
    with pytest.raises(ForbiddenError):
        dyn.resources.get(api_version="jobset.x-k8s.io/v1alpha2", kind="JobSet").get(namespace="team-platform")


def test_the_promotion_loop_may_move_traffic_in_its_namespace_only(platform):
    me = service_account_kubeconfig(platform, "serving-promoter")
    dyn = platform.plane.client(me)
    route = next(o for o in platform.stored if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "chat-route")
    dyn.resources.get(api_version="v1", kind="ConfigMap").patch(
        name="chat-route", namespace=NS, body={"metadata": {"annotations": {"probe": "1"}}},
        content_type="application/merge-patch+json", dry_run="All")
    assert route["metadata"]["namespace"] == NS
    isvcs = dyn.resources.get(api_version="serving.kserve.io/v1beta1", kind="InferenceService")
    assert isvcs.get(namespace=NS).items
    with pytest.raises(ForbiddenError):
        isvcs.get(namespace="team-platform")
    with pytest.raises(ForbiddenError):
        dyn.resources.get(api_version="jobset.x-k8s.io/v1alpha2", kind="JobSet").get(namespace=NS)
