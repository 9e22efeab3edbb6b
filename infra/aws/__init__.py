"""The AWS cloud layer: builds the ClusterPlatform on EKS.

Usage (from infra/__main__.py):
    from infra.aws import build_platform
    pools = describe_pools(cfg)               # pure: the pools as jobs see them, for the checks
    problems = check(cfg)                     # the settings only AWS has rules for
    platform = build_platform(cfg, naming.common_tags(cfg.stack, cfg.environment, cfg.tags))

Every AWS resource and data source goes through one explicit provider in `gpu-train:region`
(`aws_provider`), so nothing depends on the caller's AWS_REGION or profile. Order: service-linked roles
-> KMS keys -> network -> buckets -> registry -> EKS cluster (add-ons, system nodes, provider) ->
Karpenter (every GPU pool) -> AWS Load Balancer Controller -> workload identities -> (mlflow.database:
managed) RDS PostgreSQL. See docs/aws.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import pulumi
import pulumi_aws as aws

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from gpu_train.spec.settings import StackSettings
from infra.aws import node_addons, settings_checks
from infra.aws.cluster import Cluster, ClusterArgs
from infra.aws.database import Database, DatabaseArgs
from infra.aws.deploy_runner import DeployRunner, DeployRunnerArgs
from infra.aws.gpu_nodes import NVME_HOST_PATH, network_cards
from infra.aws.identities import WorkloadIdentities, WorkloadIdentitiesArgs, bindings
from infra.aws.karpenter import Karpenter, KarpenterArgs
from infra.aws.keys import Keys, KeysArgs
from infra.aws.load_balancer import LoadBalancerController, LoadBalancerControllerArgs
from infra.aws.log_shipping import LogShipping, LogShippingArgs
from infra.aws.network import Network, NetworkArgs
from infra.aws.registry import ContainerRegistry, RegistryArgs
from infra.aws.service_roles import AUTOSCALING, SPOT, ServiceLinkedRoles, ServiceLinkedRolesArgs
from infra.aws.settings_checks import log_retention_days, team_access_entries
from infra.aws.storage import Storage, StorageArgs
from infra.platform import Buckets, ClusterPlatform, EgressTarget, ManagedDatabase, StorageClassSpec

# The S3 gateway endpoint routes to S3's public address ranges (via the prefix list), so pods'
# NetworkPolicies must allow 443 to them; S3 publishes no small fixed range to name instead.
OBJECT_STORE_CIDRS = ("0.0.0.0/0",)
# Served by the AWS Load Balancer Controller this layer installs (load_balancer.py): an internal NLB
# in the subnets tagged kubernetes.io/role/internal-elb, targeting pod IPs.
INTERNAL_LB_ANNOTATIONS = {
    "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal",
    "service.beta.kubernetes.io/aws-load-balancer-type": "external",
    "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
}
# The EKS Pod Identity agent serves credentials on this node-local address (port 80), which pods'
# NetworkPolicies must allow. Its IPv6 address (fd00:ec2::23) is unused: the cluster is IPv4.
# https://docs.aws.amazon.com/eks/latest/userguide/pod-id-agent-setup.html
POD_IDENTITY_AGENT = EgressTarget("169.254.170.23/32", 80)
SYSTEM_LABELS = {naming.SYSTEM_LABEL: "true"}  # on the system node group's nodes; the controllers run there


def storage_class_parameters(key_arn: pulumi.Input[str]) -> Mapping[str, pulumi.Input[str]]:
    return {"type": "gp3", "encrypted": "true", "kmsKeyId": key_arn, "csi.storage.k8s.io/fstype": "ext4"}


def aws_provider(region: str) -> aws.Provider:
    """The one AWS provider of the program: the stack's region, whatever the caller's environment says."""
    return aws.Provider("aws", region=region)


def describe_pools(cfg: StackSettings) -> list[GpuPool]:
    """The GPU pools as jobs see them, from the settings alone (infra/aws/node_addons.py)."""
    return node_addons.gpu_pools(cfg)


def check(cfg: StackSettings) -> list[str]:
    """Problems of the settings on AWS, before anything is created (infra/aws/settings_checks.py)."""
    return settings_checks.problems(cfg)


def build_platform(cfg: StackSettings, tags: dict[str, str]) -> ClusterPlatform:
    if cfg.cloud != "aws":
        raise ValueError(f"infra.aws.build_platform needs gpu-train:cloud aws (got {cfg.cloud!r})")
    region = cfg.region
    provider = aws_provider(region)
    # Components hand the provider down to their children (and invokes that name a parent).
    on_aws = pulumi.ResourceOptions(providers=[provider])
    account_id = aws.get_caller_identity(opts=pulumi.InvokeOptions(provider=provider)).account_id
    cluster_name = naming.prefix(cfg.stack)
    managed_db = cfg.mlflow.enabled and cfg.mlflow.database == "managed"

    # EC2 Auto Scaling launches the system node group; EC2 Spot's role must exist for Karpenter's spot pools.
    services = [AUTOSCALING] + ([SPOT] if any(p.capacity == "spot" for p in cfg.gpu_pools) else [])
    service_roles = ServiceLinkedRoles("service-roles", ServiceLinkedRolesArgs(
        account_id=account_id, services=services, tags=tags), opts=on_aws)
    keys = Keys("keys", KeysArgs(prefix=cluster_name, account_id=account_id, region=region,
                                 volume_service_roles=[service_roles.arns[AUTOSCALING]],
                                 optional=("rds",) if managed_db else (), tags=tags), opts=on_aws)
    network = Network("network", NetworkArgs(
        cluster_name=cluster_name, region=region, account_id=account_id, zones=cfg.zones,
        vpc_cidr=cfg.network.vpc_cidr, pod_cidr=cfg.network.pod_cidr, nat=cfg.network.nat,
        flow_logs=cfg.network.flow_logs, logs_key_arn=keys.arns["logs"], database_subnets=managed_db, tags=tags),
        opts=on_aws)
    storage = Storage("storage", StorageArgs(prefix=cluster_name, account_id=account_id, region=region,
                                             key_arn=keys.arns["s3"], force_destroy=not cfg.is_prod, tags=tags),
                      opts=on_aws)
    registry = ContainerRegistry("registry", RegistryArgs(name=f"{cluster_name}-trainer", key_arn=keys.arns["ecr"],
                                                          force_delete=not cfg.is_prod, tags=tags), opts=on_aws)
    # Each fabric pool's network cards as EC2 reports them (deploy time), for its EFA interfaces and devices.
    cards = {p.name: network_cards(p.instance_type, pulumi.InvokeOptions(provider=provider))
             for p in cfg.gpu_pools if p.fabric}
    cluster, karpenter = _eks(cfg, tags, provider, account_id, cluster_name, service_roles, keys, network, cards)
    lb_controller, identities, log_shipping = _cluster_services(cfg, tags, on_aws, account_id, cluster_name, keys,
                                                                network, storage, cluster)
    mlflow_database = _mlflow_database(cfg, tags, on_aws, cluster_name, keys, network) if managed_db else None
    pools = node_addons.gpu_pools(cfg, cards)

    return ClusterPlatform(
        cloud="aws", region=region, cluster_name=cluster.cluster_name,
        kubernetes_version=cfg.cluster.kubernetes_version, provider=cluster.provider, kubeconfig=cluster.kubeconfig,
        gpu_pools=pools, system_node_selector=dict(SYSTEM_LABELS), nvme_host_path=NVME_HOST_PATH,
        buckets=Buckets(datasets=storage.uris["datasets"], checkpoints=storage.uris["checkpoints"],
                        artifacts=storage.uris["artifacts"]),
        object_store_endpoint=f"https://s3.{region}.amazonaws.com", object_store_cidrs=list(OBJECT_STORE_CIDRS),
        # EKS places its control-plane ENIs in the node subnets, so the API server is inside the VPC range.
        api_server_cidrs=[cfg.network.vpc_cidr], vpc_cidr=cfg.network.vpc_cidr, pod_cidr=cfg.network.pod_cidr,
        storage_class=StorageClassSpec(name="gp3-encrypted", provisioner="ebs.csi.aws.com",
                                       parameters=storage_class_parameters(keys.arns["ebs"])),
        identities=identities.identities, registry=registry.registry,
        internal_lb_annotations=dict(INTERNAL_LB_ANNOTATIONS),
        ready=[*cluster.ready, karpenter.release, *karpenter.node_pools, lb_controller.release,
               *identities.associations, log_shipping.association],
        workload_identity_egress=[POD_IDENTITY_AGENT], mlflow_database=mlflow_database,
        log_store=log_shipping.store,
        logs={"kind": "cloudwatch", "region": region, "groups": dict(log_shipping.store.groups)},
        node_addons=node_addons.node_addons(pools), pod_env={"AWS_REGION": region})


def _eks(cfg: StackSettings, tags: dict[str, str], provider: aws.Provider, account_id: str, cluster_name: str,
         service_roles: ServiceLinkedRoles, keys: Keys, network: Network,
         cards: Mapping[str, int]) -> tuple[Cluster, Karpenter]:
    """The EKS cluster (add-ons, system nodes, Kubernetes provider), then Karpenter with every GPU pool."""
    cluster = Cluster("cluster", ClusterArgs(
        cluster_name=cluster_name, kubernetes_version=cfg.cluster.kubernetes_version, region=cfg.region,
        account_id=account_id, vpc_id=network.vpc_id, subnet_ids=network.private_subnet_ids,
        pod_subnets={z: s.id for z, s in network.pod_subnets.items()}, service_cidr=cfg.network.service_cidr,
        endpoint_public_access=cfg.cluster.endpoint_public_access,
        public_access_cidrs=cfg.cluster.public_access_cidrs, secrets_key_arn=keys.arns["eks"],
        ebs_key_arn=keys.arns["ebs"], logs_key_arn=keys.arns["logs"],
        system_node_type=cfg.cluster.system_node_type or "m6i.xlarge",
        system_nodes_min=cfg.cluster.system_nodes_min, system_nodes_max=cfg.cluster.system_nodes_max,
        system_labels=SYSTEM_LABELS, ebs_csi_role_name=f"{cluster_name}-ebs-csi",
        access_entries=team_access_entries(cfg.teams), health=cfg.health, tags=tags),
        opts=pulumi.ResourceOptions(providers=[provider]))
    karpenter = Karpenter("karpenter", KarpenterArgs(
        cluster_name=cluster_name, cluster_arn=cluster.cluster_arn, endpoint=cluster.endpoint, region=cfg.region,
        account_id=account_id, vpc_id=network.vpc_id, zones=cfg.zones, controller_role_name=f"{cluster_name}-karpenter",
        sqs_key_arn=keys.arns["sqs"], ebs_key_arn=keys.arns["ebs"],
        kubernetes_version=cfg.cluster.kubernetes_version, provider=cluster.provider,
        system_selector=SYSTEM_LABELS, pools=cfg.gpu_pools, network_cards=cards,
        depends_on=cluster.ready, health=cfg.health, tags=tags),
        opts=pulumi.ResourceOptions(providers=[provider], depends_on=[cluster.cluster, service_roles]))
    return cluster, karpenter


def _cluster_services(cfg: StackSettings, tags: dict[str, str], on_aws: pulumi.ResourceOptions, account_id: str,
                      cluster_name: str, keys: Keys, network: Network, storage: Storage,
                      cluster: Cluster) -> tuple[LoadBalancerController, WorkloadIdentities, LogShipping]:
    """Beside the cluster: the deploy runner (when asked), the Load Balancer Controller, identities, log groups."""
    # gpu-train:deployRunner: a CodeBuild-hosted GitHub Actions runner in the VPC for the deploy
    # workflow, which cannot reach the private API endpoint from GitHub's own runners.
    runner = cfg.deploy_runner
    if runner.kind == "codebuild":
        DeployRunner("deploy-runner", DeployRunnerArgs(
            project=f"{cluster_name}-deploy", region=cfg.region, account_id=account_id, vpc_id=network.vpc_id,
            subnet_ids=network.private_subnet_ids, cluster_security_group_id=cluster.cluster_security_group_id,
            logs_key_arn=keys.arns["logs"], repository=runner.repository, connection_arn=runner.connection_arn,
            tags=tags), opts=on_aws)
    lb_controller = LoadBalancerController("lb-controller", LoadBalancerControllerArgs(
        cluster_name=cluster.cluster_name, region=cfg.region, account_id=account_id, vpc_id=network.vpc_id,
        role_name=f"{cluster_name}-lb-controller", provider=cluster.provider, system_selector=SYSTEM_LABELS,
        depends_on=cluster.ready, tags=tags), opts=on_aws)
    identities = WorkloadIdentities("identities", WorkloadIdentitiesArgs(
        cluster_name=cluster.cluster_name, role_prefix=cluster_name, account_id=account_id,
        bindings=bindings([t.name for t in cfg.teams], cache=cfg.cache.enabled, mlflow=cfg.mlflow.enabled,
                          serving=cfg.serving.enabled),
        resources={**storage.names, "s3_key": keys.arns["s3"]}, depends_on=cluster.addons[:1], tags=tags),
        opts=on_aws)
    # Container logs that outlive their pods: a group per team namespace, written by the Kubernetes layer's
    # log shipper through the VPC's CloudWatch Logs endpoint.
    log_shipping = LogShipping("log-shipping", LogShippingArgs(
        cluster_name=cluster_name, cluster=cluster.cluster_name, region=cfg.region, account_id=account_id,
        teams=[t.name for t in cfg.teams], logs_key_arn=keys.arns["logs"], retention_days=log_retention_days(cfg),
        endpoint_cidrs=[cfg.network.vpc_cidr], depends_on=cluster.addons[:1], tags=tags), opts=on_aws)
    return lb_controller, identities, log_shipping


def _mlflow_database(cfg: StackSettings, tags: dict[str, str], on_aws: pulumi.ResourceOptions, cluster_name: str,
                     keys: Keys, network: Network) -> ManagedDatabase:
    """mlflow.database: managed: RDS PostgreSQL in the database subnets, open to the VPC and pod ranges."""
    return Database("mlflow-db", DatabaseArgs(
        identifier=f"{cluster_name}-mlflow", vpc_id=network.vpc_id,
        subnet_ids=[s.id for s in network.database_subnets.values()], subnet_cidrs=network.database_cidrs,
        client_cidrs=[cfg.network.vpc_cidr, cfg.network.pod_cidr], key_arn=keys.arns["rds"],
        logs_key_arn=keys.arns["logs"], is_prod=cfg.is_prod, storage_gb=cfg.mlflow.storage_gb, tags=tags),
        opts=on_aws).contract
