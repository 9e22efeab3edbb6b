"""Every rule of the pack, with its id, enforcement level and remediation.

Usage: `from policies.registry import RULES, rule`; `rule("imdsv2-required").run(resources, ctx)`.
The CrossGuard pack (`policies/__main__.py`) and the offline checker (`python -m policies.check`)
both iterate this one tuple; docs/policies.md lists the same rules.
"""

from __future__ import annotations

from policies import capacity, databases, encryption, kubernetes, networking, nodes, storage, tagging
from policies.core import Rule

RULES: tuple[Rule, ...] = (
    # Networking
    Rule(id="no-public-node-ips", level="mandatory", scope="resource", check=networking.no_public_node_ips,
         description="Nodes never get public IPs (launch templates, node subnets, Karpenter, GKE node pools).",
         remediation="Set associatePublicIpAddress/mapPublicIpOnLaunch to false (keep public IPs to "
                     "subnets tagged kubernetes.io/role/elb) and keep GKE nodes private; reach the "
                     "internet through NAT."),
    Rule(id="no-open-ingress", level="mandatory", scope="resource", check=networking.no_open_ingress,
         description="No security group rule or firewall admits ingress from 0.0.0.0/0 or ::/0.",
         remediation="Restrict the source to the VPC CIDR, a security group or a prefix list."),
    Rule(id="eks-endpoint-restricted", level="mandatory", scope="resource",
         check=networking.eks_endpoint_restricted,
         description="The EKS API endpoint is private, or public only to listed CIDRs, with private access on.",
         remediation="Set cluster.endpointPublicAccess false, or list the admin CIDRs in "
                     "cluster.publicAccessCidrs; keep vpcConfig.endpointPrivateAccess true."),
    Rule(id="gke-private-cluster", level="mandatory", scope="resource", check=networking.gke_private_cluster,
         description="GKE clusters have private nodes and master authorized networks.",
         remediation="Set privateClusterConfig.enablePrivateNodes true and masterAuthorizedNetworksConfig "
                     "with the admin CIDRs (never 0.0.0.0/0)."),
    # Encryption
    Rule(id="cluster-secrets-cmk", level="mandatory", scope="resource", check=encryption.cluster_secrets_cmk,
         description="Kubernetes Secrets are envelope-encrypted with a customer-managed key.",
         remediation="EKS: encryptionConfig {provider: {keyArn: <KMS key>}, resources: ['secrets']}; "
                     "GKE: databaseEncryption {state: ENCRYPTED, keyName: <Cloud KMS key>}."),
    Rule(id="bucket-encryption-cmk", level="mandatory", scope="stack", check=storage.bucket_encryption_cmk,
         description="Every bucket's default encryption uses a customer-managed key.",
         remediation="S3: a BucketServerSideEncryptionConfiguration with sseAlgorithm aws:kms and "
                     "kmsMasterKeyId; GCS: encryption.defaultKmsKeyName."),
    Rule(id="bucket-public-access-blocked", level="mandatory", scope="stack",
         check=storage.bucket_public_access_blocked,
         description="Every bucket blocks public access.",
         remediation="S3: a BucketPublicAccessBlock with all four flags true; GCS: publicAccessPrevention "
                     "'enforced' and uniformBucketLevelAccess true."),
    Rule(id="bucket-tls-only", level="mandatory", scope="stack", check=storage.bucket_tls_only,
         description="Every S3 bucket refuses plain-HTTP requests (GCS is HTTPS-only by design).",
         remediation="Attach a BucketPolicy with a Deny statement for all principals and s3:* when "
                     "Bool aws:SecureTransport is 'false'."),
    Rule(id="disk-encryption-cmk", level="mandatory", scope="resource", check=encryption.disk_encryption_cmk,
         description="Node boot disks, EBS volumes and persistent-volume StorageClasses use a customer-managed key.",
         remediation="Launch templates / EC2NodeClasses: blockDeviceMappings ebs encrypted with kmsKeyId; "
                     "managed node groups: use a launch template; GKE: nodeConfig.bootDiskKmsKey; "
                     "StorageClasses: encrypted + kmsKeyId (EBS) or disk-encryption-kms-key (PD)."),
    Rule(id="logs-queues-cmk", level="mandatory", scope="resource", check=encryption.logs_queues_cmk,
         description="CloudWatch log groups and SQS queues are encrypted with a KMS key.",
         remediation="Set kmsKeyId on the log group / kmsMasterKeyId on the queue, and allow the "
                     "service principal in the key policy."),
    Rule(id="kms-rotation", level="mandatory", scope="resource", check=encryption.kms_rotation,
         description="Customer-managed keys rotate (KMS enableKeyRotation; Cloud KMS rotationPeriod <= 365 days).",
         remediation="Set enableKeyRotation true (AWS) or rotationPeriod, e.g. '7776000s' (GCP)."),
    # Managed databases
    Rule(id="rds-encrypted-private", level="mandatory", scope="resource",
         check=databases.rds_encrypted_private,
         description="RDS instances encrypt storage with a customer-managed KMS key and are not public.",
         remediation="Set storageEncrypted true, kmsKeyId to a customer-managed KMS key ARN (not "
                     "alias/aws/rds) and publiclyAccessible false."),
    Rule(id="cloud-sql-encrypted-private", level="mandatory", scope="resource",
         check=databases.cloud_sql_encrypted_private,
         description="Cloud SQL instances use CMEK, have no public IPv4 address and accept only TLS.",
         remediation="Set encryptionKeyName to a Cloud KMS key, settings.ipConfiguration.ipv4Enabled false "
                     "(private IP only) and settings.ipConfiguration.sslMode ENCRYPTED_ONLY."),
    # Nodes and images
    Rule(id="imdsv2-required", level="mandatory", scope="resource", check=nodes.imdsv2_required,
         description="Nodes require IMDSv2 tokens; GKE nodes use the GKE metadata server.",
         remediation="Set metadataOptions.httpTokens 'required' (launch templates, EC2NodeClass) or "
                     "nodeConfig.workloadMetadataConfig.mode GKE_METADATA."),
    Rule(id="registry-immutable-scanned", level="mandatory", scope="resource",
         check=nodes.registry_immutable_scanned,
         description="Image repositories have immutable tags and ECR scans on push.",
         remediation="ECR: imageTagMutability IMMUTABLE and imageScanningConfiguration.scanOnPush true; "
                     "Artifact Registry: dockerConfig.immutableTags true."),
    # Tags and placement
    Rule(id="required-tags", level="mandatory", scope="resource", check=tagging.required_tags,
         config_keys=("requiredTags",),
         description="Every taggable resource carries the required tags (AWS) or labels (GCP).",
         remediation="Pass naming.common_tags(cfg) as tags/labels (and to nested node tags)."),
    Rule(id="allowed-regions", level="mandatory", scope="resource", check=tagging.allowed_regions,
         config_keys=("allowedRegions",),
         description="Resources live only in the allowed regions.",
         remediation="Pick a region from the policy config's allowedRegions, or extend that list."),
    # Capacity and cost
    Rule(id="spot-interruption-handling", level="mandatory", scope="stack",
         check=capacity.spot_interruption_handling,
         description="Karpenter spot GPU pools get EC2 interruption events through SQS.",
         remediation="Create an SQS queue fed by EventBridge rules for spot interruption, rebalance, "
                     "instance state change and AWS Health events, and set Karpenter's "
                     "settings.interruptionQueue to the queue name."),
    Rule(id="gpu-scale-to-zero", level="mandatory", scope="stack", check=capacity.gpu_scale_to_zero,
         config_keys=("environment",),
         description="Outside prod, GPU pools scale to zero nodes when idle.",
         remediation="Set the pool's minNodes to 0 in the stack settings (Karpenter: no replicas)."),
    Rule(id="gpu-total-cap", level="mandatory", scope="stack", check=capacity.gpu_total_cap,
         config_keys=("maxGpus", "maxGpusByStack"),
         description="Every GPU pool is bounded and all pools together stay within the stack's GPU cap.",
         remediation="Lower gpuPools[].maxNodes, set Karpenter limits nvidia.com/gpu, or raise the "
                     "policy config maxGpus/maxGpusByStack after review."),
    # Kubernetes
    Rule(id="training-pod-security", level="mandatory", scope="resource",
         check=kubernetes.training_pod_security,
         description="Training pods (JobSets, team-namespace workloads) run as non-root without privilege escalation.",
         remediation="Set securityContext runAsNonRoot true (pod) and allowPrivilegeEscalation false "
                     "(every container)."),
    Rule(id="training-image-digest", level="mandatory", scope="resource",
         check=kubernetes.training_image_digest,
         description="Training pods run images pinned by digest.",
         remediation="Use the image reference repo@sha256:<digest> (the trainer image's digest output)."),
    Rule(id="image-digest", level="advisory", scope="resource", check=kubernetes.image_digest,
         description="Other typed workloads run images pinned by digest.",
         remediation="Pin the image as repo:tag@sha256:<digest>."),
    Rule(id="container-requests", level="mandatory", scope="resource", check=kubernetes.container_requests,
         description="Every container of a typed workload requests CPU and memory.",
         remediation="Set resources.requests.cpu and resources.requests.memory on every container."),
    Rule(id="namespace-default-deny", level="mandatory", scope="stack",
         check=kubernetes.namespace_default_deny,
         description="Every namespace the stack creates has a default-deny NetworkPolicy.",
         remediation="Add a NetworkPolicy in the namespace with podSelector {}, policyTypes "
                     "[Ingress, Egress] and no rules, then allow the needed flows explicitly."),
)

_BY_ID = {r.id: r for r in RULES}
if len(_BY_ID) != len(RULES):  # a duplicated id would silently shadow a rule in the pack
    raise RuntimeError("policies.registry: rule ids must be unique")


def rule(rule_id: str) -> Rule:
    """The rule with this id, or KeyError listing the known ids."""
    try:
        return _BY_ID[rule_id]
    except KeyError:
        raise KeyError(f"unknown policy {rule_id!r} (known: {', '.join(_BY_ID)})") from None
