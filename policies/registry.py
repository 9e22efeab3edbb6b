"""Every rule of the pack, with its id, enforcement level, remediation and benchmark items.

Usage: `from policies.registry import RULES, rule`; `rule("imdsv2-required").run(resources, ctx)`.
The CrossGuard pack (`policies/__main__.py`) and the offline checker (`python -m policies.check`)
both iterate this one tuple; docs/policies.md lists the same rules with the same benchmark items.

Benchmark items name the rule set and its version: CIS Amazon EKS Benchmark 1.7.0 and CIS Google
Kubernetes Engine Benchmark 1.8.0 (item numbers as in kube-bench's cfg/eks-1.7.0 and cfg/gke-1.8.0;
an item that only an older version has names that version), the Kubernetes Pod Security Standards
(PSS) by profile and control, and checkov 3.3.30 check ids (the version pinned in the Makefile).
"""

from __future__ import annotations

from policies import (
    audit,
    capacity,
    databases,
    encryption,
    iam,
    kubernetes,
    networking,
    nodes,
    rbac,
    storage,
    tagging,
)
from policies.core import Rule

_PODS_EXEMPTIONS = ("The platform's host agents, by kind, namespace, name, container name and image repository "
                    "(`policies/pods.py` HOST_AGENTS), each only for what it needs.")
_RXDM_EXEMPTION = ("Google's GPUDirect receive-datapath sidecars `tcpx-daemon` / `tcpxo-daemon` in training pods, "
                   "by container name and image repository (`policies/pods.py` RXDM_SIDECARS).")

RULES: tuple[Rule, ...] = (
    # Networking
    Rule(id="no-public-node-ips", level="mandatory", scope="stack", check=networking.no_public_node_ips,
         description="Nodes never get public IPs (launch templates, instances, Karpenter, GKE node pools, node subnets).",
         remediation="Set associatePublicIpAddress/mapPublicIpOnLaunch to false, keep node and pod subnets "
                     "untagged for internet-facing load balancers (kubernetes.io/role/elb belongs to the public "
                     "tier only) and keep GKE nodes private; reach the internet through NAT.",
         benchmarks=("CIS EKS 1.7.0 5.4.3", "CIS GKE 1.8.0 5.6.5", "checkov CKV_AWS_88", "checkov CKV_AWS_130")),
    Rule(id="no-open-ingress", level="mandatory", scope="stack", check=networking.no_open_ingress,
         description="No security group or firewall admits every public IPv4 or IPv6 address, however the ranges are written.",
         remediation="Restrict the source to the VPC CIDR, a security group or a prefix list.",
         benchmarks=("CIS GKE 1.8.0 5.6.6", "checkov CKV_AWS_24", "checkov CKV_AWS_25", "checkov CKV_AWS_260",
                     "checkov CKV_AWS_277", "checkov CKV_GCP_2", "checkov CKV_GCP_3", "checkov CKV_GCP_106")),
    Rule(id="eks-endpoint-restricted", level="mandatory", scope="resource",
         check=networking.eks_endpoint_restricted,
         description="The EKS API endpoint is private, or public only to CIDRs that do not add up to the internet, "
                     "with private access on.",
         remediation="Set cluster.endpointPublicAccess false, or list the admin CIDRs in "
                     "cluster.publicAccessCidrs; keep vpcConfig.endpointPrivateAccess true.",
         benchmarks=("CIS EKS 1.7.0 5.4.1", "CIS EKS 1.7.0 5.4.2", "checkov CKV_AWS_38", "checkov CKV_AWS_39")),
    Rule(id="gke-private-cluster", level="mandatory", scope="resource", check=networking.gke_private_cluster,
         description="GKE clusters have private nodes and authorized networks that do not add up to the internet.",
         remediation="Set privateClusterConfig.enablePrivateNodes true and masterAuthorizedNetworksConfig "
                     "with the admin CIDRs (never ranges that cover the internet).",
         benchmarks=("CIS GKE 1.8.0 5.6.3", "CIS GKE 1.8.0 5.6.5", "checkov CKV_GCP_20", "checkov CKV_GCP_25",
                     "checkov CKV_GCP_64")),
    Rule(id="no-public-load-balancer", level="mandatory", scope="stack", check=kubernetes.no_public_load_balancer,
         description="Services of type LoadBalancer and Ingresses get the cloud's internal load balancer.",
         remediation="Annotate the Service with service.beta.kubernetes.io/aws-load-balancer-scheme: internal "
                     "(EKS) or networking.gke.io/load-balancer-type: Internal (GKE); use ingress class "
                     "gce-internal, or an ALB scheme of internal."),
    Rule(id="network-policy-no-allow-all", level="mandatory", scope="resource",
         check=kubernetes.network_policy_no_allow_all,
         description="No NetworkPolicy admits everyone, or lets pods reach everyone on every port, beside the "
                     "namespace's default deny.",
         remediation="List the peers (namespace/pod selectors or internal ipBlocks) and, for egress to the "
                     "internet, the ports.",
         benchmarks=("CIS EKS 1.7.0 4.3.2", "CIS GKE 1.8.0 4.3.2")),
    # Access
    Rule(id="no-public-resource-policy", level="mandatory", scope="resource", check=iam.no_public_resource_policy,
         description="No resource policy, trust policy or IAM grant lets anyone use a resource (Principal '*', "
                     "NotPrincipal, allUsers, allAuthenticatedUsers).",
         remediation="Name the principals (account, role, service) or add a condition on aws:SourceAccount, "
                     "aws:SourceArn or aws:PrincipalOrgID; grant GCP roles to named members only.",
         benchmarks=("checkov CKV_AWS_70", "checkov CKV_AWS_33", "checkov CKV_AWS_168", "checkov CKV_AWS_32",
                     "checkov CKV_AWS_60", "checkov CKV_GCP_28", "checkov CKV_GCP_101", "checkov CKV2_GCP_6")),
    Rule(id="no-wildcard-iam", level="mandatory", scope="resource", check=iam.no_wildcard_iam,
         description="No identity policy grants '*' or a whole service on every resource; no administrator managed "
                     "policy; no GCP basic role.",
         remediation="List the actions and scope Resource to the ARNs they need; replace AdministratorAccess "
                     "and roles/owner or roles/editor with specific roles.",
         benchmarks=("checkov CKV_AWS_62", "checkov CKV_AWS_63", "checkov CKV_AWS_274", "checkov CKV_GCP_117")),
    Rule(id="rbac-least-privilege", level="mandatory", scope="resource", check=rbac.rbac_least_privilege,
         description="No binding to cluster-admin or to system:masters/anonymous/unauthenticated; no role with "
                     "wildcards or the escalate, bind or impersonate verbs.",
         remediation="Bind team groups to the stack's own least-privilege roles; list apiGroups, resources and "
                     "verbs explicitly.",
         benchmarks=("CIS EKS 1.7.0 4.1.1", "CIS EKS 1.7.0 4.1.3", "CIS EKS 1.7.0 4.1.8", "CIS GKE 1.8.0 4.1.1",
                     "CIS GKE 1.8.0 4.1.3", "CIS GKE 1.8.0 4.1.6", "CIS GKE 1.8.0 4.1.7", "CIS GKE 1.8.0 4.1.8",
                     "CIS GKE 1.8.0 4.1.9", "checkov CKV_K8S_49", "checkov CKV_K8S_157", "checkov CKV_K8S_158",
                     "checkov CKV2_K8S_3")),
    # Encryption
    Rule(id="cluster-secrets-cmk", level="mandatory", scope="resource", check=encryption.cluster_secrets_cmk,
         description="Kubernetes Secrets are envelope-encrypted with a customer-managed key.",
         remediation="EKS: encryptionConfig {provider: {keyArn: <KMS key>}, resources: ['secrets']}; "
                     "GKE: databaseEncryption {state: ENCRYPTED, keyName: <Cloud KMS key>}.",
         benchmarks=("CIS EKS 1.7.0 5.3.1", "CIS GKE 1.8.0 5.3.1", "checkov CKV_AWS_58")),
    Rule(id="bucket-encryption-cmk", level="mandatory", scope="stack", check=storage.bucket_encryption_cmk,
         description="Every bucket's default encryption uses a customer-managed key (not SSE-S3, not aws/s3).",
         remediation="S3: a BucketServerSideEncryptionConfiguration with sseAlgorithm aws:kms and a "
                     "customer-managed kmsMasterKeyId; GCS: encryption.defaultKmsKeyName.",
         benchmarks=("checkov CKV_AWS_145",)),
    Rule(id="bucket-public-access-blocked", level="mandatory", scope="stack",
         check=storage.bucket_public_access_blocked,
         description="Every bucket blocks public access.",
         remediation="S3: a BucketPublicAccessBlock with all four flags true; GCS: publicAccessPrevention "
                     "'enforced' and uniformBucketLevelAccess true.",
         benchmarks=("checkov CKV_AWS_53", "checkov CKV_AWS_54", "checkov CKV_AWS_55", "checkov CKV_AWS_56",
                     "checkov CKV2_AWS_6", "checkov CKV_GCP_114", "checkov CKV_GCP_29")),
    Rule(id="bucket-tls-only", level="mandatory", scope="stack", check=storage.bucket_tls_only,
         description="Every S3 bucket denies every principal every S3 action over plain HTTP (GCS is HTTPS-only).",
         remediation="Attach a BucketPolicy with a Deny statement for Principal '*', Action s3:*, the bucket and "
                     "bucket/* when Bool aws:SecureTransport is 'false', and no other condition.",
         benchmarks=("checkov CKV_AWS_379",)),
    Rule(id="disk-encryption-cmk", level="mandatory", scope="resource", check=encryption.disk_encryption_cmk,
         description="Node boot disks, EBS volumes and persistent-volume StorageClasses use a customer-managed key.",
         remediation="Launch templates / EC2NodeClasses: blockDeviceMappings ebs encrypted with kmsKeyId; "
                     "managed node groups: use a launch template; GKE: nodeConfig.bootDiskKmsKey; "
                     "StorageClasses: encrypted + kmsKeyId (EBS) or disk-encryption-kms-key (PD).",
         benchmarks=("CIS GKE 1.8.0 5.9.1", "CIS GKE 1.8.0 5.9.2", "checkov CKV_AWS_3", "checkov CKV_AWS_189")),
    Rule(id="logs-queues-cmk", level="mandatory", scope="resource", check=encryption.logs_queues_cmk,
         description="CloudWatch log groups and SQS queues are encrypted with a KMS key.",
         remediation="Set kmsKeyId on the log group / kmsMasterKeyId on the queue, and allow the "
                     "service principal in the key policy.",
         benchmarks=("checkov CKV_AWS_158", "checkov CKV_AWS_27")),
    Rule(id="kms-rotation", level="mandatory", scope="resource", check=encryption.kms_rotation,
         description="Customer-managed keys rotate (KMS enableKeyRotation; Cloud KMS rotationPeriod <= 365 days).",
         remediation="Set enableKeyRotation true (AWS) or rotationPeriod, e.g. '7776000s' (GCP).",
         benchmarks=("checkov CKV_AWS_7", "checkov CKV_GCP_43")),
    # Managed databases
    Rule(id="rds-encrypted-private", level="mandatory", scope="resource",
         check=databases.rds_encrypted_private,
         description="RDS instances encrypt storage with a customer-managed KMS key and are not public.",
         remediation="Set storageEncrypted true, kmsKeyId to a customer-managed KMS key ARN (not "
                     "alias/aws/rds) and publiclyAccessible false.",
         benchmarks=("checkov CKV_AWS_16", "checkov CKV_AWS_17")),
    Rule(id="cloud-sql-encrypted-private", level="mandatory", scope="resource",
         check=databases.cloud_sql_encrypted_private,
         description="Cloud SQL instances use CMEK, have no public IPv4 address and accept only TLS.",
         remediation="Set encryptionKeyName to a Cloud KMS key, settings.ipConfiguration.ipv4Enabled false "
                     "(private IP only) and settings.ipConfiguration.sslMode ENCRYPTED_ONLY.",
         benchmarks=("checkov CKV_GCP_6", "checkov CKV_GCP_11", "checkov CKV_GCP_60")),
    # History and audit
    Rule(id="bucket-history-kept", level="mandatory", scope="stack", check=storage.bucket_history_kept,
         description="Checkpoint and artifact buckets can restore overwritten or deleted objects; no bucket has "
                     "versioning suspended or soft delete turned off.",
         remediation="S3: a BucketVersioning with status Enabled; GCS: versioning.enabled true (required where "
                     "lifecycle rules manage noncurrent versions) and softDeletePolicy retention of at least "
                     "7 days (604800s).",
         benchmarks=("checkov CKV_AWS_21", "checkov CKV_GCP_78")),
    Rule(id="control-plane-audit-logs", level="mandatory", scope="resource", check=audit.control_plane_logging,
         description="EKS sends every control-plane log type to CloudWatch; GKE keeps system and workload logging on.",
         remediation="EKS: enabledClusterLogTypes [api, audit, authenticator, controllerManager, scheduler]; "
                     "GKE: loggingConfig.enableComponents [SYSTEM_COMPONENTS, WORKLOADS] and no loggingService 'none'.",
         benchmarks=("CIS EKS 1.7.0 2.1.1", "CIS GKE 1.8.0 5.7.1", "checkov CKV_AWS_37", "checkov CKV_GCP_1")),
    # Nodes and images
    Rule(id="imdsv2-required", level="mandatory", scope="resource", check=nodes.imdsv2_required,
         description="Node credentials stay out of pods' reach: IMDSv2 with hop limit 1; GKE metadata server with "
                     "the legacy endpoints off.",
         remediation="Set metadataOptions.httpTokens 'required' and httpPutResponseHopLimit 1 (launch templates, "
                     "EC2NodeClass); on GKE set nodeConfig.workloadMetadataConfig.mode GKE_METADATA and never "
                     "metadata disable-legacy-endpoints 'false'.",
         benchmarks=("CIS GKE 1.8.0 5.4.1", "CIS GKE 1.2.0 5.4.1", "checkov CKV_AWS_79", "checkov CKV_AWS_341",
                     "checkov CKV_GCP_69")),
    Rule(id="registry-immutable-scanned", level="mandatory", scope="stack",
         check=nodes.registry_immutable_scanned,
         description="Image repositories have immutable tags and ECR scans on push.",
         remediation="ECR: imageTagMutability IMMUTABLE and imageScanningConfiguration.scanOnPush true; "
                     "Artifact Registry: dockerConfig.immutableTags true.",
         benchmarks=("CIS EKS 1.7.0 5.1.1", "CIS GKE 1.8.0 5.1.1", "checkov CKV_AWS_51", "checkov CKV_AWS_163"),
         exemptions="A repository tagged/labelled purpose: build-cache that no typed workload of the stack runs an "
                    "image from may keep mutable tags (BuildKit rewrites its cache tag on every build)."),
    # Tags and placement
    Rule(id="required-tags", level="mandatory", scope="resource", check=tagging.required_tags,
         config_keys=("requiredTags",),
         description="Every taggable resource carries the required tags (AWS) or labels (GCP).",
         remediation="Pass naming.common_tags(cfg) as tags/labels (and to nested node tags)."),
    Rule(id="allowed-regions", level="mandatory", scope="resource", check=tagging.allowed_regions,
         config_keys=("allowedRegions",),
         description="Resources live only in the allowed regions (AWS: region, zones, ARNs, endpoint services).",
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
    Rule(id="pod-host-isolation", level="mandatory", scope="resource", check=kubernetes.pod_host_isolation,
         description="No pod in any namespace is privileged, shares the node's network, PID or IPC namespace, mounts "
                     "a host path outside the allowed list, binds a host port or adds capabilities beyond "
                     "NET_BIND_SERVICE.",
         remediation="Drop privileged, hostNetwork/hostPID/hostIPC, hostPort and capabilities.add; mount only the "
                     "namespace's NVMe work directory (and GPU driver directories read-only).",
         benchmarks=("PSS baseline: Privileged Containers", "PSS baseline: Host Namespaces",
                     "PSS baseline: HostPath Volumes", "PSS baseline: Host Ports", "PSS restricted: Capabilities",
                     "CIS EKS 1.7.0 4.2.1", "CIS EKS 1.7.0 4.2.2", "CIS EKS 1.7.0 4.2.3", "CIS EKS 1.7.0 4.2.4",
                     "CIS GKE 1.8.0 4.2.1", "checkov CKV_K8S_16", "checkov CKV_K8S_17", "checkov CKV_K8S_18",
                     "checkov CKV_K8S_19", "checkov CKV_K8S_25", "checkov CKV_K8S_26", "checkov CKV_K8S_27",
                     "checkov CKV_K8S_39"),
         exemptions=f"{_PODS_EXEMPTIONS} {_RXDM_EXEMPTION}"),
    Rule(id="pod-non-root", level="mandatory", scope="resource", check=kubernetes.pod_non_root,
         description="Pods other than training pods run as non-root without privilege escalation.",
         remediation="Set securityContext runAsNonRoot true (pod) and allowPrivilegeEscalation false "
                     "(every container).",
         benchmarks=("PSS restricted: Running as Non-root", "PSS restricted: Running as Non-root user",
                     "PSS restricted: Privilege Escalation", "CIS EKS 1.7.0 4.2.5", "CIS EKS 1.2.0 4.2.6",
                     "checkov CKV_K8S_20", "checkov CKV_K8S_23"),
         exemptions=_PODS_EXEMPTIONS),
    Rule(id="training-pod-security", level="mandatory", scope="resource",
         check=kubernetes.training_pod_security,
         description="Training pods (JobSets, team-namespace workloads) run as non-root without privilege escalation, "
                     "with every capability dropped and a RuntimeDefault seccomp profile.",
         remediation="Set securityContext runAsNonRoot true and seccompProfile RuntimeDefault (pod), "
                     "allowPrivilegeEscalation false and capabilities.drop [ALL] (every container).",
         benchmarks=("PSS restricted: Running as Non-root", "PSS restricted: Running as Non-root user",
                     "PSS restricted: Privilege Escalation", "PSS restricted: Capabilities",
                     "PSS restricted: Seccomp", "CIS EKS 1.7.0 4.2.5", "CIS GKE 1.8.0 4.6.2",
                     "checkov CKV_K8S_20", "checkov CKV_K8S_23", "checkov CKV_K8S_28", "checkov CKV_K8S_37",
                     "checkov CKV_K8S_31"),
         exemptions=_RXDM_EXEMPTION),
    Rule(id="training-image-digest", level="mandatory", scope="resource",
         check=kubernetes.training_image_digest,
         description="Training pods run images pinned by digest.",
         remediation="Use the image reference repo@sha256:<digest> (the trainer image's digest output).",
         benchmarks=("checkov CKV_K8S_43",),
         exemptions=_RXDM_EXEMPTION + " Google publishes them by version tag only. KServe's `kserve-container` and "
                                      "`storage-initializer` running exactly their pinned images (gpu_train/spec/"
                                      "pod_rules.py SERVING_IMAGES): KServe publishes them by tag only."),
    Rule(id="image-digest", level="advisory", scope="resource", check=kubernetes.image_digest,
         description="Other typed workloads run images pinned by digest.",
         remediation="Pin the image as repo:tag@sha256:<digest>.",
         benchmarks=("checkov CKV_K8S_43",)),
    Rule(id="container-requests", level="mandatory", scope="resource", check=kubernetes.container_requests,
         description="Every container of a typed workload requests CPU and memory.",
         remediation="Set resources.requests.cpu and resources.requests.memory on every container.",
         benchmarks=("checkov CKV_K8S_10", "checkov CKV_K8S_12")),
    Rule(id="namespace-default-deny", level="mandatory", scope="stack",
         check=kubernetes.namespace_default_deny,
         description="Every namespace the stack creates has a default-deny NetworkPolicy.",
         remediation="Add a NetworkPolicy in the namespace with podSelector {}, policyTypes "
                     "[Ingress, Egress] and no rules, then allow the needed flows explicitly.",
         benchmarks=("CIS EKS 1.7.0 4.3.2", "CIS GKE 1.8.0 4.3.2", "checkov CKV2_K8S_6")),
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
