"""Tests for the training job: the JobSet, LocalQueue and PodMonitor builders (no mocks) for an AWS EFA
pool, a GCP A3 Mega (GPUDirect-TCPXO) pool and a dev L4 pool, the command line checked with torchrun's and
the trainer's own parsers, the failure and pause policies against the JobSet and Kubernetes field names,
the admission check, and the TrainingJob component under Pulumi mocks.

Run: .venv/bin/pytest tests/infra/k8s/test_training.py -q
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from pathlib import Path

import kubernetes_validate
import pulumi
import pulumi_kubernetes as k8s
import pytest
import torch.distributed.run as torchrun
import yaml
from pulumi.runtime.mocks import MockMonitor

from infra import config as stack_config
from gpu_train.spec import naming
from gpu_train.spec.job import JobSpec
from gpu_train.spec.settings import TeamSettings
from infra.k8s import admission, nvme, tenancy
from infra.k8s import training as t
from infra.mocks import MockContext, PlanMocks
from infra.platform import Buckets, ClusterPlatform, Fabric, GpuPool, Registry, StorageClassSpec
from trainer.__main__ import parser as trainer_parser
from gpu_train.spec.trainer_config import build_config

ROOT = Path(__file__).resolve().parents[3]
K8S_VERSION = "1.33"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-prod-trainer@sha256:" + "c" * 64
CACHE = f"http://{naming.CACHE_PROXY_SERVICE}.{naming.CACHE_NAMESPACE}.svc:{naming.CACHE_PROXY_PORT}/api/v1/s3"
MLFLOW = f"http://mlflow.{naming.MLFLOW_NAMESPACE}.svc:{naming.MLFLOW_PORT}"


def _tolerations() -> list[dict]:
    return [{**naming.GPU_TAINT, "operator": "Equal"}]


def efa_pool() -> GpuPool:
    return GpuPool(
        name="h100-reserved", instance_type="p5.48xlarge", capacity="capacity-block", gpu_type="H100",
        gpus_per_node=8, min_nodes=2, max_nodes=4, zone="us-east-1a",
        node_selector={naming.POOL_LABEL: "h100-reserved"}, tolerations=_tolerations(),
        fabric=Fabric(kind="efa", resources={"vpc.amazonaws.com/efa": 32},
                      nccl_env={"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple"}),
        provisioner="karpenter",
    )


def tcpxo_pool() -> GpuPool:
    interfaces = [{"interfaceName": "eth0", "network": "default"}] + [
        {"interfaceName": f"eth{i}", "network": f"vpc{i}"} for i in range(1, 9)
    ]
    return GpuPool(
        name="h100-reserved", instance_type="a3-megagpu-8g", capacity="reservation", gpu_type="H100",
        gpus_per_node=8, min_nodes=2, max_nodes=4, zone="us-central1-a",
        node_selector={naming.POOL_LABEL: "h100-reserved"}, tolerations=_tolerations(),
        fabric=Fabric(
            kind="tcpxo",
            annotations={"networking.gke.io/default-interface": "eth0",
                         "networking.gke.io/interfaces": json.dumps(interfaces)},
            nccl_env={"NCCL_FASTRAK_CTRL_DEV": "eth0", "NCCL_FASTRAK_IFNAME": "eth1,eth2,eth3,eth4,eth5,eth6,eth7,eth8",
                      "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "NCCL_TUNER_PLUGIN": "libnccl-tuner.so"},
            volumes=[{"name": "nvidia", "hostPath": {"path": "/home/kubernetes/bin/nvidia"}},
                     {"name": "aperture-devices", "hostPath": {"path": "/dev/aperture_devices"}},
                     {"name": "sys", "hostPath": {"path": "/sys"}}],
            volume_mounts=[{"name": "nvidia", "mountPath": "/usr/local/nvidia"},
                           {"name": "aperture-devices", "mountPath": "/dev/aperture_devices"}],
            sidecars=[{
                "name": "tcpxo-daemon",
                "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.12",
                "command": ["/fts/entrypoint_rxdm_container.sh", "--num_hops=2", "--num_nics=8", "--uid=",
                            "--alsologtostderr"],
                "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
                "volumeMounts": [{"name": "nvidia", "mountPath": "/usr/local/nvidia"},
                                 {"name": "sys", "mountPath": "/hostsysfs"}],
                "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
            }],
        ),
        provisioner="node-pool",
    )


def l4_pool(instance_type: str = "g6.2xlarge") -> GpuPool:
    return GpuPool(
        name="l4-spot", instance_type=instance_type, capacity="spot", gpu_type="L4", gpus_per_node=1,
        min_nodes=0, max_nodes=4, zone="", node_selector={naming.POOL_LABEL: "l4-spot"},
        tolerations=_tolerations(), fabric=Fabric(kind="none"), provisioner="karpenter",
    )


def prod_job(**kw) -> JobSpec:
    base = dict(name="gpt2-350m-pretrain", team="research", pool="h100-reserved", preset="gpt2-350m",
                nodes="2:4", gpus_per_node=8, steps=50000, global_batch_tokens=786432, checkpoint_every=500,
                max_restarts=10, overrides={"train.micro_batch_size": 8, "train.compile": True})
    base.update(kw)
    return JobSpec(**base)


def dev_job(**kw) -> JobSpec:
    base = dict(name="gpt2-smoke", team="research", pool="l4-spot", preset="gpt2-124m", nodes="1:2",
                gpus_per_node=1, steps=200, global_batch_tokens=65536, checkpoint_every=50, max_restarts=5,
                overrides={"train.micro_batch_size": 8})
    base.update(kw)
    return JobSpec(**base)


def build(job: JobSpec, pool: GpuPool, cloud: str = "aws", **kw) -> dict:
    bucket = "s3://" if cloud == "aws" else "gs://"
    dataset, ckpt = t.default_uris(job, f"{bucket}ds-bucket", f"{bucket}ck-bucket")
    args = dict(job=job, pool=pool, cloud=cloud, region="us-east-1" if cloud == "aws" else "us-central1",
                image=IMAGE, local_queue=t.job_queue_name(job), dataset_uri=dataset, checkpoint_uri=ckpt,
                nvme_host_path="/mnt/k8s-disks/0", datasets_bucket=f"{bucket}ds-bucket", cache_endpoint=CACHE,
                tracking_uri=MLFLOW)
    args.update(kw)
    return t.jobset_manifest(**args)


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
    assert container["command"] == [t.LAUNCHER]
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
    assert len(json.loads(ann["networking.gke.io/interfaces"])) == 9
    assert ann["networking.gke.io/default-interface"] == "eth0"
    init = {c["name"]: c for c in tpl["spec"]["initContainers"]}
    assert init["tcpxo-daemon"]["restartPolicy"] == "Always"  # native sidecar, lives as long as the pod
    assert list(init) == ["tcpxo-daemon"]  # nothing else runs before the trainer, and nothing as root
    c = trainer_container(m)
    env = env_of(c)
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert env["NCCL_FASTRAK_IFNAME"].count("eth") == 8
    assert "AWS_REGION" not in env and "FI_PROVIDER" not in env
    mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
    assert mounts["nvidia"] == "/usr/local/nvidia" and mounts["aperture-devices"] == "/dev/aperture_devices"
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
    vcpus, mem_gib = t.node_shape(cloud, instance)
    cpu = int(c["resources"]["requests"]["cpu"])
    memory = int(c["resources"]["requests"]["memory"].removesuffix("Gi"))
    assert 1 <= cpu < vcpus and 2 <= memory < mem_gib
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


def c_names(m: dict) -> set[str]:
    return {c["name"] for c in pod_template(m)["spec"]["containers"]}


def test_job_local_queue_pauses_through_its_stop_policy():
    running, paused = t.job_local_queue(prod_job()), t.job_local_queue(prod_job(suspend=True))
    assert running["apiVersion"] == "kueue.x-k8s.io/v1beta2" and running["kind"] == "LocalQueue"
    assert running["metadata"]["namespace"] == "team-research"
    assert running["spec"] == {"clusterQueue": tenancy.cluster_queue_name("research"), "stopPolicy": "None"}
    # HoldAndDrain: the admitted workload is evicted (quota released) and held; the CRD's enum.
    assert paused["spec"]["stopPolicy"] == "HoldAndDrain"
    assert t.job_queue_name(prod_job()) != tenancy.local_queue_name("research")
    assert build(prod_job(), efa_pool())["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == \
        running["metadata"]["name"]


def test_elastic_runs_get_torchs_store_switch_and_waits_from_the_settings():
    job = prod_job(data_wait_minutes=7, rendezvous_timeout_minutes=40)
    m = build(job, efa_pool())
    env = env_of(trainer_container(m))
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TRAINER_DATA_WAIT_S"] == "420" and env["RDZV_DNS_TIMEOUT"] == "2400"
    args, _, _ = parse_command(trainer_container(m))
    launch = torchrun.config_from_args(args)[0]
    assert int(launch.rdzv_configs["join_timeout"]) == 2400 >= admission.PODS_READY_TIMEOUT_S


def test_nccls_watchdog_agrees_with_the_trainers_and_dumps_beside_the_run():
    """The JobSet carries the trainer's NCCL settings (trainer/watchdog.py, also what gpu-train-launch sets), under
    names the installed torch declares (c10d headers) or holds in its library, and the flight recorder dumps into
    the run directory on NVMe."""
    import mmap

    import torch

    from trainer.watchdog import nccl_env

    m = build(prod_job(), efa_pool())
    env = env_of(trainer_container(m))
    assert nccl_env().items() <= env.items()
    _, targs, _ = parse_command(trainer_container(m))
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(f"{targs.run_dir}/") and str(targs.run_dir).startswith(t.NVME_MOUNT)
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
    assert args.shutdown_timeout == t.shutdown_timeout_s() == grace - t.SHUTDOWN_MARGIN_S
    assert 30 < args.shutdown_timeout < grace
    with pytest.raises(t.JobSpecError, match="grace period of 10 s"):
        t.shutdown_timeout_s(10)


@pytest.mark.parametrize(("cloud", "instance", "gpus", "cpu", "memory"), [
    # Hand-computed from the published allocatable formulas, less the agents' 4 CPUs and 12 GiB:
    # p5.48xlarge: 192 - 0.55 = 191.45 CPUs -> 187.45 -> 187; 2048 x 0.925 = 1894.4 GiB - (1355 + 100) MiB
    # -> 1892.98 -> 1880.98 -> 1880 GiB.
    ("aws", "p5.48xlarge", 8, 187, 1880),
    # half the GPUs: half of 187.45 = 93.73 -> 93 CPUs; half of 1880.98 = 940.49 -> 940 GiB.
    ("aws", "p5.48xlarge", 4, 93, 940),
    # g2-standard-8: 7.91 - 4 = 3.91 -> 3 CPUs; 29.6 - 3.416 - 0.098 - 12 = 14.09 -> 14 GiB.
    ("gcp", "g2-standard-8", 1, 3, 14),
])
def test_pod_resources_are_the_nodes_share_after_its_agents(cloud, instance, gpus, cpu, memory):
    got_cpu, got_memory, shm = t.pod_resources(cloud, instance, gpus)
    assert (got_cpu, got_memory) == (cpu, memory) and shm == memory // 4


def test_a_fabric_sidecar_comes_out_of_the_trainers_share():
    # a3-megagpu-8g: 208 - (0.08 + 204 x 0.0025) = 207.41 CPUs - 4 = 203.41 - the 1-CPU sidecar -> 202.
    cpu, memory, _ = t.pod_resources("gcp", "a3-megagpu-8g", 8, tcpxo_pool().fabric.sidecars)
    assert cpu == 202
    assert t.pod_resources("gcp", "a3-megagpu-8g", 8)[0] == 203
    with pytest.raises(t.JobSpecError, match="g6.xlarge leaves the trainer 0 CPUs"):
        t.pod_resources("aws", "g6.xlarge", 1)  # 4 vCPUs: 3.92 allocatable, less 4 for the agents


def _teams(research: dict, applied: dict) -> tuple[TeamSettings, ...]:
    return (TeamSettings(name="research", gpu_quota=research), TeamSettings(name="applied", gpu_quota=applied))


def _spot(pool: GpuPool) -> GpuPool:
    from dataclasses import replace

    return replace(pool, name="h100-spot", capacity="spot", node_selector={naming.POOL_LABEL: "h100-spot"})


@pytest.mark.parametrize(("pool", "cloud"), [(efa_pool(), "aws"), (tcpxo_pool(), "gcp")])
def test_the_prod_job_is_admissible_on_its_teams_quota(pool, cloud):
    teams = _teams({"h100-reserved": 32, "h100-spot": 16}, {"h100-spot": 16})
    assert t.admission_problems(job=prod_job(), teams=teams, pools=[pool, _spot(pool)], cloud=cloud,
                                region="r", nvme_host_path="/mnt/k8s-disks/0") == []


def test_a_job_kueue_cannot_admit_whole_is_refused_naming_the_quota():
    pool = efa_pool()
    # research: 16 nominal on h100-reserved, may borrow applied's 8: at most 24 of the 32 GPUs MAX needs.
    teams = _teams({"h100-reserved": 16}, {"h100-reserved": 8, "h100-spot": 32})
    (problem,) = t.admission_problems(job=prod_job(), teams=teams, pools=[pool, _spot(pool)], cloud="aws",
                                      region="r", nvme_host_path="/mnt/k8s-disks/0")
    assert problem.startswith("gpu-train:teams[0].gpuQuota: Kueue would not admit job 'gpt2-350m-pretrain' (4 pods")
    assert "insufficient quota for nvidia.com/gpu in flavor h100-reserved: 4 pods x 8 = 32 > maximum capacity 24" \
        in problem


def test_a_pod_that_cannot_fit_its_node_is_refused_naming_the_pool():
    from dataclasses import replace

    pool = efa_pool()
    heavy = replace(pool, fabric=replace(pool.fabric, sidecars=[{
        "name": "big", "image": "x", "resources": {"requests": {"cpu": "500", "memory": "1Gi"}}}]))
    teams = _teams({"h100-reserved": 32}, {"h100-spot": 16})
    (problem,) = t.admission_problems(job=prod_job(), teams=teams, pools=[heavy, _spot(heavy)], cloud="aws",
                                      region="r", nvme_host_path="/mnt/k8s-disks/0")
    assert problem.startswith("gpu-train:gpuPools[0].instanceType: p5.48xlarge leaves the trainer 0 CPUs")


def test_nvme_is_the_platform_made_team_directory_and_no_container_runs_as_root():
    m = build(prod_job(), efa_pool())
    spec = pod_template(m)["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "nvme"]
    # The NVMe DaemonSet makes exactly this directory (infra/k8s/nvme.py); the pod never creates it.
    assert vol["hostPath"] == {"path": "/mnt/k8s-disks/0/gpu-train/team-research", "type": "Directory"}
    assert vol["hostPath"]["path"] == nvme.workdir_path("/mnt/k8s-disks/0", naming.team_namespace("research"))
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
    launch = torchrun.config_from_args(args)[0]
    assert (launch.min_nodes, launch.max_nodes) == (2, 4)
    assert int(launch.rdzv_configs["join_timeout"]) == job.rendezvous_timeout_minutes * 60
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


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod", "gcp-dev", "gcp-prod"])
def test_every_stacks_job_is_accepted_by_the_trainer(stack):
    raw = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    cfg = stack_config.parse(raw, stack)
    pool_cfg = cfg.pool(cfg.job.pool)
    base = efa_pool() if pool_cfg.fabric and cfg.cloud == "aws" else (
        tcpxo_pool() if pool_cfg.fabric else l4_pool(pool_cfg.instance_type))
    from dataclasses import replace
    pool = replace(base, name=pool_cfg.name, instance_type=pool_cfg.instance_type, max_nodes=pool_cfg.max_nodes)
    m = build(cfg.job, pool, cloud=cfg.cloud)
    validate_pod(m)
    _, _, tcfg = parse_command(trainer_container(m))
    assert tcfg.train.steps == cfg.job.steps
    # Every stack caches its datasets bucket: the job reads through the S3 proxy on both clouds, and
    # writes checkpoints straight to the cloud's object store.
    assert tcfg.data.uri == f"s3://{cfg.job.name}/manifest.json" and tcfg.data.endpoint_url == CACHE
    assert tcfg.checkpoint.remote_uri.startswith("s3://" if cfg.cloud == "aws" else "gs://")


def test_user_overrides_win_over_defaults_but_not_over_job_settings():
    m = build(dev_job(overrides={"data.cache_dir": "/mnt/nvme/shared-cache", "tracking.experiment": "abl"}),
              l4_pool())
    _, _, cfg = parse_command(trainer_container(m))
    assert cfg.data.cache_dir == "/mnt/nvme/shared-cache" and cfg.tracking.experiment == "abl"
    assert sum(a.startswith("data.cache_dir=") for a in trainer_container(m)["args"]) == 1
    with pytest.raises(t.JobSpecError, match=r"job\.overrides\.train\.steps.*job\.steps"):
        build(dev_job(overrides={"train.steps": 5}), l4_pool())


def test_without_cache_or_mlflow_the_trainer_reads_the_bucket_and_tracks_locally():
    m = build(dev_job(), l4_pool(), cache_endpoint="", tracking_uri="")
    env = env_of(trainer_container(m))
    assert "TRAINER_S3_ENDPOINT_URL" not in env and "MLFLOW_TRACKING_URI" not in env
    _, _, cfg = parse_command(trainer_container(m))
    assert cfg.data.endpoint_url == ""


def test_bad_inputs_are_refused_with_the_culprit_named():
    with pytest.raises(t.JobSpecError, match="pinned by digest"):
        build(dev_job(), l4_pool(), image="ghcr.io/acme/trainer:latest")
    with pytest.raises(t.JobSpecError, match="gpusPerNode 2"):
        build(dev_job(gpus_per_node=2), l4_pool())
    with pytest.raises(t.JobSpecError, match="job.nodes MAX 9"):
        build(dev_job(nodes="1:9"), l4_pool())
    with pytest.raises(t.JobSpecError, match="LocalQueue.*research"):
        build(dev_job(), l4_pool(), local_queue="")
    bad_fabric = l4_pool()
    from dataclasses import replace
    bad_fabric = replace(bad_fabric, fabric=Fabric(kind="none", nccl_env={"AWS_REGION": "eu-west-1"}))
    with pytest.raises(t.JobSpecError, match="AWS_REGION"):
        build(dev_job(), bad_fabric)


def test_default_uris_follow_the_documented_layout():
    job = dev_job()
    assert t.default_uris(job, "s3://ds/", "s3://ck") == (
        "s3://ds/gpt2-smoke/manifest.json", "s3://ck/research/gpt2-smoke")
    explicit = dev_job(dataset_uri="s3://other/m.json", checkpoint_uri="s3://other/ck")
    assert t.default_uris(explicit, "s3://ds", "s3://ck") == ("s3://other/m.json", "s3://other/ck")


def test_pod_monitor_scrapes_every_local_rank_of_the_jobs_pods():
    job = prod_job()
    m = build(job, efa_pool())
    mon = t.pod_monitor_manifest(job=job, gpus=8, release_labels={"release": naming.MONITORING_RELEASE})
    assert mon["apiVersion"] == "monitoring.coreos.com/v1" and mon["kind"] == "PodMonitor"
    assert mon["metadata"]["labels"]["release"] == naming.MONITORING_RELEASE
    assert mon["metadata"]["namespace"] == m["metadata"]["namespace"]
    pod_labels = pod_template(m)["metadata"]["labels"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port_names = {p["name"] for p in trainer_container(m)["ports"]}
    scraped = [e["port"] for e in mon["spec"]["podMetricsEndpoints"]]
    assert len(scraped) == 8 and set(scraped) <= port_names
    targets = {r["targetLabel"] for e in mon["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
    assert targets == {"jobset"}


# ------------------------------------------------------------------------------------------- component


def _platform(pool: GpuPool) -> ClusterPlatform:
    out = pulumi.Output.from_input
    return ClusterPlatform(
        cloud="aws", region="us-east-1", cluster_name=out("c"), kubernetes_version=K8S_VERSION,
        provider=k8s.Provider("k8s", kubeconfig="{}"), kubeconfig=out("{}"), gpu_pools=[pool],
        system_node_selector={naming.SYSTEM_LABEL: "true"}, nvme_host_path="/mnt/k8s-disks/0",
        nvme_setup="bootstrap",
        buckets=Buckets(datasets=out("s3://gpu-train-aws-prod-datasets"),
                        checkpoints=out("s3://gpu-train-aws-prod-checkpoints"), artifacts=out("s3://a")),
        object_store_endpoint="https://s3.us-east-1.amazonaws.com", object_store_cidrs=[], api_server_cidrs=[],
        vpc_cidr="10.20.0.0/16", pod_cidr="100.64.0.0/16",
        storage_class=StorageClassSpec(name="enc", provisioner="ebs.csi.aws.com", parameters={}),
        identities={}, registry=Registry(repository=out("r"), server=out("s"), username=out("u"), password=out("p")),
        internal_lb_annotations={},
    )


class _OptionsMonitor(MockMonitor):
    """Keeps the resource options each registration carried (ignoreChanges, replaceOnChanges)."""

    def __init__(self, mocks):
        super().__init__(mocks)
        self.options: dict[str, dict] = {}

    def RegisterResource(self, request):  # noqa: N802 - gRPC method name
        self.options[request.name] = {"ignoreChanges": list(request.ignoreChanges),
                                      "replaceOnChanges": list(request.replaceOnChanges),
                                      "dependencies": list(request.dependencies)}
        return super().RegisterResource(request)


def test_component_creates_the_queue_jobset_and_pod_monitor_under_mocks():
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region="us-east-1"))
    monitor = _OptionsMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="aws-prod", preview=False, monitor=monitor)
    job = prod_job(suspend=True)
    seen: dict = {}

    @pulumi.runtime.test
    def build():
        comp = t.TrainingJob("job", t.TrainingJobArgs(
            platform=_platform(efa_pool()), job=job, image=pulumi.Output.from_input(IMAGE), cache_endpoint=CACHE,
            tracking_uri=pulumi.Output.from_input(MLFLOW), monitoring_labels={"release": "kube-prometheus-stack"},
        ))
        return pulumi.Output.all(comp.job_name, comp.local_queue, comp.jobset.spec).apply(
            lambda v: seen.update(name=v[0], queue=v[1]))

    build()
    assert seen == {"name": job.name, "queue": "gpt2-350m-pretrain-job"}
    regs = {urn: state for urn, (_, _, state) in monitor.get_registered_resources().items()}
    by_kind = {s.get("kind"): (urn, s) for urn, s in regs.items() if s.get("kind")}
    urn, jobset = by_kind["JobSet"]
    assert "gpu-train:k8s:TrainingJob" in urn  # parented to the component
    assert jobset["apiVersion"] == t.JOBSET_API
    assert jobset["metadata"]["namespace"] == "team-research"
    assert jobset["metadata"]["labels"][t.QUEUE_LABEL] == "gpt2-350m-pretrain-job"
    args = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "data.uri=s3://gpt2-350m-pretrain/manifest.json" in args  # through the cache proxy
    assert f"data.endpoint_url={CACHE}" in args
    assert "checkpoint.remote_uri=s3://gpu-train-aws-prod-checkpoints/research/gpt2-350m-pretrain" in args
    _, queue = by_kind["LocalQueue"]
    assert queue["spec"] == {"clusterQueue": "team-research", "stopPolicy": "HoldAndDrain"}  # job.suspend
    # Pulumi leaves spec.suspend to Kueue after creation, and waits for the queue.
    opts = monitor.options["job-jobset"]
    assert opts["ignoreChanges"] == ["spec.suspend"]
    assert "spec.replicatedJobs" in opts["replaceOnChanges"]
    assert any(d.endswith("::job-localqueue") for d in opts["dependencies"])
    _, pm = by_kind["PodMonitor"]
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert len(pm["spec"]["podMetricsEndpoints"]) == 8


def test_dataset_outside_the_cached_bucket_is_read_directly():
    from dataclasses import replace

    job = replace(prod_job(), dataset_uri="s3://partner-bucket/corpus/manifest.json")
    _, _, cfg = parse_command(trainer_container(build(job, efa_pool())))
    assert cfg.data.uri == "s3://partner-bucket/corpus/manifest.json"
    assert cfg.data.endpoint_url == ""


# ------------------------------------------------------------------------------------------ job lifecycle


def _plan_variant(tmp_path: Path, name: str, edit) -> dict:
    """Plan stacks/Pulumi.aws-dev.yaml changed by `edit(config)`, as `python -m infra.plan --stack-file` does."""
    import subprocess
    import sys

    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.aws-dev.yaml").read_text())
    edit(doc["config"])
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack-file", str(path), "--out", str(tmp_path / "out"),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out" / f"{name}.json").read_text())


def _jobset_inputs(plan: dict) -> dict | None:
    found = [r["inputs"] for r in plan["resources"] if r["type"] == f"kubernetes:{t.JOBSET_API}:JobSet"]
    return found[0] if found else None


def _infra_only(c: dict) -> None:
    """Changes a platform deploy makes that are none of the job's business."""
    c["gpu-train:monitoring"]["retention"] = "30d"
    c["gpu-train:cluster"]["systemNodesMax"] = 4
    c["gpu-train:cache"]["journalGb"] = 30
    c["gpu-train:tags"]["owner"] = "ml-infra"
    c["gpu-train:logs"] = {"retentionDays": 90}
    c["gpu-train:teams"].append({"name": "nlp", "gpuQuota": {"l40s-spot": 1}, "submitters": ["ml-nlp"]})


def test_an_infra_deploy_leaves_the_running_jobset_untouched(tmp_path):
    """The JobSet is replaced when its spec changes (replace_on_changes, test above): an infra-only change must
    render it byte for byte the same, or `pulumi up` would restart training. Its image, buckets, endpoints and
    NVMe path are stable names; nothing in it moves with a deploy."""
    base = _plan_variant(tmp_path / "a", "aws-dev", lambda c: None)  # the same stack name: the same physical names
    changed = _plan_variant(tmp_path / "b", "aws-dev", _infra_only)
    assert _jobset_inputs(base) is not None
    assert _jobset_inputs(changed) == _jobset_inputs(base)
    # The plans did differ: the change reached the platform.
    assert base["resources"] != changed["resources"]
    # A change of the job's own settings does change it.
    steps = _plan_variant(tmp_path / "c", "aws-dev", lambda c: c["gpu-train:job"].update(steps=400))
    assert _jobset_inputs(steps) != _jobset_inputs(base)


def test_a_stack_without_a_job_is_a_platform_for_submitted_jobs(tmp_path):
    plan = _plan_variant(tmp_path, "aws-dev", lambda c: c.pop("gpu-train:job"))
    assert _jobset_inputs(plan) is None
    assert "jobName" not in plan["outputs"] and "jobQueue" not in plan["outputs"]
    contract = plan["outputs"]["platform"]
    assert [team["localQueue"] for team in contract["teams"]] == ["research-queue", "platform-queue"]
    assert contract["image"].split("@")[1].startswith("sha256:")
