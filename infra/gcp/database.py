"""Managed PostgreSQL (Cloud SQL) for MLflow: private IP only, CMEK, TLS-only.

Usage (build_platform does this when `gpu-train:mlflow.database` is `managed`):
    db = Database("mlflow-db", DatabaseArgs(stack=cfg.stack, project=..., region=..., is_prod=True,
                                            storage_gb=20, psa_cidr=psa_range(cfg), labels=tags,
                                            network=net.network, kms_key=...))
    db.contract        # infra.platform.ManagedDatabase for the Kubernetes layer
    instance_settings(is_prod=True, storage_gb=20)   # pure: tier, HA, retention, protection

Private Service Access: a /20 of the VPC (`network.psa_range`) is allocated to Google's service
producer network and peered in (`servicenetworking.Connection`); the instance gets an address from
it and no public address at all. The range is the platform's `ManagedDatabase.cidrs`, so MLflow's NetworkPolicy
allows 5432 to exactly that range. The `mlflow` user's password is generated here (OS CSPRNG),
kept only in Pulumi's encrypted state and the cluster's Secret; see docs/gcp.md.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming
from infra.platform import ManagedDatabase, generate_password

DATABASE_VERSION = "POSTGRES_16"
PORT = 5432
DATABASE = "mlflow"
USERNAME = "mlflow"
MIN_DISK_GB = 10  # Cloud SQL's smallest disk


@dataclass(frozen=True, kw_only=True)
class InstanceSettings:
    tier: str
    availability_type: str  # REGIONAL (synchronous standby in another zone) | ZONAL
    disk_gb: int
    retained_backups: int
    deletion_protection: bool


def instance_settings(*, is_prod: bool, storage_gb: int) -> InstanceSettings:
    """Sizing and safety by environment (pure). MLflow's metadata load is light; prod gets HA."""
    if storage_gb < 1:
        raise ValueError(f"gpu-train:mlflow.storageGb must be >= 1 (got {storage_gb})")
    return InstanceSettings(
        tier="db-custom-2-7680" if is_prod else "db-custom-1-3840",
        availability_type="REGIONAL" if is_prod else "ZONAL",
        disk_gb=max(storage_gb, MIN_DISK_GB),
        retained_backups=14 if is_prod else 7,
        deletion_protection=is_prod,
    )


def psa_address(cidr: str) -> tuple[str, int]:
    """(network address, prefix length) of a PSA range, as GlobalAddress takes them."""
    net = ipaddress.IPv4Network(cidr, strict=True)
    return str(net.network_address), net.prefixlen


@dataclass(frozen=True, kw_only=True)
class DatabaseArgs:
    stack: str  # the Pulumi stack name (names the instance and its PSA range)
    project: str  # GCP project id
    region: str  # the instance's region
    is_prod: bool  # instance_settings: HA, more backups, deletion protection and `protect`
    storage_gb: int  # gpu-train:mlflow.storageGb (raised to Cloud SQL's smallest disk)
    psa_cidr: str  # the Private Service Access range (network.psa_range), clear of every stack range
    labels: dict[str, str]  # common labels (user_labels on the instance)
    network: gcp.compute.Network  # the cluster VPC the instance is peered into
    kms_key: pulumi.Input[str]  # the "sql" Cloud KMS key id
    depends_on: tuple[pulumi.Resource, ...] = ()  # the key's grant to the Cloud SQL service agent


class Database(pulumi.ComponentResource):
    def __init__(self, name: str, args: DatabaseArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:Database", name, None, opts)
        project = args.project
        child = pulumi.ResourceOptions(parent=self)
        s = instance_settings(is_prod=args.is_prod, storage_gb=args.storage_gb)
        self.psa_cidr = args.psa_cidr
        address, prefix = psa_address(self.psa_cidr)

        psa = gcp.compute.GlobalAddress(
            f"{name}-psa", name=naming.resource_name(args.stack, "psa"), project=project, purpose="VPC_PEERING",
            address_type="INTERNAL", address=address, prefix_length=prefix, network=args.network.id,
            description="Private Service Access range (Cloud SQL private IP)", labels=args.labels, opts=child)
        # ABANDON on delete: the peering cannot be removed while the producer still holds addresses
        # (Cloud SQL keeps them for days after an instance is deleted); removing the range suffices.
        peering = gcp.servicenetworking.Connection(
            f"{name}-psa", network=args.network.id, service="servicenetworking.googleapis.com",
            reserved_peering_ranges=[psa.name], deletion_policy="ABANDON", opts=child)

        self.instance = gcp.sql.DatabaseInstance(
            name, name=naming.resource_name(args.stack, "mlflow"), project=project, region=args.region,
            database_version=DATABASE_VERSION, encryption_key_name=args.kms_key,
            deletion_protection=s.deletion_protection,
            settings=gcp.sql.DatabaseInstanceSettingsArgs(
                tier=s.tier, edition="ENTERPRISE", availability_type=s.availability_type,
                disk_type="PD_SSD", disk_size=s.disk_gb, disk_autoresize=True,
                deletion_protection_enabled=s.deletion_protection,
                ip_configuration=gcp.sql.DatabaseInstanceSettingsIpConfigurationArgs(
                    ipv4_enabled=False, private_network=args.network.id, allocated_ip_range=psa.name,
                    ssl_mode="ENCRYPTED_ONLY", enable_private_path_for_google_cloud_services=False),
                backup_configuration=gcp.sql.DatabaseInstanceSettingsBackupConfigurationArgs(
                    enabled=True, point_in_time_recovery_enabled=True, start_time="03:00",
                    transaction_log_retention_days=7,
                    backup_retention_settings=gcp.sql.DatabaseInstanceSettingsBackupConfigurationBackupRetentionSettingsArgs(
                        retained_backups=s.retained_backups, retention_unit="COUNT")),
                maintenance_window=gcp.sql.DatabaseInstanceSettingsMaintenanceWindowArgs(
                    day=7, hour=4, update_track="stable"),
                insights_config=gcp.sql.DatabaseInstanceSettingsInsightsConfigArgs(query_insights_enabled=True),
                database_flags=[gcp.sql.DatabaseInstanceSettingsDatabaseFlagArgs(name=n, value=v) for n, v in (
                    ("log_connections", "on"), ("log_disconnections", "on"),
                    ("log_min_duration_statement", "1000"), ("cloudsql.iam_authentication", "on"))],
                user_labels=args.labels),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[peering, *args.depends_on],
                                        protect=args.is_prod))
        gcp.sql.Database(f"{name}-mlflow", name=DATABASE, instance=self.instance.name, project=project,
                         opts=child)
        # Drawn once: ignore_changes keeps the first value on every later run (a new candidate is drawn
        # and discarded), and the platform reads the password back from the resource. ABANDON: a
        # PostgreSQL role that owns objects cannot be dropped through the API.
        self.user = gcp.sql.User(
            f"{name}-user", name=USERNAME, instance=self.instance.name, project=project,
            password=pulumi.Output.secret(generate_password()), deletion_policy="ABANDON",
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["password"],
                                        additional_secret_outputs=["password"]))
        self.contract = ManagedDatabase(
            host=self.instance.private_ip_address, port=PORT, database=DATABASE, username=USERNAME,
            password=pulumi.Output.secret(self.user.password.apply(lambda p: p or "")),
            cidrs=[self.psa_cidr], sslmode="require")
        self.register_outputs({"connection_name": self.instance.connection_name,
                               "private_ip": self.instance.private_ip_address, "psa_range": self.psa_cidr})
