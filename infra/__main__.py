"""The Pulumi program: one stack settings file -> one GPU training environment.

Usage:
    pulumi up --stack aws-dev                 # for real (see README.md)
    python -m infra.plan --stack aws-dev      # offline, under mocks

This file only wires components together and exports outputs. Data flows down: settings -> cloud layer (returns
the ClusterPlatform contract) -> Kubernetes layer -> the training job. Every check runs before the first resource:
the settings' types and cloud-neutral rules (infra/settings.py), the cloud's own rules, and whether Kueue could
ever admit the stack's job and its pods fit their nodes (gpu_train/jobs/check.py, against the pools as the cloud
describes them).
"""

import importlib

import pulumi

from gpu_train.jobs.check import check_job
from gpu_train.spec import naming
from gpu_train.spec import queues as kueue
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.settings_checks import BUCKET_SCHEME
from infra import settings
from infra.image import TrainerImage, TrainerImageArgs
from infra.k8s import build_kubernetes
from infra.k8s.contract import PlatformContract, PlatformContractArgs
from infra.k8s.mlflow import MlflowServer, MlflowServerArgs
from infra.k8s.training import TrainingJob, TrainingJobArgs

cfg = settings.load()
# infra.aws or infra.gcp: each has check(), describe_pools(), NVME_HOST_PATH and build_platform().
cloud = importlib.import_module(f"infra.{cfg.cloud}")

problems = cloud.check(cfg)
if cfg.job is not None and not problems:
    # Kueue admits a JobSet whole or not at all: refuse a job it could never admit, or whose pods cannot fit their
    # nodes, naming the setting, before anything exists.
    pools = cloud.describe_pools(cfg)
    nvme = cloud.NVME_HOST_PATH
    problems = check_job(
        cfg.job, pools=pools, teams=kueue.team_entries(cfg.teams, pools, nvme),
        kueue=kueue.kueue_objects(cfg.teams, pools),
        nvme_host_path=nvme, scheme=BUCKET_SCHEME[cfg.cloud], queue=naming.job_queue_name(cfg.job.name))
if problems:
    raise SettingsError(problems)

tags = naming.common_tags(cfg.stack, cfg.environment, cfg.tags)
platform = cloud.build_platform(cfg, tags)
kube = build_kubernetes(platform, cfg)

mlflow = None
if cfg.mlflow.enabled:
    mlflow = MlflowServer("mlflow", MlflowServerArgs(
        provider=platform.provider,
        identity=platform.identities["mlflow"],
        artifacts_bucket=platform.buckets.artifacts,
        storage_class=kube.storage_class_name,
        object_store_cidrs=platform.object_store_cidrs,
        api_server_cidrs=platform.api_server_cidrs,
        cluster_cidrs=(platform.pod_cidr, platform.vpc_cidr),
        node_selector=platform.system_node_selector,
        labels=tags,
        database=cfg.mlflow.database,
        external_database=platform.mlflow_database,
        storage_gb=cfg.mlflow.storage_gb,
        db_instances=2 if cfg.is_prod else 1,
        identity_egress=platform.workload_identity_egress,
        depends_on=[*platform.ready, *kube.ready],
    ))

image = TrainerImage("trainer", TrainerImageArgs(registry=platform.registry, prebuilt=cfg.image.prebuilt))
tracking_uri = mlflow.tracking_uri if mlflow is not None else ""

# What a team member's `gpu-train` needs to render and check its own jobs exactly as this program renders the
# stack's job: exported as `platform` and published in every team namespace (docs/teams.md).
contract = PlatformContract("platform-contract", PlatformContractArgs(
    platform=platform, cfg=cfg, image=image.ref, cache_endpoint=kube.cache_endpoint,
    tracking_uri=tracking_uri, team_namespaces=list(kube.team_namespaces.values())))

job = None
if cfg.job is not None:
    job = TrainingJob("job", TrainingJobArgs(
        platform=platform, job=cfg.job, image=image.ref, cache_endpoint=kube.cache_endpoint,
        tracking_uri=tracking_uri, register_name=cfg.mlflow.register_name,
        depends_on=[*platform.ready, *kube.ready]))

pulumi.export("cloud", cfg.cloud)
pulumi.export("trainerImage", image.ref)
pulumi.export("clusterName", platform.cluster_name)
pulumi.export("kubeconfig", pulumi.Output.secret(platform.kubeconfig))
pulumi.export("datasetsBucket", platform.buckets.datasets)
pulumi.export("checkpointsBucket", platform.buckets.checkpoints)
pulumi.export("artifactsBucket", platform.buckets.artifacts)
pulumi.export("cacheEndpoint", kube.cache_endpoint)
pulumi.export("grafanaUrl", kube.grafana_url)
pulumi.export("localQueues", kube.local_queue)
pulumi.export("platform", contract.document)
if mlflow is not None:
    pulumi.export("mlflowTrackingUri", mlflow.tracking_uri)
if job is not None:
    pulumi.export("jobName", job.job_name)
    pulumi.export("jobQueue", job.local_queue)
