"""The one JobSet renderer: a job spec and where it runs -> the JobSet, as a plain dict.

Usage:
    placement = Placement.from_contract(contract, job)            # `gpu-train submit`: the team's queue
    manifest = jobset(job, placement)                             # the stack's job and every team job alike
    local_queue(job)                                              # the stack job's own LocalQueue (pausable)

The stack's job (infra/k8s/training.py), `gpu-train submit` and every later consumer render here, from the job
spec (gpu_train.spec.job) and the platform's facts (gpu_train.spec.contract: the pool with its fabric and what
its nodes leave to a pod, the image, the queue, buckets and endpoints). The launcher's arguments and environment
come from gpu_train.jobs.launch. docs/deploy-job.md gives the reasons; in short:
- one replicated job "worker" of MAX pods (Indexed Job), one pod per node (required pod anti-affinity on the
  hostname), on the pool's nodes; Kueue admits the JobSet whole, and torchrun's elastic `--nnodes=MIN:MAX`
  keeps training while at least MIN nodes are present;
- exit code 2 of the container (bad input) fails the Job at once (podFailurePolicy FailJob) and so the JobSet
  (failurePolicy FailJobSet on reason PodFailurePolicy); a pod evicted for disruption is replaced without
  counting; any other failure counts against backoffLimit, then the JobSet's maxRestarts;
- index 0 exiting 0 completes the Job (successPolicy); the trainer exits 0 only after every step;
- created suspended: Kueue alone sets `spec.suspend` afterwards;
- the fabric (EFA / GPUDirect-TCPX(O) / RDMA) and the cloud's environment come only from the contract;
- where it came from, as annotations (Provenance): the config hash always, the spec file's path and the git commit
  when known. The config hash is the sha256 of the canonical JSON (sorted keys, no spaces) of the JobSet's labels
  and spec as rendered, so a change of the spec file, of the platform it runs on (image, pool, buckets, endpoints)
  or of this renderer changes it, and an equal hash means an identical JobSet (`gpu-train apply`, docs/gitops.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpu_train.jobs import fit, launch
from gpu_train.jobs.pods import container_security, gpu_resources, pod_security, pool_scheduling
from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool, PlatformContract
from gpu_train.spec.errors import EXIT_BAD_INPUT
from gpu_train.spec.job import JobSpec, gpus_per_node, trainer_settings

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # the Workload's WorkloadPriorityClass (Kueue's job label)
REPLICATED_JOB = naming.REPLICATED_JOB
CONTAINER = "trainer"
NVME_MOUNT = "/mnt/nvme"
APP_LABELS = {"app.kubernetes.io/name": "gpu-train-trainer", "app.kubernetes.io/part-of": "gpu-train"}
BAD_INPUT_RULE = "BadInput"
# Provenance annotations on every JobSet (docs/gitops.md).
HASH_ANNOTATION = "gpu-train.io/config-hash"
PATH_ANNOTATION = "gpu-train.io/spec-path"
COMMIT_ANNOTATION = "gpu-train.io/git-commit"
# Set on the JobSets `gpu-train apply` creates: the ones it may replace and prune.
MANAGED_ANNOTATION = "gpu-train.io/managed-by"
MANAGED_BY_APPLY = "gpu-train-apply"
# Smallest share of a node the trainer is given: below this, the pool's instance type is too small once the node
# agents have their share.
MIN_TRAINER_CPU = 1
MIN_TRAINER_MEMORY_GIB = 4


class JobSpecError(ValueError):
    """The job cannot be turned into a JobSet on this platform; the message names the setting."""


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where a job's spec came from: its file (relative to the repository root when in one), the git commit it was
    read at ("" when unknown or the file has uncommitted changes) and whether `gpu-train apply` manages it."""

    path: str = ""
    commit: str = ""
    applied: bool = False


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a job runs: everything the renderer needs besides the job spec, all values resolved."""

    pool: GpuPool
    image: str  # digest-pinned: the platform's trainer image (a job naming its own image runs that instead)
    queue: str  # the Kueue LocalQueue it is submitted to
    nvme_host_path: str
    datasets_bucket: str
    checkpoints_bucket: str
    cache_endpoint: str = ""  # the Alluxio S3 proxy; "" = read the object store directly
    tracking_uri: str = ""  # MLflow; "" = the trainer's local store on the node's NVMe
    register_name: str = ""  # MLflow registered model name ("" = the job name)
    pod_env: Mapping[str, str] = field(default_factory=dict)  # what the cloud gives every training container
    cloud: str = ""  # aws | gcp, for the trainer's carbon factors ("" = not known)
    region: str = ""
    provenance: Provenance = field(default_factory=Provenance)

    @classmethod
    def from_contract(cls, contract: PlatformContract, job: JobSpec, *, image: str = "",
                      queue: str = "", provenance: Provenance | None = None) -> Placement:
        """A team job on this platform: its pool, the platform's image (or `image`), the team's LocalQueue."""
        return cls(pool=contract.pool(job.pool), image=image or contract.image,
                   queue=queue or contract.team(job.team).local_queue, nvme_host_path=contract.nvme_host_path,
                   datasets_bucket=contract.bucket("datasets"), checkpoints_bucket=contract.bucket("checkpoints"),
                   cache_endpoint=contract.endpoints.cache, tracking_uri=contract.endpoints.tracking,
                   pod_env=dict(contract.pod_env), cloud=contract.cloud, region=contract.region,
                   provenance=provenance or Provenance())


def image_digest(image: str) -> str:
    """The sha256:... part of a digest-pinned image reference; a tag-only image is refused."""
    m = re.fullmatch(r"[^@\s]+@(sha256:[0-9a-f]{64})", image)
    if not m:
        raise JobSpecError(f"the trainer image must be pinned by digest (repo@sha256:<64 hex>), got {image!r}")
    return m.group(1)


def default_uris(job: JobSpec, datasets_bucket: str, checkpoints_bucket: str) -> tuple[str, str]:
    """(dataset manifest URI, checkpoint URI): the settings, or the documented defaults in the buckets."""
    dataset = job.dataset_uri or f"{datasets_bucket.rstrip('/')}/{job.name}/manifest.json"
    checkpoint = job.checkpoint_uri or f"{checkpoints_bucket.rstrip('/')}/{job.team}/{job.name}"
    return dataset, checkpoint


def rendezvous_host(job_name: str) -> str:
    """Pod 0's name on the JobSet headless service: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>."""
    return f"{job_name}-{REPLICATED_JOB}-0-0.{job_name}"


def pod_labels(job: JobSpec) -> dict[str, str]:
    return {**APP_LABELS, "app.kubernetes.io/instance": job.name, naming.TEAM_LABEL: job.team}


def pod_resources(pool: GpuPool, gpus: int) -> tuple[int, int, int]:
    """(CPU request, memory GiB request = limit, /dev/shm GiB) of a one-pod-per-node worker using `gpus` of the
    node's GPUs: that share of what a node of the pool leaves to training pods, less the pod's sidecars."""
    if pool.allocatable is None:
        raise JobSpecError(f"pool {pool.name!r} does not say what its nodes leave to a pod (allocatable)")
    share = Fraction(gpus, pool.gpus_per_node)
    side = fit.pod_requests({"initContainers": [{**c, "restartPolicy": "Always"} for c in pool.fabric.sidecars]})
    cpu = math.floor(fit.quantity(pool.allocatable.cpu) * share - side.get("cpu", 0))
    memory = math.floor((fit.quantity(pool.allocatable.memory) * share - side.get("memory", 0)) / fit.GIB)
    if cpu < MIN_TRAINER_CPU or memory < MIN_TRAINER_MEMORY_GIB:
        raise JobSpecError(
            f"{pool.instance_type} leaves the trainer {max(cpu, 0)} CPUs and {max(memory, 0)} GiB after the node's "
            f"agents and sidecars; it needs at least {MIN_TRAINER_CPU} CPU and {MIN_TRAINER_MEMORY_GIB} GiB: use a "
            "larger instance type")
    # /dev/shm (tmpfs, charged to the pod's memory when used): NCCL's shared-memory transport and torch's
    # inter-process tensors. A quarter of the pod's memory leaves the rest for the trainer.
    return cpu, memory, max(1, memory // 4)


def local_queue(job: JobSpec) -> dict[str, Any]:
    """The stack job's own LocalQueue in the team namespace, feeding the team's ClusterQueue. `job.suspend` sets
    its stopPolicy: HoldAndDrain evicts the admitted workload (pods get SIGTERM and checkpoint; the quota is
    released) and holds it; None admits it again."""
    return {
        "apiVersion": KUEUE_API, "kind": "LocalQueue",
        "metadata": {"name": naming.job_queue_name(job.name), "namespace": naming.team_namespace(job.team),
                     "labels": {**APP_LABELS, "app.kubernetes.io/instance": job.name}},
        "spec": {"clusterQueue": naming.cluster_queue_name(job.team),
                 "stopPolicy": "HoldAndDrain" if job.suspend else "None"},
    }


def site(job: JobSpec, where: Placement) -> launch.Site:
    """Where the job runs on this platform, as the launcher's environment names it: its directory on the node's
    NVMe, its buckets (the dataset through the read cache when the cache serves its bucket), MLflow, metrics."""
    dataset_uri, checkpoint_uri = default_uris(job, where.datasets_bucket, where.checkpoints_bucket)
    proxied = (naming.proxy_dataset_uri(dataset_uri, where.datasets_bucket)
               if where.cache_endpoint and where.datasets_bucket else None)
    return launch.Site(run_dir=f"{NVME_MOUNT}/runs/{job.name}", dataset_uri=proxied or dataset_uri,
                       checkpoint_uri=checkpoint_uri, data_cache_dir=f"{NVME_MOUNT}/cache/{job.name}",
                       data_endpoint=where.cache_endpoint if proxied else "", tracking_uri=where.tracking_uri,
                       metrics_port=naming.METRICS_PORT, cloud=where.cloud if where.region else "",
                       region=where.region if where.cloud else "", image_digest=image_digest(job.image or where.image))


def container_env() -> dict[str, str]:
    """Writable places under a read-only root filesystem: home and matplotlib's cache in /tmp, the compiler caches
    on the node's NVMe so torch.compile reuses them across restarts on that node."""
    return {"HOME": "/tmp", "MPLCONFIGDIR": "/tmp/matplotlib", "TRITON_CACHE_DIR": f"{NVME_MOUNT}/cache/triton",
            "TORCHINDUCTOR_CACHE_DIR": f"{NVME_MOUNT}/cache/inductor"}


def trainer_env(job: JobSpec, where: Placement) -> dict[str, str]:
    """The training container's environment: the job's (gpu_train.spec.env.JOB_ENV), the
    container's writable places, then the cloud's and the fabric's."""
    env = {**launch.launch_env(job, site(job, where)), **container_env()}
    env.update(where.pod_env)
    fabric_env = where.pool.fabric.nccl_env
    clash = sorted(set(env) & set(fabric_env))
    if clash:
        raise JobSpecError(f"pool {where.pool.name!r} fabric.nccl_env sets {clash}, which the job sets itself")
    return {**env, **fabric_env}


def trainer_container(job: JobSpec, where: Placement, gpus: int) -> dict[str, Any]:
    """The training container: the launcher with torchrun's arguments and the job's command, resources, mounts.
    Its image and command are all that differ between the bundled trainer and a job of a team's own code."""
    pool, here = where.pool, site(job, where)
    cpu, memory, _ = pod_resources(pool, gpus)
    settings = {**launch.bundled_settings(job, here), "tracking.register_name": where.register_name or job.name}
    extended = {**gpu_resources(gpus), **{k: str(v) for k, v in pool.fabric.resources.items()}}
    ports = [{"name": f"metrics-{rank}", "containerPort": naming.METRICS_PORT + rank, "protocol": "TCP"}
             for rank in range(gpus)] + [{"name": "rendezvous", "containerPort": launch.RDZV_PORT, "protocol": "TCP"}]
    return {
        "name": CONTAINER,
        "image": job.image or where.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [launch.LAUNCHER],
        "args": launch.torchrun_args(job, nproc=gpus, endpoint=f"{rendezvous_host(job.name)}:{launch.RDZV_PORT}",
                                     run_dir=here.run_dir, settings=trainer_settings(job, settings),
                                     shutdown_timeout=launch.shutdown_timeout_s()),
        "env": [{"name": k, "value": v} for k, v in trainer_env(job, where).items()],
        "ports": ports,
        # No CPU limit: CFS throttling stalls the input pipeline and NCCL proxy threads.
        "resources": {"requests": {"cpu": str(cpu), "memory": f"{memory}Gi", **extended},
                      "limits": {"memory": f"{memory}Gi", **extended}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "nvme", "mountPath": NVME_MOUNT},
                         {"name": "tmp", "mountPath": "/tmp"}, *copy.deepcopy(pool.fabric.volume_mounts)],
        # EFA and RDMA need locked memory for registered buffers; that comes from the node's containerd (memlock
        # unlimited on EKS and GKE GPU images), not from IPC_LOCK: Kubernetes gives added capabilities to a
        # non-root process only through ambient capabilities, which it does not set.
        "securityContext": container_security(naming.TRAINER_UID),
    }


def pod_template(job: JobSpec, where: Placement, gpus: int) -> dict[str, Any]:
    """The worker pod: one per node of the pool, the trainer plus the fabric's sidecars and volumes."""
    pool = where.pool
    _, _, shm = pod_resources(pool, gpus)
    sidecars = [{**copy.deepcopy(s), "restartPolicy": "Always"} for s in pool.fabric.sidecars]
    namespace = naming.team_namespace(job.team)
    spec: dict[str, Any] = {
        "serviceAccountName": naming.TRAINER_SERVICE_ACCOUNT,
        # The trainer never calls the Kubernetes API; cloud credentials come from the workload identity.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Never: torchrun restarts failed workers inside the pod; a pod that still fails is replaced by the Job
        # (and counted against backoffLimit) and rejoins the rendezvous.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": launch.TERMINATION_GRACE_S,
        **pool_scheduling(pool),
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": job.name}},
            "topologyKey": "kubernetes.io/hostname"}]}},
        "securityContext": pod_security(naming.TRAINER_UID),
        **({"initContainers": sidecars} if sidecars else {}),
        "containers": [trainer_container(job, where, gpus)],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm}Gi"}},
            # The namespace's directory on the node's NVMe (shard cache, checkpoints, compile caches), made by the
            # platform's NVMe DaemonSet, owned by the trainer's UID, mode 0700. Type Directory: the pod waits in
            # ContainerCreating until the DaemonSet has made it on this node.
            {"name": "nvme", "hostPath": {"path": naming.workdir_path(where.nvme_host_path, namespace),
                                          "type": "Directory"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}},
            *copy.deepcopy(pool.fabric.volumes),
        ],
    }
    return {"metadata": {"labels": pod_labels(job), "annotations": {
        # A node being consolidated or drifted would kill the whole step; let the job finish.
        "karpenter.sh/do-not-disrupt": "true",
        "kubectl.kubernetes.io/default-container": CONTAINER,
        **dict(pool.fabric.annotations)}}, "spec": spec}


def job_spec(job: JobSpec, template: Mapping[str, Any]) -> dict[str, Any]:
    """The worker Job: MAX indexed pods, the failure rules, and success when pod 0 succeeds."""
    hi = job.nodes.max
    return {
        "parallelism": hi,
        "completions": hi,
        "completionMode": "Indexed",
        # One group failure (say the rendezvous host's node goes) can fail every pod at once.
        "backoffLimit": job.max_restarts * hi,
        "podFailurePolicy": {"rules": [
            # A spot reclaim, drain or node loss is not the trainer's fault: replace the pod, do not count it.
            # First, so a disrupted pod never reads as bad input.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Bad input: retrying cannot help.
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": [EXIT_BAD_INPUT]}},
        ]},
        # The trainer exits 0 only after the last step, on every rank; pod 0 (rank 0's node) succeeding completes
        # the Job, even when some indexes are still waiting for a node.
        "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
        "template": dict(template),
    }


def jobset(job: JobSpec, where: Placement) -> dict[str, Any]:
    """The JobSet of a job placed on a platform, as a plain dict."""
    pool = where.pool
    if pool.name != job.pool:
        raise JobSpecError(f"job.pool is {job.pool!r} but the pool given is {pool.name!r}")
    gpus = gpus_per_node(job, pool)
    if not 1 <= gpus <= pool.gpus_per_node:
        raise JobSpecError(f"job.gpusPerNode {job.gpus_per_node} must be 0 (all) or 1..{pool.gpus_per_node} for "
                           f"pool {pool.name!r} ({pool.instance_type})")
    if job.nodes.max > pool.max_nodes:
        raise JobSpecError(f"job.nodes MAX {job.nodes.max} is more than pool {pool.name!r} maxNodes {pool.max_nodes}")
    if not where.queue:
        raise JobSpecError(f"no Kueue LocalQueue for job.team {job.team!r}")
    labels = pod_labels(job)
    manifest = {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": job.name, "namespace": naming.team_namespace(job.team),
                     "labels": {**labels, QUEUE_LABEL: where.queue,
                                PRIORITY_LABEL: naming.priority_class_name(job.priority_class)}},
        "spec": {
            # Created suspended, as Kueue expects; from then on Kueue alone sets this field.
            "suspend": True,
            "network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": job.max_restarts,
                # A Job failed by its podFailurePolicy (exit code 2: bad input) fails the JobSet at once; any other
                # Job failure restarts the JobSet, up to maxRestarts (the default action).
                "rules": [{"name": BAD_INPUT_RULE, "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                           "targetReplicatedJobs": [REPLICATED_JOB]}],
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {
                "metadata": {"labels": labels}, "spec": job_spec(job, pod_template(job, where, gpus))}}],
        },
    }
    manifest["metadata"]["annotations"] = provenance_annotations(manifest, where.provenance)
    return manifest


def config_hash(manifest: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a JobSet's labels and spec (module docstring)."""
    doc = {"labels": manifest["metadata"].get("labels") or {}, "spec": manifest["spec"]}
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def provenance_annotations(manifest: Mapping[str, Any], provenance: Provenance) -> dict[str, str]:
    out = {HASH_ANNOTATION: config_hash(manifest)}
    if provenance.path:
        out[PATH_ANNOTATION] = provenance.path
    if provenance.commit:
        out[COMMIT_ANNOTATION] = provenance.commit
    if provenance.applied:
        out[MANAGED_ANNOTATION] = MANAGED_BY_APPLY
    return out
