"""The Pulumi program: one stack settings file -> one GPU training environment.

Usage:
    pulumi up --stack aws-dev                 # for real (see README.md)
    python -m infra.plan --stack aws-dev      # offline, under mocks

This file only wires components together and exports outputs. Data flows down: settings -> cloud layer (returns
the ClusterPlatform) -> Kubernetes layer -> the training job. Every check runs before the first resource:
the settings' types and cloud-neutral rules (infra/settings.py), then the cloud's own rules and whether Kueue
could ever admit the stack's job and its pods fit their nodes (infra/clouds.py).
"""

import pulumi

from gpu_train.spec import naming
from gpu_train.spec.pod_rules import repository_of
from infra import clouds, settings
from infra.carbon import plan_notes
from infra.image import TrainerImage, TrainerImageArgs
from infra.k8s import build_kubernetes
from infra.k8s.contract import PlatformContract, PlatformContractArgs
from infra.k8s.training import TrainingJob, TrainingJobArgs

cfg = settings.load()
clouds.require_valid(cfg)  # every check, before the first resource
for note in plan_notes(cfg):  # the job's estimated emissions and the region advisory (docs/carbon.md)
    pulumi.log.info(note)
cloud = clouds.layer(cfg.cloud)

tags = naming.common_tags(cfg.stack, cfg.environment, cfg.tags)
platform = cloud.build_platform(cfg, tags)
image = TrainerImage("trainer", TrainerImageArgs(registry=platform.registry, prebuilt=cfg.image.prebuilt))
kube = build_kubernetes(platform, cfg, image=image.ref)  # MLflow and serving too
tracking_uri = kube.tracking_uri

# What a team member's `gpu-train` needs to render and check its own jobs exactly as this program renders the
# stack's job: exported as `platform` and published in every team namespace (docs/teams.md).
prebuilt = (repository_of(cfg.image.prebuilt),) if cfg.image.prebuilt else ()
contract = PlatformContract("platform-contract", PlatformContractArgs(
    platform=platform, stack=cfg.stack, project=cfg.project, teams=cfg.teams,
    allowed_registries=cfg.image.allowed_registries, repositories=prebuilt, image=image.ref,
    cache_endpoint=kube.cache_endpoint,
    tracking_uri=tracking_uri, team_namespaces=list(kube.team_namespaces.values()),
    serving=kube.serving.contract if kube.serving is not None else None))

job = None
if cfg.job is not None:
    job = TrainingJob("job", TrainingJobArgs(
        platform=platform, job=cfg.job, image=image.ref, cache_endpoint=kube.cache_endpoint,
        tracking_uri=tracking_uri, register_name=cfg.mlflow.register_name,
        spec_path=f"stacks/Pulumi.{cfg.stack}.yaml", allowed_registries=cfg.image.allowed_registries,
        allowed_repositories=prebuilt,
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
if kube.mlflow is not None:
    pulumi.export("mlflowTrackingUri", kube.mlflow.tracking_uri)
if job is not None:
    pulumi.export("jobName", job.job_name)
    pulumi.export("jobQueue", job.local_queue)
