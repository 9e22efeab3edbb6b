"""The Pulumi program: one stack settings file -> one GPU training environment.

Usage:
    pulumi up --stack aws-dev                 # for real (see README.md)
    python -m infra.plan --stack aws-dev      # offline, under mocks

This file only wires components together and exports outputs. Data flows down: settings ->
cloud layer (returns the ClusterPlatform contract) -> Kubernetes layer -> the training job.
"""

import pulumi

from infra import config, naming

cfg = config.load()
tags = naming.common_tags(cfg)

if cfg.cloud == "aws":
    from infra.aws import build_platform
else:
    from infra.gcp import build_platform

platform = build_platform(cfg, tags)

pulumi.export("cloud", cfg.cloud)
pulumi.export("clusterName", platform.cluster_name)
pulumi.export("kubeconfig", pulumi.Output.secret(platform.kubeconfig))
pulumi.export("datasetsBucket", platform.buckets.datasets)
pulumi.export("checkpointsBucket", platform.buckets.checkpoints)
pulumi.export("artifactsBucket", platform.buckets.artifacts)
