"""The stack's training job: its own LocalQueue and the JobSet the one renderer makes (gpu_train/jobs/jobset.py).

Usage (in infra/__main__.py, after the image, the Kubernetes layer and MLflow):
    job = TrainingJob("job", TrainingJobArgs(platform=platform, job=cfg.job, image=image.ref, ...))
    pulumi.export("jobName", job.job_name)

The JobSet is rendered exactly as `gpu-train submit` renders a team's job, from the job spec and the platform's
facts (the platform's trainer image, or the job's own `image`, which must come from the platform registry or an
allowed one: checked here, once the registry's name is known); the one difference is the queue: the stack's job has a LocalQueue of its own, whose stopPolicy pauses it
(`job.suspend` with `pulumi up`: HoldAndDrain evicts it and releases the quota, None admits it again). Whether
Kueue can admit the job and its pods fit their nodes was checked before any resource was created
(gpu_train/jobs/check.py, from infra/__main__.py). docs/deploy-job.md gives the job's shape and what happens on
each failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.jobs.jobset import JOBSET_API, Placement, Provenance, jobset, local_queue
from gpu_train.spec import naming
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.job import JobSpec, image_problems
from gpu_train.spec.pod_rules import registry_prefix
from infra.platform import ClusterPlatform


@dataclass(frozen=True, kw_only=True)
class TrainingJobArgs:
    platform: ClusterPlatform  # k8s provider, GPU pools, buckets, NVMe path, pod environment
    job: JobSpec  # the stack's job settings (cfg.job)
    image: pulumi.Input[str]  # digest-pinned trainer image (TrainerImage.ref)
    cache_endpoint: pulumi.Input[str] = ""  # Alluxio S3 proxy URL; "" = read the datasets bucket directly
    tracking_uri: pulumi.Input[str] = ""  # MLflow tracking URL; "" = the trainer's local store on NVMe
    register_name: str = ""  # MLflow registered model name for the final model ("" = the job name)
    spec_path: str = ""  # where the job's settings live (stacks/Pulumi.<stack>.yaml), for the JobSet's annotation
    # Images the team namespaces admit besides the platform registry (image.allowedRegistries, image.prebuilt's
    # repository): a `job.image` must come from one of them or from the platform registry.
    allowed_registries: Sequence[str] = ()
    allowed_repositories: Sequence[str] = ()
    # What must exist first (KubernetesLayer.ready: CRDs, the team's namespace and ClusterQueue, SA).
    depends_on: Sequence[pulumi.Resource] = ()


class TrainingJob(pulumi.ComponentResource):
    """The job's LocalQueue and its JobSet in the team's namespace."""

    job_name: pulumi.Output[str]
    namespace: pulumi.Output[str]
    local_queue: pulumi.Output[str]

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:TrainingJob", name, None, opts)
        job, platform = args.job, args.platform
        pool = platform.pool(job.pool)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=platform.provider, depends_on=list(args.depends_on))

        lq = local_queue(job)
        # Declarative pause: `pulumi up` with job.suspend sets stopPolicy; Kueue does the rest.
        self.queue = k8s.apiextensions.CustomResource(
            f"{name}-localqueue", api_version=lq["apiVersion"], kind=lq["kind"],
            metadata=lq["metadata"], spec=lq["spec"], opts=k8s_opts)

        def build(values: list[Any]) -> dict[str, Any]:
            image, datasets, checkpoints, cache, tracking, repository = values
            if job.image:  # the platform registry is known only now: the settings checks saw the digest alone
                problems = image_problems(job.image, registries=[registry_prefix(repository),
                                                                 *args.allowed_registries],
                                          repositories=args.allowed_repositories, key=f"{naming.PROJECT}:job.image")
                if problems:
                    raise SettingsError(problems)
            return jobset(job, Placement(
                pool=pool, image=image, queue=naming.job_queue_name(job.name), nvme_host_path=platform.nvme_host_path,
                datasets_bucket=datasets, checkpoints_bucket=checkpoints, cache_endpoint=cache or "",
                tracking_uri=tracking or "", register_name=args.register_name, pod_env=dict(platform.pod_env),
                cloud=platform.cloud, region=platform.region, provenance=Provenance(path=args.spec_path)))

        manifest = pulumi.Output.all(args.image, platform.buckets.datasets, platform.buckets.checkpoints,
                                     args.cache_endpoint, args.tracking_uri, platform.registry.repository).apply(build)
        self.jobset = k8s.apiextensions.CustomResource(
            f"{name}-jobset",
            api_version=JOBSET_API,
            kind="JobSet",
            metadata=manifest.apply(lambda m: m["metadata"]),
            spec=manifest.apply(lambda m: m["spec"]),
            opts=pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(
                depends_on=[self.queue],
                # Kueue owns spec.suspend once the JobSet exists: with ignoreChanges the provider leaves the field
                # out of its server-side apply while another manager owns it
                # (https://github.com/pulumi/pulumi-kubernetes/pull/2566), so `pulumi up` never flips it.
                ignore_changes=["spec.suspend"],
                # JobSet rejects changes to a running job's template; any other change recreates the JobSet, which
                # resumes from the newest checkpoint in object storage.
                replace_on_changes=["spec.replicatedJobs", "spec.network", "spec.failurePolicy",
                                    "spec.successPolicy"],
                delete_before_replace=True,
            )),
        )
        self.job_name = pulumi.Output.from_input(job.name)
        self.namespace = pulumi.Output.from_input(naming.team_namespace(job.team))
        self.local_queue = pulumi.Output.from_input(naming.job_queue_name(job.name))
        self.register_outputs({"jobName": self.job_name, "namespace": self.namespace,
                               "localQueue": self.local_queue})
