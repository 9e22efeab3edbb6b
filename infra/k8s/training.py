"""The stack's training job: a JobSet running `torchrun ... -m trainer` on one GPU pool, queued by Kueue.

Usage (in infra/__main__.py, after the image, the Kubernetes layer and MLflow):
    job = TrainingJob("job", TrainingJobArgs(platform=platform, job=cfg.job, image=image.ref,
                                             local_queue=layer.local_queue[cfg.job.team], ...))
    pulumi.export("jobName", job.job_name)

Pure builders, tested without mocks: `jobset_manifest(...)` (the JobSet) and `pod_monitor_manifest(...)`
(the PodMonitor that scrapes every local rank). The component only resolves Outputs and hands the dicts
to `apiextensions.CustomResource`.

Shape of the job (see docs/deploy-job.md for the reasons):
- one replicated job "worker" of MAX pods (Indexed Job), one pod per node (required pod anti-affinity on
  the hostname; each pod also asks for all the GPUs of its node), on the pool's nodes (node selector and
  tolerations from the contract);
- `torchrun --nnodes=MIN:MAX` with c10d rendezvous on pod 0's stable DNS name from the JobSet's headless
  service (<job>-worker-0-0.<job>:29400), so the job keeps training when only MIN nodes are left;
- Kueue admits the whole JobSet through the team's LocalQueue (label kueue.x-k8s.io/queue-name);
  `spec.suspend` follows the `job.suspend` setting, so `pulumi up` pauses and resumes it;
- the fabric (EFA / GPUDirect-TCPX(O) / RDMA) comes only from the contract: extended resources, pod
  annotations, NCCL env, host volumes and sidecars.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import naming
from infra.config import JobConfig
from infra.k8s import nvme
from infra.k8s.cache import proxy_dataset_uri
from infra.platform import ClusterPlatform, GpuPool

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PODMONITOR_API = "monitoring.coreos.com/v1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
REPLICATED_JOB = "worker"
CONTAINER = "trainer"
LAUNCHER = "gpu-train-launch"  # trainer/entrypoint.sh in the image: waits for rendezvous DNS, execs torchrun
RDZV_PORT = 29400
# Seconds torchrun waits for the minimum number of nodes to join; GPU nodes created on demand (Karpenter,
# cluster autoscaler) take several minutes to boot and pull the image, so the default 600 s is too short.
RDZV_JOIN_TIMEOUT_S = 1800
# SIGTERM -> the trainer writes a final checkpoint and uploads it. 300 s covers a synchronous save of the
# 7b preset's sharded state to local NVMe plus the upload of one checkpoint at object-store speeds.
TERMINATION_GRACE_S = 300
NVME_MOUNT = "/mnt/nvme"
GPU_RESOURCE = "nvidia.com/gpu"
APP_LABELS = {"app.kubernetes.io/name": "gpu-train-trainer", "app.kubernetes.io/part-of": "gpu-train"}
# Trainer keys that have their own job setting: setting them again in job.overrides would be ambiguous.
MANAGED_OVERRIDES = {
    "train.steps": "steps",
    "train.global_batch_tokens": "globalBatchTokens",
    "checkpoint.every_steps": "checkpointEvery",
    "checkpoint.remote_uri": "checkpointUri",
    "data.uri": "datasetUri",
}
# Headroom on every GPU node for the kubelet's reservation and the per-node agents (Alluxio worker, DCGM
# exporter, device and fabric plugins, node exporter): requests are this fraction of the instance, less
# one CPU and 4 GiB.
NODE_FRACTION = 0.85


class JobSpecError(ValueError):
    """The job settings cannot be turned into a JobSet; the message names the setting."""


def parse_nodes(nodes: str) -> tuple[int, int]:
    m = re.fullmatch(r"([0-9]+):([0-9]+)", nodes)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise JobSpecError(f"gpu-train:job.nodes must be MIN:MAX with 1 <= MIN <= MAX (got {nodes!r})")
    return int(m.group(1)), int(m.group(2))


def node_shape(cloud: str, instance_type: str) -> tuple[int, int]:
    """(vCPUs, memory GiB) of a GPU instance type, from the cloud's catalog."""
    if cloud == "aws":
        from infra.aws.catalog import instance_spec as spec
    else:
        from infra.gcp.catalog import machine_spec as spec
    s = spec(instance_type)
    return s.vcpus, s.memory_gib


def pod_resources(cloud: str, instance_type: str) -> tuple[int, int, int]:
    """(CPU request, memory GiB request = limit, /dev/shm GiB) for a one-pod-per-node worker."""
    vcpus, mem = node_shape(cloud, instance_type)
    cpu = max(1, int(vcpus * NODE_FRACTION) - 1)
    memory = max(2, int(mem * NODE_FRACTION) - 4)
    # /dev/shm (tmpfs, charged to the pod's memory when used): NCCL's shared-memory transport and
    # torch's inter-process tensors. A quarter of the pod's memory leaves the rest for the trainer.
    shm = max(1, memory // 4)
    return cpu, memory, shm


def image_digest(image: str) -> str:
    """The sha256:... part of a digest-pinned image reference; a tag-only image is refused."""
    m = re.fullmatch(r"[^@\s]+@(sha256:[0-9a-f]{64})", image)
    if not m:
        raise JobSpecError(f"the trainer image must be pinned by digest (repo@sha256:<64 hex>), got {image!r}")
    return m.group(1)


def default_uris(job: JobConfig, datasets_bucket: str, checkpoints_bucket: str) -> tuple[str, str]:
    """(dataset manifest URI, checkpoint URI): the settings, or the documented defaults in the buckets."""
    dataset = job.dataset_uri or f"{datasets_bucket.rstrip('/')}/{job.name}/manifest.json"
    checkpoint = job.checkpoint_uri or f"{checkpoints_bucket.rstrip('/')}/{job.team}/{job.name}"
    return dataset, checkpoint


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def rendezvous_host(job_name: str) -> str:
    """Pod 0's name on the JobSet headless service: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>."""
    return f"{job_name}-{REPLICATED_JOB}-0-0.{job_name}"


def trainer_overrides(
    job: JobConfig, *, dataset_uri: str, checkpoint_uri: str, cache_endpoint: str, register_name: str
) -> list[str]:
    """The `section.key=value` overrides of the trainer (interfaces.md), job settings first, then job.overrides."""
    for key in job.overrides:
        if key in MANAGED_OVERRIDES:
            raise JobSpecError(
                f"gpu-train:job.overrides.{key} is set by gpu-train:job.{MANAGED_OVERRIDES[key]}; set that instead"
            )
    run_dir = f"{NVME_MOUNT}/runs/{job.name}"
    values: dict[str, Any] = {
        "train.steps": job.steps,
        "train.global_batch_tokens": job.global_batch_tokens,
        "checkpoint.every_steps": job.checkpoint_every,
        "checkpoint.local_dir": f"{run_dir}/checkpoints",
        "checkpoint.remote_uri": checkpoint_uri,
        "data.uri": dataset_uri,
        "data.cache_dir": f"{NVME_MOUNT}/cache/{job.name}",
        "tracking.experiment": job.name,
        "tracking.register_name": register_name,
    }
    if cache_endpoint:
        values["data.endpoint_url"] = cache_endpoint
    values.update(job.overrides)
    return [f"{k}={_fmt(v)}" for k, v in values.items()]


def torchrun_args(job: JobConfig, *, gpus: int, overrides: Sequence[str]) -> list[str]:
    """Arguments of the launcher (= torchrun's), per the trainer command line in interfaces.md."""
    lo, hi = parse_nodes(job.nodes)
    return [
        f"--nnodes={lo}:{hi}",
        f"--nproc-per-node={gpus}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_host(job.name)}:{RDZV_PORT}",
        f"--rdzv-id={job.name}",
        f"--rdzv-conf=join_timeout={RDZV_JOIN_TIMEOUT_S}",
        f"--max-restarts={job.max_restarts}",
        "-m", "trainer",
        "--preset", job.preset,
        "--run-dir", f"{NVME_MOUNT}/runs/{job.name}",
        *overrides,
    ]


def pod_labels(job: JobConfig) -> dict[str, str]:
    return {**APP_LABELS, "app.kubernetes.io/instance": job.name, naming.TEAM_LABEL: job.team}


def jobset_manifest(
    *,
    job: JobConfig,
    pool: GpuPool,
    cloud: str,
    region: str,
    image: str,
    local_queue: str,
    dataset_uri: str,
    checkpoint_uri: str,
    nvme_host_path: str,
    datasets_bucket: str = "",
    cache_endpoint: str = "",
    tracking_uri: str = "",
    register_name: str = "",
) -> dict[str, Any]:
    """The JobSet for the stack's job, as a plain dict (all inputs resolved).

    With a cache endpoint, a dataset under the datasets bucket is read through the Alluxio S3 proxy
    under its proxy name (cache.proxy_dataset_uri); anything else is read from the object store
    directly. Checkpoints always go to the object store: the cache is a read-only view."""
    if pool.name != job.pool:
        raise JobSpecError(f"gpu-train:job.pool is {job.pool!r} but the pool given is {pool.name!r}")
    gpus = job.gpus_per_node or pool.gpus_per_node
    if not 1 <= gpus <= pool.gpus_per_node:
        raise JobSpecError(
            f"gpu-train:job.gpusPerNode {job.gpus_per_node} must be 0 (all) or 1..{pool.gpus_per_node} "
            f"for pool {pool.name!r} ({pool.instance_type})"
        )
    lo, hi = parse_nodes(job.nodes)
    if hi > pool.max_nodes:
        raise JobSpecError(f"gpu-train:job.nodes MAX {hi} is more than pool {pool.name!r} maxNodes {pool.max_nodes}")
    if not local_queue:
        raise JobSpecError(f"no Kueue LocalQueue for gpu-train:job.team {job.team!r}")
    digest = image_digest(image)
    namespace = naming.team_namespace(job.team)
    cpu, memory, shm = pod_resources(cloud, pool.instance_type)
    fabric = pool.fabric
    labels = pod_labels(job)

    env: dict[str, str] = {
        "TRAINER_METRICS_PORT": str(naming.METRICS_PORT),
        "TRAINER_IMAGE_DIGEST": digest,
        # Writable places under a read-only root filesystem: home and matplotlib's cache in /tmp, the
        # compiler caches on the node's NVMe so torch.compile reuses them across restarts on that node.
        "HOME": "/tmp",
        "MPLCONFIGDIR": "/tmp/matplotlib",
        "TRITON_CACHE_DIR": f"{NVME_MOUNT}/cache/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{NVME_MOUNT}/cache/inductor",
        # Elastic restarts must not hang on a dead peer: surface NCCL errors as exceptions.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    if cloud == "aws":
        env["AWS_REGION"] = region
    clash = sorted(set(env) & set(fabric.nccl_env))
    if clash:
        raise JobSpecError(f"pool {pool.name!r} fabric.nccl_env sets {clash}, which the job sets itself")
    env.update(fabric.nccl_env)

    extended = {GPU_RESOURCE: str(gpus), **{k: str(v) for k, v in fabric.resources.items()}}
    ports = [
        {"name": f"metrics-{rank}", "containerPort": naming.METRICS_PORT + rank, "protocol": "TCP"}
        for rank in range(gpus)
    ] + [{"name": "rendezvous", "containerPort": RDZV_PORT, "protocol": "TCP"}]
    proxied = proxy_dataset_uri(dataset_uri, datasets_bucket) if cache_endpoint and datasets_bucket else None
    overrides = trainer_overrides(
        job, dataset_uri=proxied or dataset_uri, checkpoint_uri=checkpoint_uri,
        cache_endpoint=cache_endpoint if proxied else "", register_name=register_name or job.name,
    )
    trainer = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [LAUNCHER],
        "args": torchrun_args(job, gpus=gpus, overrides=overrides),
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": ports,
        "resources": {
            # No CPU limit: CFS throttling stalls the input pipeline and NCCL proxy threads.
            "requests": {"cpu": str(cpu), "memory": f"{memory}Gi", **extended},
            "limits": {"memory": f"{memory}Gi", **extended},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "nvme", "mountPath": NVME_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
            *[dict(m) for m in fabric.volume_mounts],
        ],
        # EFA and RDMA need locked memory for registered buffers; that comes from the node's containerd
        # (memlock unlimited on EKS and GKE GPU images), not from IPC_LOCK: Kubernetes gives added
        # capabilities to a non-root process only through ambient capabilities, which it does not set.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": naming.TRAINER_UID,
            "runAsGroup": naming.TRAINER_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    sidecars = [{**dict(s), "restartPolicy": "Always"} for s in fabric.sidecars]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": naming.TRAINER_SERVICE_ACCOUNT,
        # The trainer never calls the Kubernetes API; cloud credentials come from the workload identity.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Never: torchrun restarts failed workers inside the pod; a pod that still fails is replaced by
        # the Job (and counted against backoffLimit) and rejoins the rendezvous.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "nodeSelector": dict(pool.node_selector),
        "tolerations": [dict(t) for t in pool.tolerations],
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": job.name}},
                    "topologyKey": "kubernetes.io/hostname",
                }],
            },
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": naming.TRAINER_UID,
            "runAsGroup": naming.TRAINER_UID,
            "fsGroup": naming.TRAINER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **({"initContainers": sidecars} if sidecars else {}),
        "containers": [trainer],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm}Gi"}},
            # The namespace's directory on the node's NVMe (shard cache, checkpoints, compile caches),
            # made by the platform's NVMe DaemonSet, owned by the trainer's UID, mode 0700. Type
            # Directory: the pod waits in ContainerCreating until the DaemonSet has made it on this node.
            {"name": "nvme", "hostPath": {"path": nvme.workdir_path(nvme_host_path, namespace),
                                          "type": "Directory"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}},
            *[dict(v) for v in fabric.volumes],
        ],
    }
    pod_template = {
        "metadata": {
            "labels": labels,
            "annotations": {
                # A node being consolidated or drifted would kill the whole step; let the job finish.
                "karpenter.sh/do-not-disrupt": "true",
                "kubectl.kubernetes.io/default-container": CONTAINER,
                **dict(fabric.annotations),
            },
        },
        "spec": pod_spec,
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {
            "name": job.name,
            "namespace": namespace,
            "labels": {**labels, QUEUE_LABEL: local_queue},
            "annotations": {
                # Kueue flips spec.suspend while admitting; let `pulumi up` take the field back.
                "pulumi.com/patchForce": "true",
            },
        },
        "spec": {
            "suspend": job.suspend,
            "network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": job.max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "parallelism": hi,
                        "completions": hi,
                        "completionMode": "Indexed",
                        "backoffLimit": job.max_restarts,
                        # A spot reclaim or drain is not the trainer's fault: do not count it.
                        "podFailurePolicy": {"rules": [{
                            "action": "Ignore",
                            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                        }]},
                        "template": pod_template,
                    },
                },
            }],
        },
    }


def pod_monitor_manifest(*, job: JobConfig, gpus: int, release_labels: Mapping[str, str]) -> dict[str, Any]:
    """A PodMonitor scraping every local rank's endpoint (metrics-0..metrics-<gpus-1>) of the job's pods."""
    namespace = naming.team_namespace(job.team)
    return {
        "apiVersion": PODMONITOR_API,
        "kind": "PodMonitor",
        "metadata": {
            "name": f"{job.name}-trainer",
            "namespace": namespace,
            # kube-prometheus-stack only selects monitors carrying its release label.
            "labels": {**pod_labels(job), **release_labels},
        },
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": job.name, **APP_LABELS}},
            "namespaceSelector": {"matchNames": [namespace]},
            "podMetricsEndpoints": [
                {"port": f"metrics-{rank}", "path": "/metrics", "interval": "15s",
                 # Same `jobset` label as the monitoring layer's cluster-wide trainer PodMonitor.
                 "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_jobset_sigs_k8s_io_jobset_name"],
                                  "targetLabel": "jobset"}]}
                for rank in range(gpus)
            ],
        },
    }


@dataclass(frozen=True, kw_only=True)
class TrainingJobArgs:
    platform: ClusterPlatform  # the cloud contract: k8s provider, GPU pools, buckets, NVMe path, region
    job: JobConfig  # the stack's job settings (cfg.job)
    image: pulumi.Input[str]  # digest-pinned trainer image (TrainerImage.ref)
    local_queue: pulumi.Input[str]  # the team's Kueue LocalQueue (KubernetesLayer.local_queue[team])
    # Labels the monitoring release selects PodMonitors by (KubernetesLayer.monitoring_release_label).
    monitoring_labels: Mapping[str, str] = field(default_factory=lambda: {"release": naming.MONITORING_RELEASE})
    cache_endpoint: pulumi.Input[str] = ""  # Alluxio S3 proxy URL; "" = read the datasets bucket directly
    tracking_uri: pulumi.Input[str] = ""  # MLflow tracking URL; "" = the trainer's local store on NVMe
    register_name: str = ""  # MLflow registered model name for the final model ("" = the job name)
    # Create this job's PodMonitor; off when a cluster-wide PodMonitor already scrapes every JobSet's
    # metrics-<rank> ports (two monitors on the same port would store every series twice).
    pod_monitor: bool = True
    depends_on: Sequence[pulumi.Resource] = ()  # what must exist first (KubernetesLayer.ready: CRDs, queues, SA)


class TrainingJob(pulumi.ComponentResource):
    """The JobSet and its PodMonitor in the team's namespace."""

    job_name: pulumi.Output[str]
    namespace: pulumi.Output[str]

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:TrainingJob", name, None, opts)
        job, platform = args.job, args.platform
        pool = platform.pool(job.pool)
        gpus = job.gpus_per_node or pool.gpus_per_node

        def build(values: list[Any]) -> dict[str, Any]:
            image, queue, datasets, checkpoints, cache, tracking = values
            dataset_uri, checkpoint_uri = default_uris(job, datasets, checkpoints)
            return jobset_manifest(
                job=job, pool=pool, cloud=platform.cloud, region=platform.region, image=image,
                local_queue=queue, dataset_uri=dataset_uri, checkpoint_uri=checkpoint_uri,
                nvme_host_path=platform.nvme_host_path, datasets_bucket=datasets,
                cache_endpoint=cache or "", tracking_uri=tracking or "",
                register_name=args.register_name,
            )

        manifest = pulumi.Output.all(
            args.image, args.local_queue, platform.buckets.datasets, platform.buckets.checkpoints,
            args.cache_endpoint, args.tracking_uri,
        ).apply(build)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=platform.provider, depends_on=list(args.depends_on))
        self.jobset = k8s.apiextensions.CustomResource(
            f"{name}-jobset",
            api_version=JOBSET_API,
            kind="JobSet",
            metadata=manifest.apply(lambda m: m["metadata"]),
            spec=manifest.apply(lambda m: m["spec"]),
            # JobSet rejects changes to a running job's template; anything but `suspend` recreates the
            # JobSet, which resumes from the newest checkpoint in object storage.
            opts=pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(
                replace_on_changes=["spec.replicatedJobs", "spec.network", "spec.failurePolicy",
                                    "spec.successPolicy"],
                delete_before_replace=True,
            )),
        )
        self.pod_monitor = None
        if args.pod_monitor:
            monitor = pod_monitor_manifest(job=job, gpus=gpus, release_labels=dict(args.monitoring_labels))
            self.pod_monitor = k8s.apiextensions.CustomResource(
                f"{name}-podmonitor",
                api_version=PODMONITOR_API,
                kind="PodMonitor",
                metadata=monitor["metadata"],
                spec=monitor["spec"],
                opts=k8s_opts,
            )
        self.job_name = pulumi.Output.from_input(job.name)
        self.namespace = pulumi.Output.from_input(naming.team_namespace(job.team))
        self.register_outputs({"jobName": self.job_name, "namespace": self.namespace})

