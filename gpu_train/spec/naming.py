"""Names, tags and labels: the one place they are made, for the Pulumi program, the job renderer and the CLI.

Usage:
    resource_name("aws-dev", "vpc")          # "gpu-train-aws-dev-vpc"
    common_tags("aws-dev", "dev", extra)      # tags for every taggable resource (AWS tags, GCP labels)
    team_namespace("research")                # "team-research"
    local_queue_name("research")              # "research-queue" (the team's LocalQueue)
    workdir_path("/mnt/k8s-disks/0", "team-research")   # the namespace's directory on a node's NVMe

Kubernetes names that several layers share (namespaces, service accounts, queues, the monitoring release) live
here too, so the cloud layer binds workload identities to exactly the service accounts the Kubernetes layer
creates, and a team member's `gpu-train` names the same queue the stack created.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

PROJECT = "gpu-train"
# A name that becomes part of Kubernetes object names (a stack, pool, team, job or service): a short DNS label.
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")

# Labels every GPU node carries (set by the cloud layer, read by the Kubernetes layer and the job).
POOL_LABEL = "gpu-train.io/pool"
CAPACITY_LABEL = "gpu-train.io/capacity"
FABRIC_LABEL = "gpu-train.io/fabric"
GPU_TYPE_LABEL = "gpu-train.io/gpu-type"
GPU_NODE_LABEL = "gpu-train.io/gpu-node"  # "true" on every node of every GPU pool, on no other node
SYSTEM_LABEL = "gpu-train.io/system"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_RESOURCE = "nvidia.com/gpu"

# Tags every resource must carry; policies/ checks them.
REQUIRED_TAGS = ("project", "stack", "environment", "managed-by")

# Kubernetes names shared between layers.
CACHE_NAMESPACE = "alluxio"
CACHE_SERVICE_ACCOUNT = "alluxio"
CACHE_PROXY_SERVICE = "alluxio-proxy"
CACHE_PROXY_PORT = 39999
MONITORING_NAMESPACE = "monitoring"
MONITORING_RELEASE = "kube-prometheus-stack"
MLFLOW_NAMESPACE = "mlflow"
MLFLOW_SERVICE_ACCOUNT = "mlflow"
MLFLOW_PORT = 5000
# MLflow keeps artifacts under <artifacts bucket>/<this>/ (its --artifacts-destination); serving reads them there.
MLFLOW_ARTIFACTS_PREFIX = "mlflow"
TRAINER_SERVICE_ACCOUNT = "trainer"
KARPENTER_NAMESPACE = "kube-system"
KARPENTER_SERVICE_ACCOUNT = "karpenter"
TEAM_LABEL = "gpu-train.io/team"
# The file a prepared dataset's folder holds its manifest in (trainer/data/manifest.py; `run --local` checks it).
DATASET_MANIFEST = "manifest.json"
METRICS_PORT = 9400  # trainer Prometheus port (TRAINER_METRICS_PORT); local rank r uses METRICS_PORT + r
# The trainer image's numeric user and group (trainer/Dockerfile): training pods run as it, and the NVMe
# DaemonSet hands each team's node directory to it.
TRAINER_UID = 10001

# Kueue: one cohort for every team's ClusterQueue; team namespaces carry the label Kueue manages jobs by.
COHORT = "gpu-train"
# Kueue's ResourceFlavor of the CPU (system) nodes, where data preparation's Ray pods run; each GPU pool's flavor is
# named after the pool.
CPU_FLAVOR = "cpu"
KUEUE_MANAGED_LABEL = "gpu-train.io/kueue-managed"
# The platform contract every team member's `gpu-train` reads: one ConfigMap per team namespace.
PLATFORM_CONFIGMAP = "gpu-train-platform"
PLATFORM_CONFIGMAP_KEY = "platform.json"
# Directory under a GPU node's NVMe root that holds one directory per team namespace.
WORKDIR_ROOT = "gpu-train"
# Log streams of the team namespaces' container logs in CloudWatch Logs: the shipper (infra/k8s/log_shipping.py)
# names each stream STREAM_PREFIX + its tail input's tag, which is TAIL_TAG_PREFIX + the log file's path with "/"
# as "."; `gpu-train logs` finds a rank's streams by that name.
TAIL_TAG_PREFIX = "kube."
STREAM_PREFIX = "containers."
# Serving (gpu_train/spec/serving.py, gpu_train/jobs/serving.py): KServe's namespace, the service accounts of a
# team namespace's serving pods, and the labels every serving object carries.
KSERVE_NAMESPACE = "kserve"
MODEL_SERVER_SERVICE_ACCOUNT = "model-server"  # predictor pods: reads the MLflow artifact store, nothing else
ROUTER_SERVICE_ACCOUNT = "serving-router"  # a service's weighted route: reads its route ConfigMap
PROMOTER_SERVICE_ACCOUNT = "serving-promoter"  # the in-cluster promotion loop
SERVICE_LABEL = "gpu-train.io/service"
MODEL_VERSION_LABEL = "gpu-train.io/model-version"
SERVING_ROLE_LABEL = "gpu-train.io/serving-role"  # model | route | router | promoter
# Sweeps (gpu_train/jobs/sweep_platform.py): the in-cluster sweep controllers' service account (one per team
# namespace, made by the platform) and the label on each controller's objects, valued with the sweep's name.
SWEEP_CONTROLLER_SERVICE_ACCOUNT = "sweep-controller"
SWEEP_LABEL = "gpu-train.io/sweep"
# Data preparation on the cluster (`gpu-train prepare --cluster`, gpu_train/jobs/prepare.py): the service account of
# a team's Ray pods (read the datasets bucket, write the team's prefix of it), the KubeRay operator's namespace, and
# the label KubeRay puts on every Ray pod.
DATA_PREP_SERVICE_ACCOUNT = "data-prep"
KUBERAY_NAMESPACE = "kuberay-system"
RAY_NODE_LABEL = "ray.io/is-ray-node"
ROUTE_PORT = 8080  # the route's HTTP port (requests and /metrics)
# The JobSet's one replicated job, and the pod label JobSet puts on every pod of a JobSet.
REPLICATED_JOB = "worker"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def gpu_tolerations() -> list[dict[str, str]]:
    """The toleration of the GPU taint, as every GPU pool's pods carry it."""
    return [{"key": GPU_TAINT["key"], "operator": "Equal", "value": GPU_TAINT["value"], "effect": GPU_TAINT["effect"]}]


def prefix(stack: str) -> str:
    """Common name prefix for the stack: gpu-train-<stack>."""
    return f"{PROJECT}-{stack}"


def resource_name(stack: str, *parts: str, max_len: int = 63) -> str:
    """A lowercase, dash-separated physical name, shortened with a stable suffix when too long."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join((prefix(stack), *parts)).lower()).strip("-")
    if len(name) <= max_len:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: max_len - 7].rstrip('-')}-{digest}"


def common_tags(stack: str, environment: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags (AWS) or labels (GCP) for every taggable resource; GCP-safe by construction."""
    tags = {"project": PROJECT, "stack": stack, "environment": environment, "managed-by": "pulumi"}
    tags.update(extra or {})
    return tags


def team_namespace(team: str) -> str:
    return f"team-{team}"


def local_queue_name(team: str) -> str:
    """The team's LocalQueue. A stack job's own queue is `<job>-job`: no name can be both."""
    return f"{team}-queue"


def priority_class_name(kind: str) -> str:
    """The Kueue WorkloadPriorityClass of a JobSpec.priority_class ("production", "sweep")."""
    return f"{PROJECT}-{kind}"


def cluster_queue_name(team: str) -> str:
    return team_namespace(team)


def job_queue_name(job: str) -> str:
    """The stack job's own LocalQueue, whose stopPolicy pauses it."""
    return f"{job}-job"


def namespace_labels(team: str) -> dict[str, str]:
    """Labels of a team's namespace: its ClusterQueue selects it by the team label, and Kueue manages every job
    in it (managedJobsNamespaceSelector)."""
    return {TEAM_LABEL: team, KUEUE_MANAGED_LABEL: "true"}


def pool_node_labels(pool_name: str, capacity: str, fabric: str, gpu_type: str) -> dict[str, str]:
    """Labels on every node of a GPU pool; the job's node selector uses POOL_LABEL."""
    return {
        GPU_NODE_LABEL: "true",
        POOL_LABEL: pool_name,
        CAPACITY_LABEL: capacity,
        FABRIC_LABEL: fabric,
        GPU_TYPE_LABEL: gpu_type.lower(),
    }


def workdir_path(host_path: str, namespace: str) -> str:
    """The host directory a team namespace's training pods mount: <nvme>/gpu-train/<namespace>."""
    if not host_path.startswith("/") or host_path.rstrip("/") == "":
        raise ValueError(f"platform.nvme_host_path must be an absolute directory, not {host_path!r}")
    return f"{host_path.rstrip('/')}/{WORKDIR_ROOT}/{namespace}"


def proxy_dataset_uri(dataset_uri: str, datasets_bucket: str) -> str | None:
    """The dataset's URI as the trainer must name it when reading through the Alluxio S3 proxy.

    The datasets bucket is Alluxio's root mount, and Alluxio's S3 API serves each top-level directory of its
    namespace as a bucket (https://docs.alluxio.io/os/user/2.9.5/en/api/S3-API.html). So `<bucket>/<dir>/<key>`
    is `s3://<dir>/<key>` at the proxy, for both clouds. Returns None when the dataset is not under the datasets
    bucket or sits at its top level: the trainer then reads the object store directly."""
    bucket = datasets_bucket.rstrip("/") + "/"
    if not dataset_uri.startswith(bucket):
        return None
    rest = dataset_uri[len(bucket):].lstrip("/")
    if "/" not in rest:
        return None
    return f"s3://{rest}"


def route_name(service: str) -> str:
    """The route (Deployment, ConfigMap) of a served model; its Service keeps the service's own name."""
    return f"{service}-route"


def version_name(service: str, version: int) -> str:
    """The InferenceService serving one model version of a service."""
    return f"{service}-v{version}"


def rank_stream_prefix(job: str, rank: int) -> str:
    """The start of the log streams of every pod a job has run for one rank: the JobSet's worker Job is
    <job>-<replicated job>-0, and the Job controller names an Indexed Job's pods <job name>-<index>-<random>."""
    return f"{STREAM_PREFIX}{TAIL_TAG_PREFIX}var.log.containers.{job}-{REPLICATED_JOB}-0-{rank}-"
