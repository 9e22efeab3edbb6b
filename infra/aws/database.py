"""Managed PostgreSQL (Amazon RDS) for MLflow: private, KMS-encrypted, TLS-only.

Usage (build_platform does this when `gpu-train:mlflow.database` is `managed`):
    db = Database("mlflow-db", DatabaseArgs(...))
    db.contract       # infra.platform.ManagedDatabase for the Kubernetes layer
    instance_settings(is_prod=True, storage_gb=20)   # pure: class, HA, retention, protection

Placement: the network's dedicated database subnets (one small subnet per AZ on a route table with
no NAT or internet route; see infra/aws/network.py). The security group admits 5432 only from the
node range and the pod range; there is no egress rule. The master password is generated here from
the OS CSPRNG and kept only in Pulumi's encrypted state and the cluster's Secret (see docs/aws.md,
"Managed database", for why this and not RDS-managed Secrets Manager passwords).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.platform import ManagedDatabase, generate_password

# Pinned minor: upgrades are a reviewed change of this constant, never a silent drift between the
# program and the instance (auto minor upgrades are off for the same reason).
ENGINE_VERSION = "16.8"
PARAMETER_FAMILY = "postgres16"
PORT = 5432
DATABASE = "mlflow"
USERNAME = "mlflow"
MIN_STORAGE_GB = 20  # the smallest gp3 volume RDS for PostgreSQL accepts
CA_CERT = "rds-ca-rsa2048-g1"
LOG_EXPORTS = ("postgresql", "upgrade")


@dataclass(frozen=True, kw_only=True)
class InstanceSettings:
    instance_class: str
    multi_az: bool
    allocated_storage: int
    max_allocated_storage: int  # storage autoscaling ceiling
    backup_retention_days: int
    deletion_protection: bool


def instance_settings(*, is_prod: bool, storage_gb: int) -> InstanceSettings:
    """Sizing and safety by environment (pure). MLflow's metadata load is light; prod gets HA."""
    if storage_gb < 1:
        raise ValueError(f"gpu-train:mlflow.storageGb must be >= 1 (got {storage_gb})")
    allocated = max(storage_gb, MIN_STORAGE_GB)
    return InstanceSettings(
        instance_class="db.m7g.large" if is_prod else "db.t4g.medium",
        multi_az=is_prod,
        allocated_storage=allocated,
        max_allocated_storage=allocated * 5,
        backup_retention_days=14 if is_prod else 7,
        deletion_protection=is_prod,
    )


def parameters() -> dict[str, str]:
    """Parameter group values: TLS required, connection auditing, slow statements logged."""
    return {
        # Also the PostgreSQL 15+ default on RDS; set explicitly so a changed default cannot weaken it.
        # https://docs.aws.amazon.com/AmazonRDS/latest/UserGuide/PostgreSQL.Concepts.General.SSL.html
        "rds.force_ssl": "1",
        "log_connections": "1",
        "log_disconnections": "1",
        "log_min_duration_statement": "1000",
    }


@dataclass(frozen=True, kw_only=True)
class DatabaseArgs:
    identifier: str  # RDS instance identifier, e.g. gpu-train-aws-prod-mlflow
    vpc_id: pulumi.Input[str]  # the cluster VPC
    subnet_ids: Sequence[pulumi.Input[str]]  # database subnets, at least two AZs
    subnet_cidrs: Sequence[str]  # their CIDRs (the platform's `ManagedDatabase.cidrs`, for NetworkPolicy egress)
    client_cidrs: Sequence[str]  # who may connect on 5432: the node and pod ranges
    key_arn: pulumi.Input[str]  # the "rds" KMS key (storage, backups, Performance Insights)
    logs_key_arn: pulumi.Input[str]  # the "logs" KMS key for the exported log groups
    is_prod: bool  # HA, retention and deletion protection
    storage_gb: int  # cfg.mlflow.storageGb
    tags: Mapping[str, str]  # common tags


class Database(pulumi.ComponentResource):
    def __init__(self, name: str, args: DatabaseArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Database", name, None, opts)
        if len(args.subnet_ids) < 2:
            raise ValueError("a managed database needs subnets in at least two availability zones "
                             f"(gpu-train:zones lists {len(args.subnet_ids)})")
        for cidr in args.client_cidrs:
            if cidr.endswith("/0"):
                raise ValueError(f"database clients must be inside the VPC, not {cidr}")
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        s = instance_settings(is_prod=args.is_prod, storage_gb=args.storage_gb)

        subnets = aws.rds.SubnetGroup(name, name=args.identifier, description=f"{args.identifier} database subnets",
                                      subnet_ids=list(args.subnet_ids), tags=tags, opts=child)
        self.security_group = aws.ec2.SecurityGroup(
            name, vpc_id=args.vpc_id, description=f"PostgreSQL for {args.identifier} from nodes and pods only",
            ingress=[aws.ec2.SecurityGroupIngressArgs(protocol="tcp", from_port=PORT, to_port=PORT,
                                                      cidr_blocks=list(args.client_cidrs),
                                                      description="PostgreSQL from nodes and pods")],
            # No egress rule: the database never opens connections.
            egress=[], tags={**tags, "Name": args.identifier}, opts=child)
        params = aws.rds.ParameterGroup(
            name, name=args.identifier, family=PARAMETER_FAMILY, description=f"{args.identifier} PostgreSQL settings",
            parameters=[aws.rds.ParameterGroupParameterArgs(name=k, value=v, apply_method="pending-reboot"
                                                            if k == "rds.force_ssl" else "immediate")
                        for k, v in parameters().items()],
            tags=tags, opts=child)
        # RDS creates these on first export, unencrypted; creating them first encrypts them with our key.
        log_groups = [aws.cloudwatch.LogGroup(f"{name}-{kind}", name=f"/aws/rds/instance/{args.identifier}/{kind}",
                                              retention_in_days=90, kms_key_id=args.logs_key_arn, tags=tags,
                                              opts=child)
                      for kind in LOG_EXPORTS]

        # Drawn once: ignore_changes keeps the value the instance was created with on every later run
        # (each run draws a new candidate, which is discarded), and `password` below is read back
        # from the resource, so the Kubernetes Secret always carries the one the instance has.
        self.instance = aws.rds.Instance(
            name, identifier=args.identifier, engine="postgres", engine_version=ENGINE_VERSION,
            instance_class=s.instance_class, allocated_storage=s.allocated_storage,
            max_allocated_storage=s.max_allocated_storage, storage_type="gp3",
            storage_encrypted=True, kms_key_id=args.key_arn,
            db_name=DATABASE, username=USERNAME, password=pulumi.Output.secret(generate_password()), port=PORT,
            db_subnet_group_name=subnets.name, vpc_security_group_ids=[self.security_group.id],
            parameter_group_name=params.name, publicly_accessible=False, network_type="IPV4",
            multi_az=s.multi_az, ca_cert_identifier=CA_CERT,
            iam_database_authentication_enabled=True,
            backup_retention_period=s.backup_retention_days, backup_window="03:00-04:00",
            maintenance_window="sun:04:30-sun:05:30", copy_tags_to_snapshot=True,
            deletion_protection=s.deletion_protection, skip_final_snapshot=not args.is_prod,
            final_snapshot_identifier=f"{args.identifier}-final" if args.is_prod else None,
            auto_minor_version_upgrade=False, apply_immediately=not args.is_prod,
            performance_insights_enabled=True, performance_insights_kms_key_id=args.key_arn,
            performance_insights_retention_period=7,
            enabled_cloudwatch_logs_exports=list(LOG_EXPORTS),
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=log_groups, ignore_changes=["password"],
                                        additional_secret_outputs=["password"]))
        self.contract = ManagedDatabase(
            host=self.instance.address, port=PORT, database=DATABASE, username=USERNAME,
            password=pulumi.Output.secret(self.instance.password.apply(lambda p: p or "")),
            cidrs=list(args.subnet_cidrs), sslmode="require")
        self.register_outputs({"address": self.instance.address, "security_group": self.security_group.id})
