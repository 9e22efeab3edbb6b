"""The one JobSet renderer (gpu_train/jobs/jobset.py) for the pools each cloud layer describes: an AWS EFA pool,
a GCP A3 Mega (GPUDirect-TCPXO) pool and a dev L4 pool on each cloud. The command line is checked with torchrun's
and the trainer's own parsers, the pod against the Kubernetes schema, the failure and pause policies against
the JobSet and Kubernetes field names, and the trainer's share of a node against the published allocatable
formulas.

Run: .venv/bin/pytest tests/gpu_train/jobs/test_jobset.py -q
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import torch.distributed.run as torchrun

from gpu_train.jobs import jobset as js
from gpu_train.jobs import launch
from gpu_train.spec import catalog, naming
from gpu_train.spec.contract import Fabric, GpuPool
from gpu_train.spec.job import PODS_READY_TIMEOUT_S, JobSpec
from gpu_train.spec.trainer_config import build_config
from infra.aws import node_addons as aws_addons
from infra.aws.gpu_nodes import NVME_HOST_PATH as AWS_NVME
from infra.gcp import NVME_HOST_PATH as GCP_NVME
from infra.gcp import node_addons as gcp_addons
from tests.infra.aws.conftest import stack_cfg as aws_stack
from tests.infra.gcp.conftest import fabric_pool
from tests.infra.gcp.conftest import stack_cfg as gcp_stack
from trainer.__main__ import parser as trainer_parser

K8S_VERSION = "1.33"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-prod-trainer@sha256:" + "c" * 64
CACHE = f"http://{naming.CACHE_PROXY_SERVICE}.{naming.CACHE_NAMESPACE}.svc:{naming.CACHE_PROXY_PORT}/api/v1/s3"
MLFLOW = f"http://mlflow.{naming.MLFLOW_NAMESPACE}.svc:{naming.MLFLOW_PORT}"
# What the AWS layer gives every training container (ClusterPlatform.pod_env); GKE gives none.
POD_ENV = {"aws": {"AWS_REGION": "us-east-1"}, "gcp": {}}
NVME = {"aws": AWS_NVME, "gcp": GCP_NVME}


def _pool(cloud: str, settings: dict) -> GpuPool:
    """A pool as the cloud layer describes it to jobs."""
    if cloud == "aws":
        (pool,) = aws_addons.gpu_pools(aws_stack([settings]))
    else:
        (pool,) = gcp_addons.gpu_pools(gcp_stack([settings]))
    return pool


def efa_pool() -> GpuPool:
    return _pool("aws", {"name": "h100-reserved", "instanceType": "p5.48xlarge", "capacity": "capacity-block",
                         "reservationId": "cr-0123456789abcdef0", "minNodes": 2, "maxNodes": 4, "fabric": True,
                         "zone": "us-west-2a"})


def tcpxo_pool() -> GpuPool:
    return _pool("gcp", {**fabric_pool("h100-reserved", "a3-megagpu-8g", capacity="reservation"), "minNodes": 2,
                         "maxNodes": 4})


def l4_pool(instance_type: str = "g6.2xlarge") -> GpuPool:
    cloud = "aws" if instance_type in catalog.known("aws") else "gcp"
    return _pool(cloud, {"name": "l4-spot", "instanceType": instance_type, "capacity": "spot", "maxNodes": 4})


def prod_job(**kw) -> JobSpec:
    base = dict(name="gpt2-350m-pretrain", team="research", pool="h100-reserved", preset="gpt2-350m",
                nodes="2:4", gpus_per_node=8, steps=50000, global_batch_tokens=786432, checkpoint_every=500,
                max_restarts=10, overrides={"train.micro_batch_size": 8, "train.compile": True})
    base.update(kw)
    return JobSpec.model_validate(base)


def dev_job(**kw) -> JobSpec:
    base = dict(name="gpt2-smoke", team="research", pool="l4-spot", preset="gpt2-124m", nodes="1:2",
                gpus_per_node=1, steps=200, global_batch_tokens=65536, checkpoint_every=50, max_restarts=5,
                overrides={"train.micro_batch_size": 8})
    base.update(kw)
    return JobSpec.model_validate(base)


def build(job: JobSpec, pool: GpuPool, cloud: str = "aws", **kw) -> dict:
    bucket = "s3://" if cloud == "aws" else "gs://"
    where = dict(pool=pool, image=IMAGE, queue=naming.job_queue_name(job.name), nvme_host_path=NVME[cloud],
                 datasets_bucket=f"{bucket}ds-bucket", checkpoints_bucket=f"{bucket}ck-bucket", cache_endpoint=CACHE,
                 tracking_uri=MLFLOW, pod_env=POD_ENV[cloud])
    where.update(kw)
    return js.jobset(job, js.Placement(**where))


def pod_template(manifest: dict) -> dict:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def validate_pod(manifest: dict) -> dict:
    """Wrap the JobSet's pod template as a v1 Pod and validate it strictly against the cluster's schema."""
    tpl = copy.deepcopy(pod_template(manifest))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "worker-0", "namespace": manifest["metadata"]["namespace"], **tpl["metadata"]},
           "spec": tpl["spec"]}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    return pod


def trainer_container(manifest: dict) -> dict:
    (c,) = [c for c in pod_template(manifest)["spec"]["containers"] if c["name"] == "trainer"]
    return c


def env_of(container: dict) -> dict[str, str]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), f"duplicate env vars: {names}"
    return {e["name"]: e["value"] for e in container["env"]}


def parse_command(container: dict):
    """The container's command line through torchrun's own parser, then the trainer's parser and config."""
    assert container["command"] == [launch.LAUNCHER]
    args = torchrun.get_args_parser().parse_args(container["args"])
    assert args.module and args.training_script == "trainer"
    targs = trainer_parser().parse_args(args.training_script_args)
    cfg = build_config(targs.preset, targs.config, targs.overrides)
    return args, targs, cfg


# ------------------------------------------------------------------------------------------- per cloud


def test_aws_efa_pool_gets_efa_devices_env_and_a_valid_pod():
    job, pool = prod_job(), efa_pool()
    m = build(job, pool)
    validate_pod(m)
    c = trainer_container(m)
    for side in ("requests", "limits"):
        assert c["resources"][side]["vpc.amazonaws.com/efa"] == "32"
        assert c["resources"][side]["nvidia.com/gpu"] == "8"
    env = env_of(c)
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["AWS_REGION"] == "us-east-1"
    assert env["TRAINER_IMAGE_DIGEST"] == "sha256:" + "c" * 64
    # The cache endpoint is for dataset reads only (data.endpoint_url): no process-wide S3 endpoint that
    # would send checkpoints to the read-only cache.
    assert "TRAINER_S3_ENDPOINT_URL" not in env and env["MLFLOW_TRACKING_URI"] == MLFLOW
    assert env["TRAINER_METRICS_PORT"] == str(naming.METRICS_PORT)
    # No added capabilities even on EFA (memlock comes from the runtime; see the module's comment).
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "networking.gke.io/interfaces" not in pod_template(m)["metadata"]["annotations"]


def test_gcp_a3_mega_pool_gets_interfaces_annotation_tcpxo_sidecar_and_host_plugin():
    job, pool = prod_job(), tcpxo_pool()
    m = build(job, pool, cloud="gcp")
    validate_pod(m)
    tpl = pod_template(m)
    ann = tpl["metadata"]["annotations"]
    assert len(json.loads(ann["networking.gke.io/interfaces"])) == 9  # eth0 and the 8 GPU NICs of an A3 Mega
    assert ann["networking.gke.io/default-interface"] == "eth0"
    init = {c["name"]: c for c in tpl["spec"]["initContainers"]}
    assert init["tcpxo-daemon"]["restartPolicy"] == "Always"  # native sidecar, lives as long as the pod
    assert list(init) == ["tcpxo-daemon"]  # nothing else runs before the trainer
    c = trainer_container(m)
    env = env_of(c)
    assert env["NCCL_FASTRAK_IFNAME"].count("eth") == 8
    assert "AWS_REGION" not in env and "FI_PROVIDER" not in env
    mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
    # The NCCL plugin the installer put on the host is where the trainer's loader looks.
    assert env["LD_LIBRARY_PATH"] in mounts.values()
    assert mounts["aperture-devices"] == "/dev/aperture_devices"
    assert pool.fabric.volume_mounts and all(mounts[v["name"]] == v["mountPath"] for v in pool.fabric.volume_mounts)
    volumes = {v["name"] for v in tpl["spec"]["volumes"]}
    # Every mount of every container refers to a volume of the pod.
    for container in tpl["spec"]["containers"] + tpl["spec"]["initContainers"]:
        assert {vm["name"] for vm in container.get("volumeMounts", [])} <= volumes, container["name"]
    assert set(c["resources"]["limits"]) == {"memory", "nvidia.com/gpu"}


@pytest.mark.parametrize(("cloud", "instance"), [("aws", "g6.2xlarge"), ("gcp", "g2-standard-8")])
def test_dev_l4_pool_has_no_fabric_and_fits_the_instance(cloud, instance):
    job, pool = dev_job(), l4_pool(instance)
    m = build(job, pool, cloud=cloud)
    validate_pod(m)
    c = trainer_container(m)
    assert set(c["resources"]["limits"]) == {"memory", "nvidia.com/gpu"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert [p["containerPort"] for p in c["ports"] if p["name"].startswith("metrics-")] == [naming.METRICS_PORT]
    shape = catalog.shape(cloud, instance)
    cpu = int(c["resources"]["requests"]["cpu"])
    memory = int(c["resources"]["requests"]["memory"].removesuffix("Gi"))
    assert 1 <= cpu < shape.vcpus and 2 <= memory < shape.memory_gib
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"]
    assert "cpu" not in c["resources"]["limits"]
    shm = next(v for v in pod_template(m)["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert 1 <= int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi")) <= memory
    assert pod_template(m)["metadata"]["annotations"].keys() == {
        "karpenter.sh/do-not-disrupt", "kubectl.kubernetes.io/default-container"}


# ------------------------------------------------------------------------------------------- JobSet shape


def test_jobset_queues_on_its_own_queue_and_one_pod_per_node():
    job = prod_job(suspend=True)
    m = build(job, efa_pool())
    assert m["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and m["kind"] == "JobSet"
    assert m["metadata"]["namespace"] == naming.team_namespace("research")
    assert m["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpt2-350m-pretrain-job"
    # Created suspended whatever job.suspend says: Kueue unsuspends on admission, and pausing goes
    # through the LocalQueue. Nothing asks the provider to force fields back from Kueue.
    assert m["spec"]["suspend"] is True and build(prod_job(), efa_pool())["spec"]["suspend"] is True
    assert "pulumi.com/patchForce" not in m["metadata"].get("annotations", {})
    assert m["spec"]["failurePolicy"]["maxRestarts"] == job.max_restarts
    assert m["spec"]["successPolicy"]["targetReplicatedJobs"] == [m["spec"]["replicatedJobs"][0]["name"]]
    (rj,) = m["spec"]["replicatedJobs"]
    spec = rj["template"]["spec"]
    assert rj["replicas"] == 1 and spec["parallelism"] == spec["completions"] == 4  # MAX of "2:4"
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]
    anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["nodeSelector"] == {naming.POOL_LABEL: "h100-reserved"}
    assert pod["spec"]["tolerations"][0]["key"] == naming.GPU_TAINT["key"]
    assert pod["spec"]["serviceAccountName"] == naming.TRAINER_SERVICE_ACCOUNT
    assert pod["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    sec = pod["spec"]["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["seccompProfile"]["type"] == "RuntimeDefault"
    c = trainer_container(m)
    assert c["image"] == IMAGE
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["runAsUser"] == naming.TRAINER_UID
    ports = [p for p in c["ports"] if p["name"].startswith("metrics-")]
    assert [p["containerPort"] for p in ports] == list(range(naming.METRICS_PORT, naming.METRICS_PORT + 8))
    assert all(len(p["name"]) <= 15 for p in c["ports"])


def c_names(m: dict) -> set[str]:
    return {c["name"] for c in pod_template(m)["spec"]["containers"]}


def test_bad_input_fails_the_jobset_at_once_and_disruptions_do_not_count():
    job = prod_job()
    m = build(job, efa_pool())
    spec = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    # Kubernetes batch/v1 PodFailurePolicy: a DisruptionTarget pod (spot reclaim, drain, node loss) is
    # ignored, first; exit code 2 of the trainer container fails the Job.
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1] == {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                             "values": [2]}}
    assert pod_template(m)["spec"]["restartPolicy"] == "Never"  # required by a podFailurePolicy
    assert c_names(m) >= {"trainer"}
    # A Job failed by its pod failure policy carries reason "PodFailurePolicy"; the JobSet rule for
    # that reason fails the JobSet instead of restarting it (jobset v0.12.0 FailurePolicyRule).
    (rule,) = m["spec"]["failurePolicy"]["rules"]
    assert rule == {"name": "BadInput", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                    "targetReplicatedJobs": ["worker"]}
    assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])  # the CRD's name pattern
    # One group failure can fail every one of the 4 pods: the Job tolerates maxRestarts of them.
    assert spec["backoffLimit"] == job.max_restarts * 4
    # Pod 0 succeeding (the trainer exits 0 only after the last step) completes the Job even when some
    # indexes wait for a node.
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}


def test_job_local_queue_pauses_through_its_stop_policy():
    running, paused = js.local_queue(prod_job()), js.local_queue(prod_job(suspend=True))
    assert running["apiVersion"] == "kueue.x-k8s.io/v1beta2" and running["kind"] == "LocalQueue"
    assert running["metadata"]["namespace"] == "team-research"
    assert running["spec"] == {"clusterQueue": naming.cluster_queue_name("research"), "stopPolicy": "None"}
    # HoldAndDrain: the admitted workload is evicted (quota released) and held; the CRD's enum.
    assert paused["spec"]["stopPolicy"] == "HoldAndDrain"
    assert naming.job_queue_name(prod_job().name) != naming.local_queue_name("research")
    assert build(prod_job(), efa_pool())["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == \
        running["metadata"]["name"]


def test_elastic_runs_get_torchs_store_switch_and_waits_from_the_settings():
    job = prod_job(data_wait_minutes=7, rendezvous_timeout_minutes=40)
    m = build(job, efa_pool())
    env = env_of(trainer_container(m))
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TRAINER_DATA_WAIT_S"] == "420" and env["RDZV_DNS_TIMEOUT"] == "2400"
    args, _, _ = parse_command(trainer_container(m))
    config = torchrun.config_from_args(args)[0]
    assert int(config.rdzv_configs["join_timeout"]) == 2400 >= PODS_READY_TIMEOUT_S


def test_nccls_watchdog_agrees_with_the_trainers_and_dumps_beside_the_run():
    """The JobSet carries the trainer's NCCL settings (gpu_train/jobs/launch.py, also what gpu-train-launch sets), under
    names the installed torch declares (c10d headers) or holds in its library, and the flight recorder dumps into
    the run directory on NVMe."""
    import mmap

    import torch

    from gpu_train.jobs.launch import nccl_env

    m = build(prod_job(), efa_pool())
    env = env_of(trainer_container(m))
    assert nccl_env().items() <= env.items()
    _, targs, _ = parse_command(trainer_container(m))
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(f"{targs.run_dir}/") and str(targs.run_dir).startswith(js.NVME_MOUNT)
    torch_env = {k for k in env if k.startswith(("TORCH_NCCL_", "TORCH_FR_"))}
    c10d = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d"
    found = {k for k in torch_env if any(f'"{k}"' in (c10d / h).read_text()
                                         for h in ("ProcessGroupNCCL.hpp", "FlightRecorder.hpp"))}
    for lib in (Path(torch.__file__).parent / "lib").glob("libtorch_c[pu][ud]*.so"):
        with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found |= {k for k in torch_env if data.find(b"\0" + k.encode() + b"\0") != -1}
    assert found == torch_env, sorted(torch_env - found)


def test_torchrun_shutdown_timeout_fits_in_the_grace_period():
    m = build(prod_job(), efa_pool())
    args, _, _ = parse_command(trainer_container(m))
    grace = pod_template(m)["spec"]["terminationGracePeriodSeconds"]
    # torchrun kills its workers --shutdown-timeout seconds after SIGTERM (default 30): the workers must
    # get nearly all of the pod's grace period for the final checkpoint, and torchrun must exit first.
    assert args.shutdown_timeout == launch.shutdown_timeout_s() == grace - launch.SHUTDOWN_MARGIN_S
    assert 30 < args.shutdown_timeout < grace
    with pytest.raises(launch.LaunchSpecError, match="grace period of 10 s"):
        launch.shutdown_timeout_s(10)


OWN_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/research/own@sha256:" + "e" * 64


def split_image_and_command(manifest: dict) -> tuple[dict, str, list[str]]:
    """(the JobSet without its image, its command and what derives from them, the image, the command's arguments).
    What derives: the image's digest in the environment, and the config hash over the whole JobSet."""
    m = copy.deepcopy(manifest)
    c = trainer_container(m)
    image = c.pop("image")
    env = env_of(c)
    assert env["TRAINER_IMAGE_DIGEST"] == image.split("@", 1)[1]
    c["env"] = [e for e in c["env"] if e["name"] != "TRAINER_IMAGE_DIGEST"]
    flags = [a for a in c["args"] if a.startswith("--") and "=" in a]  # torchrun's own, all --name=value
    command = c["args"][len(flags):]
    assert c["args"][:len(flags)] == flags
    c["args"] = flags
    del m["metadata"]["annotations"][js.HASH_ANNOTATION]
    return m, image, command


@pytest.mark.parametrize("command", [["python", "-m", "pkg.train", "--lr", "1e-3"], ["python", "train.py"],
                                     ["bash", "-c", "exec ./run.sh"]])
def test_a_job_of_its_own_code_differs_from_the_bundled_trainers_only_in_image_and_command(command):
    """Same name, team, pool, nodes and restarts: everything the bundled trainer gets (rendezvous, environment
    contract, fabric, NVMe, ports, failure rules) a job of its own code gets too."""
    base = dict(name="mixed", team="research", pool="l4-spot", nodes="1:2", gpus_per_node=1, max_restarts=5)
    bundled = build(JobSpec.model_validate(base), l4_pool())
    own = build(JobSpec.model_validate({**base, "image": OWN_IMAGE, "command": command}), l4_pool())
    rest_a, image_a, command_a = split_image_and_command(bundled)
    rest_b, image_b, command_b = split_image_and_command(own)
    assert rest_a == rest_b
    assert (image_a, image_b) == (IMAGE, OWN_IMAGE)
    assert command_a[:4] == ["-m", "trainer", "--preset", "gpt2-124m"]
    assert command_b == launch.command_args(JobSpec.model_validate({**base, "command": command}), "", {})
    validate_pod(own)
    env = env_of(trainer_container(own))
    assert env["GPU_TRAIN_CHECKPOINT_URI"] == "s3://ck-bucket/research/mixed"
    # Through the read cache, which serves the datasets bucket's folders as buckets (gpu_train.spec.naming).
    assert (env["GPU_TRAIN_DATASET_URI"], env["GPU_TRAIN_DATA_ENDPOINT"]) == ("s3://mixed/manifest.json", CACHE)
    assert env["MLFLOW_TRACKING_URI"] == MLFLOW and env["TRAINER_METRICS_PORT"] == str(naming.METRICS_PORT)


# ------------------------------------------------------------------------------------------- a node's share


@pytest.mark.parametrize(("pool", "gpus", "cpu", "memory"), [
    # Hand-computed from the published allocatable formulas, less the agents' 4 CPUs and 12 GiB:
    # p5.48xlarge: 192 - 0.55 = 191.45 CPUs -> 187.45 -> 187; 2048 x 0.925 = 1894.4 GiB - (1355 + 100) MiB
    # -> 1892.98 -> 1880.98 -> 1880 GiB.
    (efa_pool(), 8, 187, 1880),
    # half the GPUs: half of 187.45 = 93.73 -> 93 CPUs; half of 1880.98 = 940.49 -> 940 GiB.
    (efa_pool(), 4, 93, 940),
    # g2-standard-8: 7.91 - 4 = 3.91 -> 3 CPUs; 29.6 - 3.416 - 0.098 - 12 = 14.09 -> 14 GiB.
    (l4_pool("g2-standard-8"), 1, 3, 14),
])
def test_pod_resources_are_the_nodes_share_after_its_agents(pool, gpus, cpu, memory):
    got_cpu, got_memory, shm = js.pod_resources(pool, gpus)
    assert (got_cpu, got_memory) == (cpu, memory) and shm == memory // 4


def test_a_fabric_sidecar_comes_out_of_the_trainers_share():
    # a3-megagpu-8g: 208 - (0.08 + 204 x 0.0025) = 207.41 CPUs - 4 = 203.41 - the 1-CPU sidecar -> 202.
    pool = tcpxo_pool()
    assert sum(int(s["resources"]["requests"]["cpu"]) for s in pool.fabric.sidecars) == 1
    cpu, memory, _ = js.pod_resources(pool, 8)
    assert cpu == 202
    assert js.pod_resources(pool.model_copy(update={"fabric": Fabric(kind="none")}), 8)[0] == 203
    with pytest.raises(js.JobSpecError, match="g6.xlarge leaves the trainer 0 CPUs"):
        js.pod_resources(l4_pool("g6.xlarge"), 1)  # 4 vCPUs: 3.92 allocatable, less 4 for the agents
    with pytest.raises(js.JobSpecError, match="allocatable"):
        js.pod_resources(pool.model_copy(update={"allocatable": None}), 8)


# ------------------------------------------------------------------------------------------- the trainer's view


def test_nvme_is_the_platform_made_team_directory_and_no_container_runs_as_root():
    m = build(prod_job(), efa_pool())
    spec = pod_template(m)["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "nvme"]
    # The NVMe DaemonSet makes exactly this directory (infra/k8s/nvme.py); the pod never creates it.
    assert vol["hostPath"] == {"path": f"{AWS_NVME}/gpu-train/team-research", "type": "Directory"}
    assert vol["hostPath"]["path"] == naming.workdir_path(AWS_NVME, naming.team_namespace("research"))
    assert "initContainers" not in spec  # EFA has no sidecar, and nothing prepares the disk as root
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc.get("runAsUser", spec["securityContext"]["runAsUser"]) == naming.TRAINER_UID != 0
        assert "add" not in sc["capabilities"]


def test_rendezvous_endpoint_is_pod_zero_on_the_jobsets_headless_service():
    job = prod_job()
    m = build(job, efa_pool())
    args, _, _ = parse_command(trainer_container(m))
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    rj = m["spec"]["replicatedJobs"][0]["name"]
    # JobSet names pods <jobset>-<replicatedJob>-<jobIndex>-<podIndex> under the subdomain (= the service).
    assert m["spec"]["network"]["enableDNSHostnames"] is True
    assert host == f"{m['metadata']['name']}-{rj}-0-0.{m['spec']['network']['subdomain']}"
    assert int(port) == 29400
    rdzv_port = [p["containerPort"] for p in trainer_container(m)["ports"] if p["name"] == "rendezvous"]
    assert rdzv_port == [29400]


def test_command_line_parses_with_torchrun_and_the_trainer():
    job = prod_job()
    m = build(job, efa_pool())
    args, targs, cfg = parse_command(trainer_container(m))
    assert args.nnodes == "2:4" and args.nproc_per_node == "8"
    assert args.rdzv_backend == "c10d" and args.rdzv_id == job.name and args.max_restarts == job.max_restarts
    config = torchrun.config_from_args(args)[0]
    assert (config.min_nodes, config.max_nodes) == (2, 4)
    assert int(config.rdzv_configs["join_timeout"]) == job.rendezvous_timeout_minutes * 60
    assert targs.preset == "gpt2-350m" and str(targs.run_dir) == f"/mnt/nvme/runs/{job.name}"
    assert cfg.train.steps == 50000 and cfg.train.global_batch_tokens == 786432
    assert cfg.checkpoint.every_steps == 500
    assert cfg.checkpoint.remote_uri == "s3://ck-bucket/research/gpt2-350m-pretrain"
    assert cfg.checkpoint.local_dir.startswith("/mnt/nvme/")
    # Read through the Alluxio S3 proxy, where the bucket's top-level directory is the bucket.
    assert cfg.data.uri == "s3://gpt2-350m-pretrain/manifest.json"
    assert cfg.data.endpoint_url == CACHE and cfg.data.cache_dir.startswith("/mnt/nvme/")
    assert cfg.checkpoint.endpoint_url == ""
    assert cfg.train.micro_batch_size == 8 and cfg.train.compile is True  # the job's overrides
    assert cfg.tracking.register_name == job.name
    # Every NVMe path the trainer writes to is on the hostPath mount.
    mounts = {v["mountPath"] for v in trainer_container(m)["volumeMounts"]}
    assert "/mnt/nvme" in mounts


def test_user_overrides_win_over_defaults():
    m = build(dev_job(overrides={"data.cache_dir": "/mnt/nvme/shared-cache", "tracking.experiment": "abl"}),
              l4_pool())
    _, _, cfg = parse_command(trainer_container(m))
    assert cfg.data.cache_dir == "/mnt/nvme/shared-cache" and cfg.tracking.experiment == "abl"
    assert sum(a.startswith("data.cache_dir=") for a in trainer_container(m)["args"]) == 1
    # Overrides of the job's own settings are refused before rendering: tests/gpu_train/jobs/test_check.py.


def test_without_cache_or_mlflow_the_trainer_reads_the_bucket_and_tracks_locally():
    m = build(dev_job(), l4_pool(), cache_endpoint="", tracking_uri="")
    env = env_of(trainer_container(m))
    assert "TRAINER_S3_ENDPOINT_URL" not in env and "MLFLOW_TRACKING_URI" not in env
    _, _, cfg = parse_command(trainer_container(m))
    assert cfg.data.endpoint_url == ""


def test_bad_inputs_are_refused_with_the_culprit_named():
    with pytest.raises(js.JobSpecError, match="pinned by digest"):
        build(dev_job(), l4_pool(), image="ghcr.io/acme/trainer:latest")
    with pytest.raises(js.JobSpecError, match="gpusPerNode 2"):
        build(dev_job(gpus_per_node=2), l4_pool())
    with pytest.raises(js.JobSpecError, match="job.nodes MAX 9"):
        build(dev_job(nodes="1:9"), l4_pool())
    with pytest.raises(js.JobSpecError, match="LocalQueue.*research"):
        build(dev_job(), l4_pool(), queue="")
    with pytest.raises(js.JobSpecError, match="job.pool is 'l4-spot'"):
        build(dev_job(), efa_pool())
    # The fabric's environment may not set what the job or the cloud sets itself.
    pool = l4_pool()
    bad_fabric = pool.model_copy(update={"fabric": Fabric(kind="none", nccl_env={"AWS_REGION": "eu-west-1"})})
    with pytest.raises(js.JobSpecError, match="AWS_REGION"):
        build(dev_job(), bad_fabric)


def test_default_uris_follow_the_documented_layout():
    job = dev_job()
    assert js.default_uris(job, "s3://ds/", "s3://ck") == (
        "s3://ds/gpt2-smoke/manifest.json", "s3://ck/research/gpt2-smoke")
    explicit = dev_job(dataset_uri="s3://other/m.json", checkpoint_uri="s3://other/ck")
    assert js.default_uris(explicit, "s3://ds", "s3://ck") == ("s3://other/m.json", "s3://other/ck")


def test_dataset_outside_the_cached_bucket_is_read_directly():
    job = prod_job(dataset_uri="s3://partner-bucket/corpus/manifest.json")
    _, _, cfg = parse_command(trainer_container(build(job, efa_pool())))
    assert cfg.data.uri == "s3://partner-bucket/corpus/manifest.json"
    assert cfg.data.endpoint_url == ""
