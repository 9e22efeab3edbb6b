"""The stack's training job in the Pulumi program (infra/k8s/training.py): the TrainingJob component under Pulumi
mocks renders exactly what the one renderer (gpu_train/jobs/jobset.py, tested in tests/gpu_train/jobs) renders,
with the options that leave spec.suspend to Kueue; every stack's job, on the pools its cloud layer describes, is
accepted by torchrun and the trainer and scraped by the platform's PodMonitor; and planned stacks show that an
infra-only deploy leaves the running JobSet untouched.

Run: .venv/bin/pytest tests/infra/k8s/test_training.py -q
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pulumi
import pulumi_kubernetes as k8s
import pytest
import yaml
from pulumi.runtime.mocks import MockMonitor

from gpu_train.jobs.jobset import JOBSET_API, QUEUE_LABEL, Placement, jobset
from gpu_train.spec import naming
from gpu_train.spec.job import JobSpec
from infra import clouds
from infra.aws import node_addons as aws_addons
from infra.aws.gpu_nodes import NVME_HOST_PATH
from infra.k8s import monitoring
from infra.k8s import training as t
from infra.mocks import MockContext, PlanMocks
from infra.platform import Buckets, ClusterPlatform, Registry, StorageClassSpec
from tests.gpu_train.jobs.test_jobset import (
    CACHE,
    IMAGE,
    MLFLOW,
    parse_command,
    pod_template,
    prod_job,
    trainer_container,
    validate_pod,
)
from tests.infra.aws.conftest import stack_cfg
from tests.infra.k8s.harness import STACKS, load_stack, of_kind

ROOT = Path(__file__).resolve().parents[3]
K8S_VERSION = "1.33"
EFA_POOL = {"name": "h100-reserved", "instanceType": "p5.48xlarge", "capacity": "capacity-block",
            "reservationId": "cr-0123456789abcdef0", "minNodes": 2, "maxNodes": 4, "fabric": True, "zone": "us-west-2a"}


def _stack_job_placement(cfg, pool) -> Placement:
    bucket = "s3://" if cfg.cloud == "aws" else "gs://"
    return Placement(pool=pool, image=IMAGE, queue=naming.job_queue_name(cfg.job.name),
                     nvme_host_path=clouds.layer(cfg.cloud).NVME_HOST_PATH,
                     datasets_bucket=f"{bucket}gpu-train-{cfg.stack}-datasets",
                     checkpoints_bucket=f"{bucket}gpu-train-{cfg.stack}-checkpoints", cache_endpoint=CACHE,
                     tracking_uri=MLFLOW, pod_env={"AWS_REGION": cfg.region} if cfg.cloud == "aws" else {},
                     cloud=cfg.cloud, region=cfg.region)


@pytest.mark.parametrize("stack", STACKS)
def test_every_stacks_job_is_accepted_by_the_trainer(stack):
    cfg = load_stack(stack)
    pool = next(p for p in clouds.layer(cfg.cloud).describe_pools(cfg) if p.name == cfg.job.pool)
    m = jobset(cfg.job, _stack_job_placement(cfg, pool))
    validate_pod(m)
    _, _, tcfg = parse_command(trainer_container(m))
    assert tcfg.train.steps == cfg.job.steps
    # Every stack caches its datasets bucket: the job reads through the S3 proxy on both clouds, and
    # writes checkpoints straight to the cloud's object store.
    assert tcfg.data.uri == f"s3://{cfg.job.name}/manifest.json" and tcfg.data.endpoint_url == CACHE
    assert tcfg.checkpoint.remote_uri.startswith("s3://" if cfg.cloud == "aws" else "gs://")


@pytest.mark.parametrize("stack", STACKS)
def test_the_platforms_pod_monitor_scrapes_every_local_rank_of_the_stacks_job(layers, stack):
    """The job has no PodMonitor of its own: the platform's trainer PodMonitor selects every JobSet pod in the team
    namespaces (JobSet labels each pod with its JobSet's name) on every local rank's metrics port."""
    records, _ = layers[stack]
    cfg = load_stack(stack)
    pool = next(p for p in clouds.layer(cfg.cloud).describe_pools(cfg) if p.name == cfg.job.pool)
    m = jobset(cfg.job, _stack_job_placement(cfg, pool))
    (mon,) = [o for o in of_kind(records, "PodMonitor") if o["metadata"]["name"] == monitoring.TRAINER_MONITOR]
    spec = mon["spec"]
    assert m["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
    assert spec["selector"] == {"matchExpressions": [{"key": naming.JOBSET_NAME_LABEL, "operator": "Exists"}]}
    ports = {p["name"] for p in trainer_container(m)["ports"] if p["name"].startswith("metrics-")}
    scraped = {e["port"] for e in spec["podMetricsEndpoints"]}
    assert len(ports) == pool.gpus_per_node and ports <= scraped
    assert {r["targetLabel"] for e in spec["podMetricsEndpoints"] for r in e["relabelings"]} >= {"jobset"}
    assert not [o for o in of_kind(records, "PodMonitor") if o["metadata"]["namespace"] == m["metadata"]["namespace"]]
    assert pod_template(m)["metadata"]["labels"]["app.kubernetes.io/instance"] == cfg.job.name


# ------------------------------------------------------------------------------------------- component


ECR = "123456789012.dkr.ecr.us-east-1.amazonaws.com/"


def _platform() -> tuple[ClusterPlatform, object]:
    out = pulumi.Output.from_input
    (pool,) = aws_addons.gpu_pools(stack_cfg([EFA_POOL]))
    return ClusterPlatform(
        cloud="aws", region="us-east-1", cluster_name=out("c"), kubernetes_version=K8S_VERSION,
        provider=k8s.Provider("k8s", kubeconfig="{}"), kubeconfig=out("{}"), gpu_pools=[pool],
        system_node_selector={naming.SYSTEM_LABEL: "true"}, nvme_host_path=NVME_HOST_PATH,
        buckets=Buckets(datasets=out("s3://gpu-train-aws-prod-datasets"),
                        checkpoints=out("s3://gpu-train-aws-prod-checkpoints"), artifacts=out("s3://a")),
        object_store_endpoint="https://s3.us-east-1.amazonaws.com", object_store_cidrs=[], api_server_cidrs=[],
        vpc_cidr="10.20.0.0/16", pod_cidr="100.64.0.0/16",
        storage_class=StorageClassSpec(name="enc", provisioner="ebs.csi.aws.com", parameters={}),
        identities={}, registry=Registry(repository=out(ECR + "gpu-train-aws-prod-trainer"), server=out("s"),
                                          username=out("u"), password=out("p")),
        internal_lb_annotations={}, pod_env={"AWS_REGION": "us-east-1"},
    ), pool


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


def test_component_creates_the_queue_and_the_renderers_jobset_under_mocks():
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region="us-east-1"))
    monitor = _OptionsMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="aws-prod", preview=False, monitor=monitor)
    job = prod_job(suspend=True)
    seen: dict = {}

    @pulumi.runtime.test
    def build():
        platform, _ = _platform()
        comp = t.TrainingJob("job", t.TrainingJobArgs(
            platform=platform, job=job, image=pulumi.Output.from_input(IMAGE), cache_endpoint=CACHE,
            tracking_uri=pulumi.Output.from_input(MLFLOW),
        ))
        return pulumi.Output.all(comp.job_name, comp.local_queue, comp.jobset.spec).apply(
            lambda v: seen.update(name=v[0], queue=v[1]))

    build()
    assert seen == {"name": job.name, "queue": "gpt2-350m-pretrain-job"}
    regs = {urn: state for urn, (_, _, state) in monitor.get_registered_resources().items()}
    by_kind = {s.get("kind"): (urn, s) for urn, s in regs.items() if s.get("kind")}
    assert set(by_kind) == {"JobSet", "LocalQueue"}  # the platform's trainer PodMonitor scrapes it
    urn, registered = by_kind["JobSet"]
    assert "gpu-train:k8s:TrainingJob" in urn  # parented to the component
    assert registered["apiVersion"] == JOBSET_API
    assert registered["metadata"]["namespace"] == "team-research"
    assert registered["metadata"]["labels"][QUEUE_LABEL] == "gpt2-350m-pretrain-job"
    args = registered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "data.uri=s3://gpt2-350m-pretrain/manifest.json" in args  # through the cache proxy
    assert f"data.endpoint_url={CACHE}" in args
    assert "checkpoint.remote_uri=s3://gpu-train-aws-prod-checkpoints/research/gpt2-350m-pretrain" in args
    # Exactly what `gpu-train submit` would render for the same job on the same platform, but on the job's own
    # LocalQueue.
    _, pool = _platform()
    expected = jobset(job, Placement(
        pool=pool, image=IMAGE, queue=naming.job_queue_name(job.name), nvme_host_path=NVME_HOST_PATH,
        datasets_bucket="s3://gpu-train-aws-prod-datasets", checkpoints_bucket="s3://gpu-train-aws-prod-checkpoints",
        cache_endpoint=CACHE, tracking_uri=MLFLOW, pod_env={"AWS_REGION": "us-east-1"}, cloud="aws",
        region="us-east-1"))
    assert json.loads(json.dumps({k: registered[k] for k in ("metadata", "spec")})) == json.loads(json.dumps(
        {k: expected[k] for k in ("metadata", "spec")}))
    _, queue = by_kind["LocalQueue"]
    assert queue["spec"] == {"clusterQueue": "team-research", "stopPolicy": "HoldAndDrain"}  # job.suspend
    # Pulumi leaves spec.suspend to Kueue after creation, and waits for the queue.
    opts = monitor.options["job-jobset"]
    assert opts["ignoreChanges"] == ["spec.suspend"]
    assert "spec.replicatedJobs" in opts["replaceOnChanges"]
    assert any(d.endswith("::job-localqueue") for d in opts["dependencies"])


def _stack_job(job, **kw) -> dict:
    """The TrainingJob component's JobSet under fresh mocks (what `pulumi up` would create)."""
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region="us-east-1"))
    monitor = MockMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="aws-prod", preview=False, monitor=monitor)

    @pulumi.runtime.test
    def build():
        platform, _ = _platform()
        comp = t.TrainingJob("job", t.TrainingJobArgs(platform=platform, job=job, image=pulumi.Output.from_input(IMAGE),
                                                      cache_endpoint=CACHE, **kw))
        return comp.jobset.spec

    build()
    regs = [state for _, _, state in monitor.get_registered_resources().values()]
    return next(s for s in regs if s.get("kind") == "JobSet")


def test_the_stacks_job_runs_its_own_image_from_the_platform_or_an_allowed_registry():
    """The registry's name is known only once the cloud layer has made it: the component checks `job.image` then,
    and a refusal fails the plan naming the setting (Pulumi reports it as the JobSet's input error)."""
    own = JobSpec.model_validate(dict(name="own-model", team="research", pool="h100-reserved", nodes="2:4",
                                      gpus_per_node=8, image=ECR + "research/own@sha256:" + "e" * 64,
                                      command=["python", "train.py"]))
    container = _stack_job(own)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == own.image and container["args"][-1] == "train.py"
    ghcr = own.model_copy(update={"image": "ghcr.io/acme/own@sha256:" + "f" * 64})
    assert _stack_job(ghcr, allowed_registries=("ghcr.io/acme/",))["metadata"]["name"] == own.name
    with pytest.raises(ValueError) as err:
        _stack_job(ghcr)
    assert (f"gpu-train:job.image {ghcr.image}: team namespaces admit only images from the platform registry or an "
            f"allowed one ({ECR}; the stack setting image.allowedRegistries adds registries)") in str(err.value)


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
    found = [r["inputs"] for r in plan["resources"] if r["type"] == f"kubernetes:{JOBSET_API}:JobSet"]
    return found[0] if found else None


def _infra_only(c: dict) -> None:
    """Changes a platform deploy makes that are none of the job's business."""
    c["gpu-train:monitoring"]["retention"] = "30d"
    c["gpu-train:cluster"]["systemNodesMax"] = 4
    c["gpu-train:cache"]["journalGb"] = 30
    c["gpu-train:tags"]["owner"] = "ml-infra"
    c["gpu-train:logs"] = {"retentionDays": 90}
    c["gpu-train:teams"].append({"name": "nlp", "gpuQuota": {"l40s-spot": 1}, "submitters": ["ml-nlp"]})


@pytest.mark.integration  # runs the Pulumi program
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


@pytest.mark.integration  # runs the Pulumi program
def test_a_stack_without_a_job_is_a_platform_for_submitted_jobs(tmp_path):
    plan = _plan_variant(tmp_path, "aws-dev", lambda c: c.pop("gpu-train:job"))
    assert _jobset_inputs(plan) is None
    assert "jobName" not in plan["outputs"] and "jobQueue" not in plan["outputs"]
    contract = plan["outputs"]["platform"]
    assert [team["localQueue"] for team in contract["teams"]] == ["research-queue", "platform-queue"]
    assert contract["image"].split("@")[1].startswith("sha256:")
