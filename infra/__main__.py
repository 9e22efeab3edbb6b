"""The Pulumi program: one stack settings file -> one GPU training environment.

Usage:
    pulumi up --stack aws-dev                 # for real (see README.md)
    python -m infra.plan --stack aws-dev      # offline, under mocks

This file only wires components together and exports outputs. Data flows down: settings ->
cloud layer (returns the ClusterPlatform contract) -> Kubernetes layer -> the training job.
"""

import pulumi

from infra import config, naming
from infra.image import TrainerImage, TrainerImageArgs
from infra.k8s import build_kubernetes
from infra.k8s.contract import PlatformContract, PlatformContractArgs
from infra.k8s.mlflow import MlflowServer, MlflowServerArgs
from infra.k8s.training import TrainingJob, TrainingJobArgs, admission_problems

cfg = config.load()
tags = naming.common_tags(cfg)

if cfg.cloud == "aws":
    from infra.aws import build_platform
else:
    from infra.gcp import build_platform

platform = build_platform(cfg, tags)
if cfg.job is not None:
    # Kueue admits a JobSet whole or not at all: refuse at plan time a job it could never admit, or
    # whose pods cannot fit their nodes, naming the setting.
    problems = admission_problems(job=cfg.job, teams=cfg.teams, pools=platform.gpu_pools, cloud=platform.cloud,
                                  region=platform.region, nvme_host_path=platform.nvme_host_path)
    if problems:
        raise config.ConfigError(problems)
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

# What a team member's `gpu-train` needs to render and check its own jobs exactly as this program renders the
# stack's job: exported as `platform` and published in every team namespace (docs/teams.md).
contract = PlatformContract("platform-contract", PlatformContractArgs(
    platform=platform, cfg=cfg, image=image.ref, cache_endpoint=kube.cache_endpoint,
    tracking_uri=mlflow.tracking_uri if mlflow is not None else "", team_namespaces=list(kube.team_namespaces.values())))

job = None
if cfg.job is not None:
    job = TrainingJob("job", TrainingJobArgs(
        platform=platform,
        job=cfg.job,
        image=image.ref,
        monitoring_labels=kube.monitoring_release_label,
        cache_endpoint=kube.cache_endpoint,
        tracking_uri=mlflow.tracking_uri if mlflow is not None else "",
        register_name=cfg.mlflow.register_name,
        # The monitoring layer's cluster-wide "trainer" PodMonitor already scrapes metrics-<rank> on
        # every JobSet pod; a per-job one would store every series twice.
        pod_monitor=False,
        depends_on=[*platform.ready, *kube.ready],
    ))

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
