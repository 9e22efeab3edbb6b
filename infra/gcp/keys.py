"""Cloud KMS: one regional key ring, one key per use, and the service-agent grants on them.

Usage (inside the Pulumi program; `build_platform` does this):
    keys = Keys("keys", KeysArgs(cfg=cfg, labels=tags, project_number=number), opts)
    keys.key_ids["gke"]   # full key id: projects/<p>/locations/<region>/keyRings/<r>/cryptoKeys/<k>
    depends_on=keys.grants["storage"]   # resources that encrypt with the key wait for its grant

KMS keys cannot be deleted (only their versions destroyed), so in prod stacks the ring and every key carry
`protect=True` (Pulumi's prevent_destroy): removing them from the program, or `pulumi destroy`,
fails instead of scheduling destruction of key material that checkpoints still need. Dev stacks
leave them unprotected so they can be torn down.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import naming
from infra.config import StackConfig

ROTATION_PERIOD = "7776000s"  # 90 days
ENCRYPTER_DECRYPTER = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
# Each key and the Google service agent that uses it on our behalf
# (https://cloud.google.com/iam/docs/service-agents).
KEY_USES = ("gke", "storage", "registry", "disks", "sql")
# Keys that exist only when a feature needs them: a Cloud KMS key can never be deleted, so none is
# created ahead of use. "sql" encrypts the managed MLflow database (mlflow.database: managed).
OPTIONAL_USES = ("sql",)


def service_agents(project_number: str) -> dict[str, str]:
    """IAM members of the service agents that encrypt with each key."""
    return {
        # GKE encrypts Secrets in etcd (application-layer secrets encryption).
        "gke": f"serviceAccount:service-{project_number}@container-engine-robot.iam.gserviceaccount.com",
        # Cloud Storage encrypts objects with the bucket's default key.
        "storage": f"serviceAccount:service-{project_number}@gs-project-accounts.iam.gserviceaccount.com",
        # Artifact Registry encrypts image layers.
        "registry": f"serviceAccount:service-{project_number}@gcp-sa-artifactregistry.iam.gserviceaccount.com",
        # Compute Engine encrypts node boot disks and PD volumes created by the CSI driver.
        "disks": f"serviceAccount:service-{project_number}@compute-system.iam.gserviceaccount.com",
        # Cloud SQL encrypts the instance's disk, backups and logs
        # (https://cloud.google.com/sql/docs/postgres/configure-cmek#service-account).
        "sql": f"serviceAccount:service-{project_number}@gcp-sa-cloud-sql.iam.gserviceaccount.com",
    }


def key_id(project: str, region: str, ring: str, key: str) -> str:
    """The resource id Cloud KMS gives a key (what every `kms_key_name` field expects)."""
    return f"projects/{project}/locations/{region}/keyRings/{ring}/cryptoKeys/{key}"


@dataclass(frozen=True, kw_only=True)
class KeysArgs:
    cfg: StackConfig  # project and region of the key ring
    labels: dict[str, str]  # common labels for every key
    project_number: pulumi.Input[str]  # names the service agents
    optional: tuple[str, ...] = ()  # which OPTIONAL_USES to create as well, e.g. ("sql",)


class Keys(pulumi.ComponentResource):
    """Key ring, keys with 90-day rotation, and encrypter/decrypter grants to service agents."""

    def __init__(self, name: str, args: KeysArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:Keys", name, None, opts)
        cfg = args.cfg
        child = pulumi.ResourceOptions(parent=self)
        # Prod keys are protected; dev keys may go with the stack (their data is disposable).
        protected = pulumi.ResourceOptions(parent=self, protect=cfg.is_prod)
        ring_name = naming.resource_name(cfg, "keys")
        self.ring = gcp.kms.KeyRing(f"{name}-ring", name=ring_name, project=cfg.project,
                                    location=cfg.region, opts=protected)
        ring_id = pulumi.Output.concat("projects/", cfg.project, "/locations/", cfg.region,
                                       "/keyRings/", self.ring.name)
        agents = pulumi.Output.from_input(args.project_number).apply(service_agents)
        self.keys: dict[str, gcp.kms.CryptoKey] = {}
        self.key_ids: dict[str, pulumi.Output[str]] = {}
        self.grants: dict[str, gcp.kms.CryptoKeyIAMMember] = {}
        unknown = sorted(set(args.optional) - set(OPTIONAL_USES))
        if unknown:
            raise ValueError(f"KeysArgs.optional lists unknown key uses {unknown} (known: {OPTIONAL_USES})")
        # The Cloud SQL service agent exists only once something asks for it; a grant to a missing
        # agent fails, so create it first (https://cloud.google.com/sql/docs/postgres/configure-cmek).
        agent_ready: dict[str, list[pulumi.Resource]] = {}
        if "sql" in args.optional:
            agent_ready["sql"] = [gcp.projects.ServiceIdentity(
                f"{name}-sql-agent", project=cfg.project, service="sqladmin.googleapis.com", opts=child)]
        for use in KEY_USES:
            if use in OPTIONAL_USES and use not in args.optional:
                continue
            key = gcp.kms.CryptoKey(
                f"{name}-{use}", name=use, key_ring=ring_id, rotation_period=ROTATION_PERIOD,
                purpose="ENCRYPT_DECRYPT", labels=args.labels,
                opts=protected)
            # Built from the ring and key names (the id KMS assigns) so it depends on the key.
            kid = pulumi.Output.concat(ring_id, "/cryptoKeys/", key.name)
            self.keys[use] = key
            self.key_ids[use] = kid
            self.grants[use] = gcp.kms.CryptoKeyIAMMember(
                f"{name}-{use}-agent", crypto_key_id=kid, role=ENCRYPTER_DECRYPTER,
                member=agents.apply(lambda a, u=use: a[u]),
                opts=pulumi.ResourceOptions(parent=self, depends_on=agent_ready.get(use, [])))
        self.register_outputs({"ring": self.ring.name, "key_ids": self.key_ids})
