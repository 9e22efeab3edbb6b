"""`gpu-train prepare --cluster`: a dataset prepared by a Ray cluster in the team's namespace, as a KubeRay RayJob that
waits in the team's Kueue queue; or (`--runner job`) by an Indexed Job of members, which needs no operator.

Usage:
    request = PrepareRequest(name="web", team="research", inputs=("s3://<datasets>/research/raw/",),
                             out="s3://<datasets>/research/web", workers=4, worker_cpu=8)
    problems = check_request(request, contract)     # one line per problem, naming the flag; [] when it can run
    rayjob = ray_job(request, contract)              # the RayJob (ray.io/v1), nothing sent
    job = indexed_job(request, contract)             # --runner job: the Indexed Job (batch/v1), nothing sent
    obj = render(request, contract)                  # whichever request.runner names

The RayJob runs `python -m trainer.data prepare ... --engine ray --address auto` on the Ray head, with the same
tasks, tokenizer and output the local command makes (docs/data.md: the bytes never depend on the engine or the
worker count). It is created suspended with the team's LocalQueue label: Kueue (integration ray.io/rayjob) makes a
Workload of its head and worker groups, admits it against the team's quota in the `cpu` flavor (the team's
`prepareQuota` setting) and unsuspends it; the
KubeRay operator then makes the Ray cluster, submits the entrypoint to the head's dashboard (HTTPMode: no submitter
pod) and deletes the cluster when the job ends (shutdownAfterJobFinishes, which Kueue requires).

Data preparation is CPU work and never holds GPU nodes: the Ray pods select the nodes of the contract's `cpu`
ResourceFlavor (the system nodes) and tolerate only what that flavor says, never a GPU pool's taints, so Kueue can
assign them no GPU pool's flavor (gpu_train/jobs/queues.py: those flavors name the taints), and the quota they are
checked against is that flavor's alone.

With `--runner job` the same request is a `batch/v1` Job (Kueue's `batch/job` integration; the Job controller is
Kubernetes' own): `completionMode: Indexed` with `workers` completions, all running at once, each pod the Ray
worker's pod (one source: `_ray_pod`) running `python -m trainer.data prepare ... --member env/<workers>`. Every
member makes the same plan and runs the tasks i with i % workers == $JOB_COMPLETION_INDEX on the local runner;
whichever finds every task committed merges (trainer/data/prepare.py). A failed member is retried per index
(backoffLimitPerIndex) and runs only its uncommitted tasks; maxFailedIndexes 0 fails the Job on the first index that
runs out of retries. Its quota is the members' alone (no head).

The Ray pods run as the namespace's `data-prep` account, whose cloud identity reads the datasets bucket and writes
its `<team>/` prefix only: so the inputs must be objects in the datasets bucket and the output under the team's
prefix of it. They meet the team namespace's admission policies as the trainer's pods do (non-root user, no
capabilities, RuntimeDefault seccomp, the platform's image by digest); KubeRay's own init container copies the Ray
container's image and securityContext (ray-operator/controllers/ray/common/pod.go at v1.7.0).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpu_train.jobs.fit import quantity
from gpu_train.jobs.pods import container_security, pod_security
from gpu_train.spec import naming
from gpu_train.spec.contract import ContractError, PlatformContract

RAY_API = "ray.io/v1"
# The Ray the trainer image installs (pyproject.toml, the `prep` extra); KubeRay reads it for its defaults.
RAY_VERSION = "2.60.0"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PREPARE_LABEL = "gpu-train.io/prepare"  # on the RayJob, valued with its name
NAME = re.compile(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?")
TOKENIZERS = ("byte", "bpe", "gpt2")
TTL_AFTER_FINISHED_S = 3600  # a finished RayJob (or Job) stays an hour for `kubectl get` to show how it ended
RUNNERS = ("ray", "job")
# A Job's member is started again this many times (each time it runs only its uncommitted tasks) before the Job
# fails; a member that exits 2 (bad input: trainer/data/__main__.py) fails its index at once.
RETRIES_PER_INDEX = 2
BAD_INPUT_EXIT = 2


@dataclass(frozen=True, kw_only=True)
class PrepareRequest:
    """What `gpu-train prepare --cluster` was asked for."""

    name: str  # the RayJob's name (a lowercase DNS label of at most 32 characters)
    team: str
    inputs: tuple[str, ...]  # s3:// or gs:// prefixes or objects in the datasets bucket
    out: str  # the dataset's folder: under <datasets bucket>/<team>/
    tokenizer: str = "byte"
    vocab_size: int | None = None
    tasks: int | None = None
    val_fraction: float | None = None
    text_field: str = "text"
    seed: int = 0
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    force: bool = False
    # Sized to fit a team's default prepareQuota (8 CPUs, 32 GiB) on the system nodes.
    workers: int = 2  # Ray worker pods
    worker_cpu: int = 2  # CPUs per worker pod: one task per CPU
    worker_memory: str = "8Gi"
    head_cpu: int = 1
    head_memory: str = "4Gi"
    tokenizer_file: str = ""  # not supported on the cluster (a local folder); kept to refuse it by name
    runner: str = "ray"  # ray: a KubeRay RayJob; job: an Indexed Job of `workers` members (no operator)
    extra_env: Mapping[str, str] = field(default_factory=dict)


def _under(uri: str, prefix: str) -> bool:
    return uri.rstrip("/") == prefix.rstrip("/") or uri.startswith(prefix.rstrip("/") + "/")


def cpu_flavor(contract: PlatformContract) -> dict[str, Any]:
    """The contract's ResourceFlavor of the CPU nodes, where the Ray pods run."""
    found = next((f for f in contract.kueue.resource_flavors if f["metadata"]["name"] == naming.CPU_FLAVOR), None)
    if found is None or not (found.get("spec") or {}).get("nodeLabels"):
        raise ContractError(f"{contract.source or 'the platform contract'}: kueue.resourceFlavors has no "
                            f"{naming.CPU_FLAVOR!r} flavor with nodeLabels (a platform from before data preparation "
                            "ran on the CPU nodes: `pulumi up` the stack)")
    return found


def team_quota_limits(contract: PlatformContract, team: str) -> dict[str, Fraction]:
    """Per resource (cpu, memory): the most the team's ClusterQueue can ever admit in the `cpu` flavor (its nominal
    quota plus what it may borrow there); 0 for a resource the flavor does not list."""
    cq_name = contract.team(team).cluster_queue
    cq = next((q for q in contract.kueue.cluster_queues if q["metadata"]["name"] == cq_name), None)
    if cq is None:
        raise ContractError(f"the platform contract has no ClusterQueue {cq_name!r} for team {team!r}")
    most = {"cpu": Fraction(0), "memory": Fraction(0)}
    for group in cq["spec"]["resourceGroups"]:
        for flavor in group["flavors"]:
            for res in flavor["resources"] if flavor["name"] == naming.CPU_FLAVOR else []:
                if res["name"] in most:
                    most[res["name"]] = quantity(res["nominalQuota"]) + quantity(res.get("borrowingLimit", 0))
    return most


def requested(request: PrepareRequest) -> dict[str, Fraction]:
    """CPU and memory the job requests in all: the Ray head and every worker; a Job's members alone."""
    head = request.runner == "ray"
    return {"cpu": Fraction(request.head_cpu if head else 0) + request.workers * Fraction(request.worker_cpu),
            "memory": (quantity(request.head_memory) if head else 0) + request.workers * quantity(request.worker_memory)}


def check_request(request: PrepareRequest, contract: PlatformContract) -> list[str]:
    """What keeps the request from running, one line each naming the flag (or the team); [] when it can."""
    try:
        team = contract.team(request.team)
    except ContractError as exc:
        return [f"--team: {exc}"]
    problems = []
    pods = "Ray pods" if request.runner == "ray" else "Job's pods"
    if request.runner not in RUNNERS:
        problems.append(f"--runner {request.runner!r} is not one of {', '.join(RUNNERS)}")
    if request.runner == "job" and request.force:
        problems.append("--force does not go with --runner job: its members share one plan and never clear --out "
                        "(use --runner ray, or remove the old dataset first)")
    if not NAME.fullmatch(request.name):
        problems.append(f"--name {request.name!r} is not a job name (a lowercase DNS label of at most 32 characters)")
    datasets = contract.bucket("datasets")
    team_prefix = f"{datasets.rstrip('/')}/{team.name}/"
    if not datasets:
        problems.append("the platform contract names no datasets bucket: prepare on the cluster writes there")
    elif not _under(request.out, team_prefix) or request.out.rstrip("/") == team_prefix.rstrip("/"):
        problems.append(f"--out {request.out}: the cluster's {pods} may write only under the datasets bucket's "
                        f"prefix for team {team.name} ({team_prefix}<dataset>)")
    for uri in request.inputs:
        if datasets and not _under(uri, datasets):
            problems.append(f"input {uri}: the cluster's {pods} read only objects in the datasets bucket "
                            f"({datasets}/...); copy the input there first")
    if request.tokenizer not in TOKENIZERS:
        problems.append(f"--tokenizer {request.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
    if request.tokenizer == "gpt2" or request.tokenizer_file:
        problems.append("--tokenizer gpt2 reads GPT-2's files from a local folder (--tokenizer-file), which the "
                        "cluster's pods cannot see: prepare it on this machine, or use --tokenizer byte or bpe")
    if request.workers < 1 or request.worker_cpu < 1 or request.head_cpu < 1:
        problems.append("--workers, --worker-cpu and --head-cpu must be >= 1")
    try:
        asked = requested(request)
    except (ValueError, ZeroDivisionError):
        problems.append(f"--worker-memory {request.worker_memory!r} / --head-memory {request.head_memory!r}: not "
                        "Kubernetes quantities (e.g. 32Gi)")
        return problems
    try:
        cpu_flavor(contract)
    except ContractError as exc:
        return [*problems, str(exc)]
    limits = team_quota_limits(contract, team.name)
    for res, unit in (("cpu", "CPUs"), ("memory", "bytes of memory")):
        most = limits[res]
        if asked[res] > most:
            what = (f"--workers {request.workers} x --worker-cpu {request.worker_cpu}" if res == "cpu" else
                    f"--workers {request.workers} x --worker-memory {request.worker_memory}")
            if request.runner == "ray":
                what = (f"--head-cpu {request.head_cpu} + " if res == "cpu" else
                        f"--head-memory {request.head_memory} + ") + what
            problems.append(f"{what} = {_show(asked[res], res)} {unit}: more than team {team.name}'s queue can ever "
                            f"admit ({_show(most, res)} on flavor {naming.CPU_FLAVOR}, teams[].prepareQuota); ask for fewer "
                            "or smaller workers")
    return problems


def _show(value: Fraction, res: str) -> str:
    if res == "memory":
        return f"{float(value) / 2**30:g}Gi"
    return f"{float(value):g}"


def entrypoint(request: PrepareRequest) -> list[str]:
    """The command the Ray head runs: the local `prepare` with the same settings, on this Ray cluster, one task in
    flight per worker CPU. With --runner job, what each member runs: the same `prepare` on the local runner, one
    task per CPU of its pod, as member $JOB_COMPLETION_INDEX of `workers` (trainer/data/prepare.py)."""
    run = (["--engine", "ray", "--address", "auto", "--workers", str(request.workers * request.worker_cpu)]
           if request.runner == "ray" else
           ["--engine", "local", "--workers", str(request.worker_cpu), "--member", f"env/{request.workers}"])
    argv = ["python", "-m", "trainer.data", "prepare", *request.inputs, "--out", request.out, *run,
            "--tokenizer", request.tokenizer, "--seed", str(request.seed), "--text-field", request.text_field]
    for flag, value in (("--vocab-size", request.vocab_size), ("--tasks", request.tasks),
                        ("--val-fraction", request.val_fraction)):
        if value is not None:
            argv += [flag, str(value)]
    for pattern in request.include:
        argv += ["--include", pattern]
    for pattern in request.exclude:
        argv += ["--exclude", pattern]
    if request.force:
        argv.append("--force")
    return argv


def _env(request: PrepareRequest, contract: PlatformContract) -> list[dict[str, str]]:
    return [{"name": "HOME", "value": "/tmp"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
            *({"name": k, "value": v} for k, v in sorted({**contract.pod_env, **request.extra_env}.items()))]


def _ray_pod(contract: PlatformContract, container: str, cpu: int, memory: str,
             env: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """A data preparation pod (a Ray pod, or a Job's member): on the CPU flavor's nodes, the platform's image as the
    trainer's user, /tmp (Ray's session files, the tokenizer's scratch) and /dev/shm (Ray's object store, the local
    runner's process pool) as emptyDirs beside a read-only root; requests equal limits for memory, no CPU limit."""
    flavor = cpu_flavor(contract)["spec"]
    placement: dict[str, Any] = {"nodeSelector": dict(flavor["nodeLabels"])}
    if flavor.get("tolerations"):
        placement["tolerations"] = [dict(t) for t in flavor["tolerations"]]
    return {
        "metadata": {"labels": {"app.kubernetes.io/part-of": "gpu-train"}},
        "spec": {
            **placement,
            "serviceAccountName": naming.DATA_PREP_SERVICE_ACCOUNT,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security(naming.TRAINER_UID),
            "containers": [{
                "name": container,
                "image": contract.image,
                "env": [dict(e) for e in env],
                "resources": {"requests": {"cpu": str(cpu), "memory": memory}, "limits": {"memory": memory}},
                "securityContext": container_security(naming.TRAINER_UID),
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def ray_job(request: PrepareRequest, contract: PlatformContract) -> dict[str, Any]:
    """The RayJob of a checked request (check_request), suspended in the team's LocalQueue."""
    env = _env(request, contract)
    workers = {
        "groupName": "workers",
        "replicas": request.workers, "minReplicas": request.workers, "maxReplicas": request.workers,
        "rayStartParams": {},
        "template": _ray_pod(contract, "ray-worker", request.worker_cpu, request.worker_memory, env),
    }
    return {
        "apiVersion": RAY_API, "kind": "RayJob",
        "metadata": _metadata(request, contract),
        "spec": {
            "suspend": True,  # Kueue unsuspends it on admission
            "entrypoint": shlex.join(entrypoint(request)),
            "submissionMode": "HTTPMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            # The driver's own retries are the one retry (trainer/data/tasks.py): a failed job is not run again.
            "backoffLimit": 0,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                # The head only runs the driver: no task is scheduled on it.
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                                  "template": _ray_pod(contract, "ray-head", request.head_cpu, request.head_memory,
                                                       env)},
                "workerGroupSpecs": [workers],
            },
        },
    }


def _metadata(request: PrepareRequest, contract: PlatformContract) -> dict[str, Any]:
    team = contract.team(request.team)
    return {"name": request.name, "namespace": team.namespace,
            "labels": {QUEUE_LABEL: team.local_queue, PREPARE_LABEL: request.name,
                       "app.kubernetes.io/part-of": "gpu-train"}}


def indexed_job(request: PrepareRequest, contract: PlatformContract) -> dict[str, Any]:
    """The Job of a checked request with --runner job (batch/v1, Indexed), suspended in the team's LocalQueue: one
    member pod per worker, each the RayJob's worker pod (same account, nodes, security, image and resources)
    running `prepare --member env/<workers>` (trainer/data/prepare.py). A member that fails is started again, up to
    RETRIES_PER_INDEX times, and runs only its uncommitted tasks; one failed index fails the Job (maxFailedIndexes
    0), and so does bad input (exit 2) at once; an evicted or preempted pod (DisruptionTarget) does not count."""
    pod = _ray_pod(contract, "prepare", request.worker_cpu, request.worker_memory, _env(request, contract))
    pod["metadata"]["labels"][PREPARE_LABEL] = request.name
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["containers"][0]["command"] = entrypoint(request)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _metadata(request, contract),
        "spec": {
            "suspend": True,  # Kueue unsuspends it on admission
            "completionMode": "Indexed",
            "completions": request.workers,
            "parallelism": request.workers,
            "backoffLimitPerIndex": RETRIES_PER_INDEX,
            "maxFailedIndexes": 0,
            "podFailurePolicy": {"rules": [
                {"action": "FailIndex", "onExitCodes": {"containerName": "prepare", "operator": "In",
                                                        "values": [BAD_INPUT_EXIT]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            "template": pod,
        },
    }


def render(request: PrepareRequest, contract: PlatformContract) -> dict[str, Any]:
    """The RayJob or the Indexed Job of a checked request, by its runner."""
    return indexed_job(request, contract) if request.runner == "job" else ray_job(request, contract)
