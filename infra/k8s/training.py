"""The stack's training job: a JobSet running `torchrun ... -m trainer` on one GPU pool, queued by Kueue.

Usage (in infra/__main__.py, after the image, the Kubernetes layer and MLflow):
    problems = admission_problems(job=cfg.job, teams=cfg.teams, pools=platform.gpu_pools, ...)
    job = TrainingJob("job", TrainingJobArgs(platform=platform, job=cfg.job, image=image.ref, ...))
    pulumi.export("jobName", job.job_name)

Pure builders, tested without mocks: `jobset_manifest(...)` (the JobSet, from plain data only: the one
renderer, which `gpu-train submit` (gpu_train_cli/jobs.py) feeds from the platform contract the stack
exports, infra/k8s/contract.py), `job_local_queue(...)` (the job's own LocalQueue, whose stopPolicy
pauses it) and `pod_monitor_manifest(...)`. `admission_problems(...)` renders the JobSet and the
tenancy's Kueue objects and asks infra/k8s/admission.py, through `kueue_problems(...)` (which
`gpu-train submit` calls with the contract's Kueue objects), whether Kueue admits the job and its pods
fit their nodes.

Shape of the job (docs/deploy-job.md has the reasons and what happens on each failure):
- one replicated job "worker" of MAX pods (Indexed Job), one pod per node (required pod anti-affinity
  on the hostname), on the pool's nodes (node selector and tolerations from the contract);
- Kueue admits the JobSet whole, MAX pods at once (it cannot admit part of a JobSet); torchrun's
  `--nnodes=MIN:MAX` elastic rendezvous keeps training while at least MIN nodes are present: a lost
  node's pod is replaced by the Job controller and rejoins when a node is back;
- failures: exit code 2 of the `trainer` container (bad input) fails the Job at once (podFailurePolicy
  FailJob) and so the JobSet (failurePolicy rule FailJobSet on reason PodFailurePolicy); a pod
  evicted for disruption (DisruptionTarget: spot reclaim, drain, node loss) is replaced without
  counting; any other failure counts against the Job's backoffLimit, then the JobSet's maxRestarts;
- success: index 0 exiting 0 completes the Job (successPolicy), and the trainer exits 0 only after
  every step; pods still waiting for a node are then removed;
- the JobSet is created suspended and Pulumi never touches `spec.suspend` again (Kueue owns it);
  pause and resume go through the job's own LocalQueue: `stopPolicy: HoldAndDrain` evicts the
  workload and releases its quota, `None` lets Kueue admit it again;
- torchrun's shutdown timeout is the pod's grace period less a margin, and the rendezvous waits at
  least as long as Kueue gives the pods to become ready;
- the fabric (EFA / GPUDirect-TCPX(O) / RDMA) comes only from the contract: extended resources, pod
  annotations, NCCL env, host volumes and sidecars.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import naming
from infra.config import MANAGED_OVERRIDES, PROJECT, JobConfig, TeamConfig, override_text
from infra.k8s import admission, nvme, tenancy
from infra.k8s.cache import proxy_dataset_uri
from infra.platform import ClusterPlatform, GpuPool
from trainer.watchdog import nccl_env

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PODMONITOR_API = "monitoring.coreos.com/v1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
REPLICATED_JOB = "worker"
CONTAINER = "trainer"
LAUNCHER = "gpu-train-launch"  # trainer/entrypoint.sh in the image: waits for rendezvous DNS, execs torchrun
RDZV_PORT = 29400
# SIGTERM -> the trainer writes a final checkpoint and uploads it. 300 s covers a synchronous save of the
# 7b preset's sharded state to local NVMe plus the upload of one checkpoint at object-store speeds.
TERMINATION_GRACE_S = 300
# torchrun forwards SIGTERM to its workers and kills them --shutdown-timeout seconds later (default 30,
# torch/distributed/run.py and TORCH_ELASTIC_SHUTDOWN_TIMEOUT); the workers get the grace period less
# this margin, in which torchrun reaps them and exits before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_S = 15
NVME_MOUNT = "/mnt/nvme"
GPU_RESOURCE = "nvidia.com/gpu"
APP_LABELS = {"app.kubernetes.io/name": "gpu-train-trainer", "app.kubernetes.io/part-of": "gpu-train"}
# The trainer's "bad input" exit code: settings, a missing or malformed dataset, an incompatible
# checkpoint. Retrying cannot help, so it fails the whole JobSet.
BAD_INPUT_EXIT_CODE = 2
BAD_INPUT_RULE = "BadInput"
# Smallest share of a node the trainer is given: below this, the pool's instance type is too small
# once the node agents have their share.
MIN_TRAINER_CPU = 1
MIN_TRAINER_MEMORY_GIB = 4
# An image reference for rendering the JobSet before the real image exists (admission_problems).
PLACEHOLDER_IMAGE = "registry.invalid/gpu-train/trainer@sha256:" + "0" * 64


class JobSpecError(ValueError):
    """The job settings cannot be turned into a JobSet; the message names the setting."""


def parse_nodes(nodes: str) -> tuple[int, int]:
    m = re.fullmatch(r"([0-9]+):([0-9]+)", nodes)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise JobSpecError(f"gpu-train:job.nodes must be MIN:MAX with 1 <= MIN <= MAX (got {nodes!r})")
    return int(m.group(1)), int(m.group(2))


def node_shape(cloud: str, instance_type: str) -> tuple[int, int]:
    """(vCPUs, memory GiB) of a GPU instance type, from the cloud's catalog."""
    vcpus, memory_gib, _, _ = admission.instance_shape(cloud, instance_type)
    return vcpus, memory_gib


def pod_resources(cloud: str, instance_type: str, gpus: int | None = None,
                  sidecars: Sequence[Mapping[str, Any]] = ()) -> tuple[int, int, int]:
    """(CPU request, memory GiB request = limit, /dev/shm GiB) of a one-pod-per-node worker using `gpus`
    of the node's GPUs (default all): that share of what the node leaves after its agents
    (admission.gpu_node_capacity), less the pod's sidecars, rounded down."""
    node = admission.gpu_node_capacity(cloud, instance_type)
    share = Fraction(gpus if gpus is not None else node.gpus, node.gpus)
    side = admission.pod_requests({"initContainers": [{**dict(c), "restartPolicy": "Always"} for c in sidecars]})
    cpu = math.floor(node.cpu * share - side.get("cpu", 0))
    memory = math.floor((node.memory * share - side.get("memory", 0)) / admission.GIB)
    if cpu < MIN_TRAINER_CPU or memory < MIN_TRAINER_MEMORY_GIB:
        raise JobSpecError(
            f"{instance_type} leaves the trainer {max(cpu, 0)} CPUs and {max(memory, 0)} GiB after the node's "
            f"agents ({admission.format_quantity('cpu', admission.GPU_NODE_AGENTS.cpu)} CPUs, "
            f"{admission.format_quantity('memory', admission.GPU_NODE_AGENTS.memory)}) and sidecars; it needs "
            f"at least {MIN_TRAINER_CPU} CPU and {MIN_TRAINER_MEMORY_GIB} GiB: use a larger instance type")
    # /dev/shm (tmpfs, charged to the pod's memory when used): NCCL's shared-memory transport and
    # torch's inter-process tensors. A quarter of the pod's memory leaves the rest for the trainer.
    return cpu, memory, max(1, memory // 4)


def shutdown_timeout_s(grace_s: int = TERMINATION_GRACE_S) -> int:
    """torchrun's --shutdown-timeout for a pod with this termination grace period."""
    if grace_s <= SHUTDOWN_MARGIN_S:
        raise JobSpecError(f"a termination grace period of {grace_s} s leaves torchrun no time to stop its "
                           f"workers (it needs more than {SHUTDOWN_MARGIN_S} s)")
    return grace_s - SHUTDOWN_MARGIN_S


def job_queue_name(job: JobConfig) -> str:
    """The job's own LocalQueue. Team queues are `<team>-queue`: no name can be both."""
    return f"{job.name}-job"


def job_local_queue(job: JobConfig) -> dict[str, Any]:
    """The LocalQueue the stack's job is submitted to, in the team namespace, feeding the team's
    ClusterQueue. `job.suspend` sets its stopPolicy: HoldAndDrain evicts the admitted workload
    (pods get SIGTERM and checkpoint; the quota is released) and holds it; None admits it again."""
    return {
        "apiVersion": tenancy.KUEUE_API, "kind": "LocalQueue",
        "metadata": {"name": job_queue_name(job), "namespace": naming.team_namespace(job.team),
                     "labels": {**APP_LABELS, "app.kubernetes.io/instance": job.name}},
        "spec": {"clusterQueue": tenancy.cluster_queue_name(job.team),
                 "stopPolicy": "HoldAndDrain" if job.suspend else "None"},
    }


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
    return [override_text(k, v) for k, v in values.items()]


def torchrun_args(job: JobConfig, *, gpus: int, overrides: Sequence[str]) -> list[str]:
    """Arguments of the launcher (= torchrun's), per the trainer command line in interfaces.md."""
    lo, hi = parse_nodes(job.nodes)
    return [
        f"--nnodes={lo}:{hi}",
        f"--nproc-per-node={gpus}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_host(job.name)}:{RDZV_PORT}",
        f"--rdzv-id={job.name}",
        # How long the agents wait for MIN nodes: at least Kueue's pods-ready timeout (config check).
        f"--rdzv-conf=join_timeout={job.rendezvous_timeout_minutes * 60}",
        f"--max-restarts={job.max_restarts}",
        f"--shutdown-timeout={shutdown_timeout_s()}",
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
    cpu, memory, shm = pod_resources(cloud, pool.instance_type, gpus, pool.fabric.sidecars)
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
        # NCCL's watchdog agrees with the trainer's (trainer/watchdog.py, nccl_env(); torch 2.13 names): a
        # collective that errors or times out tears the process down without a communicator abort that can
        # itself hang (3 = SkipCleanUp), after dumping the flight recorder to the node's NVMe beside the run;
        # the heartbeat monitor stays on. The worker sets the timeouts from its watchdog settings.
        **nccl_env(),
        "TORCH_FR_DUMP_TEMP_FILE": f"{NVME_MOUNT}/runs/{job.name}/nccl_trace_rank_",
        # Each rendezvous round gets a fresh store instead of the agent's shared TCPStore, whose keys
        # would go stale when the agents' restart counts differ after one node fails
        # (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, use_agent_store); the trainer
        # relies on it.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # The launcher waits this long for the dataset manifest, then exits 2 (fails the JobSet).
        "TRAINER_DATA_WAIT_S": str(job.data_wait_minutes * 60),
        # ... and this long for pod 0's DNS name (the rendezvous host), as long as torchrun's join.
        "RDZV_DNS_TIMEOUT": str(job.rendezvous_timeout_minutes * 60),
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
        },
        "spec": {
            # Created suspended, as Kueue expects; from then on Kueue alone sets this field (pausing
            # goes through the LocalQueue's stopPolicy).
            "suspend": True,
            "network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": job.max_restarts,
                # A Job failed by its podFailurePolicy (exit code 2: bad input) fails the JobSet at once;
                # any other Job failure restarts the JobSet, up to maxRestarts (the default action).
                "rules": [{"name": BAD_INPUT_RULE, "action": "FailJobSet",
                           "onJobFailureReasons": ["PodFailurePolicy"],
                           "targetReplicatedJobs": [REPLICATED_JOB]}],
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": job_spec(job, pod_template),
                },
            }],
        },
    }


def job_spec(job: JobConfig, pod_template: Mapping[str, Any]) -> dict[str, Any]:
    """The worker Job: MAX indexed pods, the failure rules, and success when pod 0 succeeds."""
    _, hi = parse_nodes(job.nodes)
    return {
        "parallelism": hi,
        "completions": hi,
        "completionMode": "Indexed",
        # One group failure (say the rendezvous host's node goes) can fail every pod at once.
        "backoffLimit": job.max_restarts * hi,
        "podFailurePolicy": {"rules": [
            # A spot reclaim, drain or node loss is not the trainer's fault: replace the pod, do not
            # count it. First, so a disrupted pod never reads as bad input.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Bad input: retrying cannot help.
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": [BAD_INPUT_EXIT_CODE]}},
        ]},
        # The trainer exits 0 only after the last step, on every rank; pod 0 (rank 0's node) succeeding
        # completes the Job, even when some indexes are still waiting for a node.
        "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
        "template": dict(pod_template),
    }


def admission_problems(*, job: JobConfig, teams: Sequence[TeamConfig], pools: Sequence[GpuPool], cloud: str,
                       region: str, nvme_host_path: str) -> list[str]:
    """Render the job's JobSet and the Kueue objects Tenancy creates, and report (naming the setting)
    whatever would keep Kueue from admitting the job in an empty cluster, or its pods from fitting
    on a node of their pool."""
    k = f"{PROJECT}:"
    pool = next((p for p in pools if p.name == job.pool), None)
    team = next((t for t in teams if t.name == job.team), None)
    if pool is None or team is None:
        return [f"{k}job names pool {job.pool!r} and team {job.team!r}, which the platform does not have"]
    pool_key = f"{k}gpuPools[{[p.name for p in pools].index(pool.name)}]"
    team_key = f"{k}teams[{list(teams).index(team)}].gpuQuota"
    bucket = "s3://bucket" if cloud == "aws" else "gs://bucket"
    try:
        jobset = jobset_manifest(job=job, pool=pool, cloud=cloud, region=region, image=PLACEHOLDER_IMAGE,
                                 local_queue=job_queue_name(job), dataset_uri=f"{bucket}/{job.name}/manifest.json",
                                 checkpoint_uri=f"{bucket}/{job.team}/{job.name}", nvme_host_path=nvme_host_path)
    except JobSpecError as exc:
        text = str(exc)
        return [text if text.startswith(k) else f"{pool_key}.instanceType: {text}"]
    queue_problems, fit_problems = kueue_problems(
        jobset, pool=pool, cloud=cloud, namespace_labels=tenancy.namespace_labels(job.team),
        local_queues=[job_local_queue(job), tenancy.local_queue(job.team)], queue_name=job_queue_name(job),
        cluster_queues=tenancy.cluster_queues(teams, pools), flavors=[tenancy.resource_flavor(p) for p in pools],
        limit_range=tenancy.limit_range(), excluded_prefixes=tenancy.EXCLUDED_RESOURCE_PREFIXES)
    problems = []
    for problem in queue_problems:
        where = team_key if "insufficient quota" in problem else f"{k}job"
        problems.append(f"{where}: Kueue would not admit job {job.name!r} ({admission.workload_pod_sets(jobset)[0].count} "
                        f"pods, admitted whole): {problem}")
    for problem in fit_problems:
        problems.append(f"{pool_key}.instanceType: a pod of job {job.name!r} does not fit a {pool.instance_type} "
                        f"node: {problem}")
    return problems


def kueue_problems(jobset: Mapping[str, Any], *, pool: GpuPool, cloud: str, namespace_labels: Mapping[str, str],
                   local_queues: Sequence[Mapping[str, Any]], queue_name: str,
                   cluster_queues: Sequence[Mapping[str, Any]], flavors: Sequence[Mapping[str, Any]],
                   limit_range: Mapping[str, Any], excluded_prefixes: Sequence[str]) -> tuple[list[str], list[str]]:
    """(why Kueue would never admit this JobSet, even in an empty cluster; why its pods would not fit a node of
    their pool) against the given Kueue objects: the stack's own (admission_problems) or the ones a platform
    contract carries (`gpu-train submit`)."""
    limits = [{"spec": dict(limit_range)}]
    result = admission.admit(
        admission.workload_pod_sets(jobset), namespace=jobset["metadata"]["namespace"],
        namespace_labels=namespace_labels, local_queues=local_queues, queue_name=queue_name,
        cluster_queues=cluster_queues, flavors=flavors, limit_ranges=limits, excluded_prefixes=tuple(excluded_prefixes))
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    fits = admission.pod_fits_node(pod_spec, admission.gpu_node_capacity(cloud, pool.instance_type), GPU_RESOURCE,
                                   limits)
    return list(result.problems), list(fits)


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
    # Labels the monitoring release selects PodMonitors by (KubernetesLayer.monitoring_release_label).
    monitoring_labels: Mapping[str, str] = field(default_factory=lambda: {"release": naming.MONITORING_RELEASE})
    cache_endpoint: pulumi.Input[str] = ""  # Alluxio S3 proxy URL; "" = read the datasets bucket directly
    tracking_uri: pulumi.Input[str] = ""  # MLflow tracking URL; "" = the trainer's local store on NVMe
    register_name: str = ""  # MLflow registered model name for the final model ("" = the job name)
    # Create this job's PodMonitor; off when a cluster-wide PodMonitor already scrapes every JobSet's
    # metrics-<rank> ports (two monitors on the same port would store every series twice).
    pod_monitor: bool = True
    # What must exist first (KubernetesLayer.ready: CRDs, the team's namespace and ClusterQueue, SA).
    depends_on: Sequence[pulumi.Resource] = ()


class TrainingJob(pulumi.ComponentResource):
    """The job's LocalQueue, its JobSet and its PodMonitor in the team's namespace."""

    job_name: pulumi.Output[str]
    namespace: pulumi.Output[str]
    local_queue: pulumi.Output[str]

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:TrainingJob", name, None, opts)
        job, platform = args.job, args.platform
        pool = platform.pool(job.pool)
        gpus = job.gpus_per_node or pool.gpus_per_node
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=platform.provider, depends_on=list(args.depends_on))

        lq = job_local_queue(job)
        # Declarative pause: `pulumi up` with job.suspend sets stopPolicy; Kueue does the rest.
        self.queue = k8s.apiextensions.CustomResource(
            f"{name}-localqueue", api_version=lq["apiVersion"], kind=lq["kind"],
            metadata=lq["metadata"], spec=lq["spec"], opts=k8s_opts)

        def build(values: list[Any]) -> dict[str, Any]:
            image, datasets, checkpoints, cache, tracking = values
            dataset_uri, checkpoint_uri = default_uris(job, datasets, checkpoints)
            return jobset_manifest(
                job=job, pool=pool, cloud=platform.cloud, region=platform.region, image=image,
                local_queue=job_queue_name(job), dataset_uri=dataset_uri, checkpoint_uri=checkpoint_uri,
                nvme_host_path=platform.nvme_host_path, datasets_bucket=datasets,
                cache_endpoint=cache or "", tracking_uri=tracking or "",
                register_name=args.register_name,
            )

        manifest = pulumi.Output.all(
            args.image, platform.buckets.datasets, platform.buckets.checkpoints,
            args.cache_endpoint, args.tracking_uri,
        ).apply(build)
        self.jobset = k8s.apiextensions.CustomResource(
            f"{name}-jobset",
            api_version=JOBSET_API,
            kind="JobSet",
            metadata=manifest.apply(lambda m: m["metadata"]),
            spec=manifest.apply(lambda m: m["spec"]),
            opts=pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(
                depends_on=[self.queue],
                # Kueue owns spec.suspend once the JobSet exists: with ignoreChanges the provider leaves
                # the field out of its server-side apply while another manager owns it
                # (https://github.com/pulumi/pulumi-kubernetes/pull/2566), so `pulumi up` never flips it.
                ignore_changes=["spec.suspend"],
                # JobSet rejects changes to a running job's template; any other change recreates the
                # JobSet, which resumes from the newest checkpoint in object storage.
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
        self.local_queue = pulumi.Output.from_input(job_queue_name(job))
        self.register_outputs({"jobName": self.job_name, "namespace": self.namespace,
                               "localQueue": self.local_queue})
