"""The in-cluster sweep controller's Kubernetes objects, as plain dicts: what the platform gives each team namespace
(the `sweep-controller` service account and its Role) and what `gpu-train sweep submit` creates for one sweep (a
Deployment running its controller, the sweep spec in its environment, so that a team member needs no right to
write ConfigMaps, among which is the platform contract's).

Usage:
    team_sweep_objects(namespace, identity_annotations={...})          # infra/k8s/tenancy.py, per team namespace
    sweep_deployment(namespace, sweep, image=..., spec_yaml=..., ...)  # gpu_train/cli/sweep_cluster.py

The controller (`python -m gpu_train.sweeps`, from the platform's trainer image) runs with the namespace's
`sweep-controller` account, whose Role lets it do what `gpu-train submit`, `pause`, `resume` and `cancel` do to its
trials, and nothing else, in its own namespace only (a Role, never a ClusterRole): create, read and delete
JobSets; read and patch Workloads (spec.active); read the platform contract's ConfigMap (by name). Its cloud
identity reads and writes the team's prefix of the checkpoints bucket: the trials' budget and status objects and
the sweep's own journal. One replica with the Recreate strategy: two controllers would take each decision twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_train.jobs.serving_platform import (
    LABELS,
    READ,
    heartbeat_probe,
    role_with_binding,
    service_account,
    singleton_deployment,
)
from gpu_train.spec import naming

SPEC_ENV = "GPU_TRAIN_SWEEP_SPEC"  # the sweep spec (YAML, its trial template inline) the controller reads
STATE_DIR = "/tmp/sweeps"  # the controller's working copy; the journal's lasting copy is in the object store
HEARTBEAT = "/tmp/heartbeat"  # touched at every pass of the controller (python -m gpu_train.sweeps --heartbeat)
HEARTBEAT_MAX_AGE_S = 300  # a pass reads every running trial's status; 5 minutes is far beyond a slow one
SYSTEM_NODES = {naming.SYSTEM_LABEL: "true"}  # the platform's CPU nodes, on either cloud


def controller_name(sweep: str) -> str:
    """The Deployment of a sweep's controller: sweep-<sweep name> (at most 30 characters)."""
    return f"sweep-{sweep}"


def sweep_controller_rules() -> list[dict[str, Any]]:
    return [
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": [*READ, "create", "delete"]},
        # Pause and resume a trial as `gpu-train pause/resume` do: its Workload's spec.active.
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": [*READ, "patch"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"],
         "resourceNames": [naming.PLATFORM_CONFIGMAP]},
    ]


def team_sweep_objects(namespace: str, *, identity_annotations: Mapping[str, str]) -> list[dict[str, Any]]:
    """The service account every sweep controller of the namespace runs as, and its Role, in creation order."""
    name = naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT
    return [service_account(name, namespace, token=True, annotations=identity_annotations),
            *role_with_binding(name, namespace, sweep_controller_rules())]


def sweep_deployment(namespace: str, sweep: str, *, image: str, spec_yaml: str, tracking_uri: str,
                     pod_env: Mapping[str, str]) -> dict[str, Any]:
    """One sweep's controller. Submitting a changed spec changes the pod template, which replaces the pod (the
    journal carries over through the object store)."""
    labels = {**LABELS, naming.SWEEP_LABEL: sweep}
    env = [{"name": "HOME", "value": "/tmp"}, {"name": SPEC_ENV, "value": spec_yaml},
           *({"name": k, "value": v} for k, v in sorted(pod_env.items())),
           *([{"name": "MLFLOW_TRACKING_URI", "value": tracking_uri}] if tracking_uri else [])]
    return singleton_deployment(
        name=controller_name(sweep), namespace=namespace, labels=labels, selector={naming.SWEEP_LABEL: sweep},
        service_account=naming.SWEEP_CONTROLLER_SERVICE_ACCOUNT, node_selector=SYSTEM_NODES, grace_s=60,
        api_use="the sweep controller creates, pauses and resumes its trials' JobSets through the Kubernetes API",
        container={
            "name": "controller",
            "image": image,
            "command": ["python", "-m", "gpu_train.sweeps"],
            "args": ["--namespace", namespace, "--state", STATE_DIR, "--heartbeat", HEARTBEAT],
            "env": env,
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
            "livenessProbe": {**heartbeat_probe(HEARTBEAT, HEARTBEAT_MAX_AGE_S, 60), "failureThreshold": 3},
        })
