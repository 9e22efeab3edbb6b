"""EKS control plane, core add-ons, the system node group and the Kubernetes provider.

Usage:
    cluster = Cluster("cluster", ClusterArgs(...))
    cluster.provider      # pulumi_kubernetes.Provider for the Kubernetes layer
    cluster.kubeconfig    # secret Output[str]; authenticates with `aws eks get-token`

Authentication mode is API (access entries only, no aws-auth ConfigMap). Team members' IAM principals
(`teams[].members`) get STANDARD access entries carrying their teams' Kubernetes groups and no access
policy, so the team RoleBindings are all they are granted. Workloads get AWS credentials through EKS Pod
Identity (the eks-pod-identity-agent add-on); an IAM OIDC provider is registered too, so IRSA remains
available to charts that only support it. The VPC CNI add-on enforces NetworkPolicies
(`vpc_cni_configuration`).

Node health: the EKS node monitoring agent add-on (pinned) runs on every node and reports the node conditions
`AcceleratedHardwareReady`, `NetworkingReady`, `StorageReady`, `KernelReady` and `ContainerRuntimeReady`
(https://docs.aws.amazon.com/eks/latest/userguide/node-health.html); its DCGM server runs on the GPU nodes,
which it must tolerate. The system node group's node repair acts on them and on `Ready` (at most
`gpu-train:health.maxConcurrentRepairs` nodes at once); Karpenter repairs the GPU nodes (infra/aws/karpenter.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from gpu_train.spec.settings import HealthSettings
from infra.aws import iam

LOG_TYPES = ("api", "audit", "authenticator", "controllerManager", "scheduler")
# vpc-cni >= 1.18.4 is required for efa-only network interfaces
# (https://docs.aws.amazon.com/eks/latest/userguide/node-efa.html); this is the version AWS lists
# for Kubernetes 1.33 (https://docs.aws.amazon.com/eks/latest/userguide/managing-vpc-cni.html).
VPC_CNI_VERSION = "v1.20.1-eksbuild.3"
MIN_VPC_CNI = (1, 18, 4)
SYSTEM_ROOT_GB = 50
# The EKS node monitoring agent add-on, pinned: the version its v1.7.0 chart runs (charts/eks-node-monitoring-agent
# values.yaml nodeAgent.image.tag); the add-on's configuration schema is charts/configuration.schema.json, of
# which tests/schemas/addons holds a structural snapshot.
NODE_MONITORING_AGENT = "eks-node-monitoring-agent"
NODE_MONITORING_AGENT_VERSION = "v1.7.0-eksbuild.1"


def addon_version_ok(version: str, minimum: tuple[int, ...] = MIN_VPC_CNI) -> bool:
    """True if an add-on version like 'v1.20.1-eksbuild.3' is at least `minimum`."""
    core = version.lstrip("v").split("-", 1)[0]
    try:
        parts = tuple(int(p) for p in core.split("."))
    except ValueError:
        raise ValueError(f"add-on version {version!r} is not like v1.2.3-eksbuild.N") from None
    return parts >= minimum


def vpc_cni_configuration() -> dict:
    """VPC CNI settings: custom networking (pods on the secondary range via per-AZ ENIConfigs), and
    NetworkPolicy enforcement.

    https://docs.aws.amazon.com/eks/latest/userguide/cni-custom-network.html
    The add-on's configuration values are the aws-vpc-cni chart's values at the add-on's version
    (charts/aws-vpc-cni/values.yaml of github.com/aws/amazon-vpc-cni-k8s at v1.20.1):
    - `enableNetworkPolicy` (a string, default "false") turns on the network policy controller and the
      node agent's enforcement (`--enable-network-policy` of the aws-eks-nodeagent container in
      templates/daemonset.yaml). Without it every NetworkPolicy is accepted and ignored.
    - the node agent itself (`nodeAgent.enabled`, default true) is left on; its policy event logs stay off.
    https://docs.aws.amazon.com/eks/latest/userguide/cni-network-policy-configure.html
    """
    return {
        "env": {
            "AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG": "true",
            # Each node picks the ENIConfig named after its availability zone.
            "ENI_CONFIG_LABEL_DEF": "topology.kubernetes.io/zone",
        },
        "enableNetworkPolicy": "true",
        "nodeAgent": {"enablePolicyEventLogs": "false"},
    }


def access_entry_name(component: str, principal: str) -> str:
    """The logical name of a member's access entry: stable per principal, so adding or removing one member
    never replaces another's entry."""
    return f"{component}-access-{hashlib.sha256(principal.encode()).hexdigest()[:12]}"


def node_monitoring_agent_configuration() -> dict:
    """Add-on configuration: the agent's DCGM server must run on the GPU nodes, which carry the GPU taint and,
    while a pre-flight check runs or a fault is quarantined, the health taints (the chart's default tolerates
    none). Without it the agent cannot reach a DCGM host engine there and reports DCGMError, a Condition that
    sets AcceleratedHardwareReady=False on every GPU node. The agent itself tolerates every taint by default."""
    return {"dcgmAgent": {"tolerations": [{"operator": "Exists"}]}}


def node_repair_config(health: HealthSettings) -> aws.eks.NodeGroupNodeRepairConfigArgs:
    """EKS node auto repair of a managed node group: on when `health.nodeRepair`, at most
    `health.maxConcurrentRepairs` nodes repaired in parallel."""
    if not health.node_repair:
        return aws.eks.NodeGroupNodeRepairConfigArgs(enabled=False)
    return aws.eks.NodeGroupNodeRepairConfigArgs(enabled=True,
                                                 max_parallel_nodes_repaired_count=health.max_concurrent_repairs)


def kubeconfig(cluster_name: str, endpoint: str, ca_data: str, region: str) -> str:
    """A kubeconfig that gets short-lived tokens from `aws eks get-token` (no static credentials)."""
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster_name, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}],
        "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": cluster_name}}],
        "current-context": cluster_name,
        "users": [{"name": cluster_name, "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": "aws",
            "args": ["eks", "get-token", "--cluster-name", cluster_name, "--region", region, "--output", "json"],
            "interactiveMode": "Never",
        }}}],
    }, indent=2)


def eni_config(zone: str, subnet_id: str, security_group_ids: Sequence[str]) -> dict:
    """The ENIConfig object for one AZ (pure; named after the zone, see ENI_CONFIG_LABEL_DEF)."""
    return {"apiVersion": "crd.k8s.amazonaws.com/v1alpha1", "kind": "ENIConfig", "metadata": {"name": zone},
            "spec": {"subnet": subnet_id, "securityGroups": list(security_group_ids)}}


def metadata_options(hop_limit: int) -> aws.ec2.LaunchTemplateMetadataOptionsArgs:
    """IMDSv2 only. Hop limit 1 keeps containers (one hop further) away from the node's role
    credentials; pods get their own credentials from the Pod Identity agent instead."""
    if hop_limit not in (1, 2):
        raise ValueError(f"IMDS hop limit must be 1 or 2 (got {hop_limit})")
    return aws.ec2.LaunchTemplateMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required",
                                                     http_put_response_hop_limit=hop_limit,
                                                     instance_metadata_tags="disabled")


def root_volume(key_arn: pulumi.Input[str], size_gb: int) -> aws.ec2.LaunchTemplateBlockDeviceMappingArgs:
    """Encrypted gp3 root volume (customer-managed key) for AL2023 (/dev/xvda)."""
    return aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name="/dev/xvda",
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(volume_type="gp3", volume_size=size_gb, encrypted="true",
                                                            kms_key_id=key_arn, delete_on_termination="true"))


@dataclass(frozen=True, kw_only=True)
class ClusterArgs:
    cluster_name: str  # EKS cluster name (also the Karpenter discovery tag value)
    kubernetes_version: str  # e.g. "1.33"
    region: str  # for the kubeconfig token command
    account_id: str  # for trust policies
    vpc_id: pulumi.Input[str]  # the cluster VPC
    subnet_ids: Sequence[pulumi.Input[str]]  # private node subnets, one per AZ
    pod_subnets: Mapping[str, pulumi.Input[str]]  # zone -> pod subnet id (custom networking)
    service_cidr: str  # Kubernetes service range
    endpoint_public_access: bool  # public API endpoint on (limited to public_access_cidrs)
    public_access_cidrs: Sequence[str]  # allowed CIDRs for a public endpoint
    secrets_key_arn: pulumi.Input[str]  # KMS key for envelope encryption of Secrets
    ebs_key_arn: pulumi.Input[str]  # KMS key for the system nodes' root volumes
    logs_key_arn: pulumi.Input[str]  # KMS key for the control-plane log group
    system_node_type: str  # instance type of the system node group
    system_nodes_min: int  # system node group bounds
    system_nodes_max: int
    system_labels: Mapping[str, str]  # labels on system nodes
    ebs_csi_role_name: str  # role name the EBS CSI driver's Pod Identity uses
    tags: Mapping[str, str]  # common tags
    health: HealthSettings = field(default_factory=HealthSettings)  # node repair of the system node group (cfg.health)
    # IAM principal ARN -> Kubernetes groups (config.team_access_entries): one STANDARD access entry each,
    # with no access policy, so only the team RoleBindings that name those groups grant anything.
    access_entries: Mapping[str, Sequence[str]] = field(default_factory=dict)


class Cluster(pulumi.ComponentResource):
    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Cluster", name, None, opts)
        if not addon_version_ok(VPC_CNI_VERSION):
            raise ValueError(f"vpc-cni {VPC_CNI_VERSION} is older than 1.18.4, which efa-only interfaces need")
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        self._control_plane(name, args, tags)
        # Node role of the system node group; EKS creates its access entry.
        self.node_role = aws.iam.Role(f"{name}-nodes", name=f"{args.cluster_name}-nodes",
                                      assume_role_policy=json.dumps(iam.service_trust("ec2.amazonaws.com")),
                                      tags=tags, opts=child)
        for i, arn in enumerate(iam.NODE_MANAGED_POLICIES):
            aws.iam.RolePolicyAttachment(f"{name}-nodes-{i}", role=self.node_role.name, policy_arn=arn, opts=child)
        # Add-ons a node needs to become Ready come first; CoreDNS and EBS CSI need running nodes.
        pia, cni, proxy = self._node_addons(name, args, tags)
        # One ENIConfig per AZ: pods get addresses from that zone's pod subnet.
        self.eni_configs = []
        for zone, subnet_id in args.pod_subnets.items():
            body = pulumi.Output.all(subnet_id, self.cluster_security_group_id).apply(
                lambda a, z=zone: eni_config(z, a[0], [a[1]]))
            self.eni_configs.append(k8s.apiextensions.CustomResource(
                f"{name}-eniconfig-{zone}", api_version="crd.k8s.amazonaws.com/v1alpha1", kind="ENIConfig",
                metadata={"name": zone}, spec=body.apply(lambda b: b["spec"]),
                opts=pulumi.ResourceOptions(parent=self, provider=self.provider, depends_on=[cni])))
        self.system_nodes = self._system_nodes(name, args, tags, depends_on=[cni, proxy, pia, *self.eni_configs])
        self.addons: list[aws.eks.Addon] = [pia, cni, proxy, *self._cluster_addons(name, args, tags)]
        # Team members: their IAM principals get the teams' Kubernetes groups and nothing else.
        self.access_entries = [
            aws.eks.AccessEntry(access_entry_name(name, principal), cluster_name=self.cluster.name,
                                principal_arn=principal, kubernetes_groups=list(groups), type="STANDARD",
                                tags=tags, opts=child)
            for principal, groups in sorted(args.access_entries.items())
        ]
        self.ready: list[pulumi.Resource] = [self.system_nodes, *self.addons, *self.eni_configs]
        self.register_outputs({"cluster_name": self.cluster_name, "endpoint": self.endpoint,
                               "kubeconfig": self.kubeconfig})

    def _control_plane(self, name: str, args: ClusterArgs, tags: dict[str, str]) -> None:
        """The cluster role, the encrypted log group, the EKS cluster, its OIDC provider, the Kubernetes provider."""
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(f"{name}-control-plane", assume_role_policy=json.dumps(iam.service_trust("eks.amazonaws.com")),
                            tags=tags, opts=child)
        for i, arn in enumerate(iam.CLUSTER_MANAGED_POLICIES):
            aws.iam.RolePolicyAttachment(f"{name}-control-plane-{i}", role=role.name, policy_arn=arn, opts=child)
        # EKS encrypts Secrets with the cluster role's credentials; the managed policy grants no KMS.
        encryption = aws.iam.RolePolicy(f"{name}-control-plane-kms", role=role.id,
                                        policy=pulumi.Output.from_input(args.secrets_key_arn).apply(
                                            lambda k: json.dumps(iam.cluster_encryption_policy(k))), opts=child)
        # EKS writes control-plane logs to this fixed name; creating it first lets us encrypt it.
        log_group = aws.cloudwatch.LogGroup(f"{name}-control-plane", name=f"/aws/eks/{args.cluster_name}/cluster",
                                            retention_in_days=90, kms_key_id=args.logs_key_arn, tags=tags, opts=child)
        self.cluster = cluster = aws.eks.Cluster(
            name, name=args.cluster_name, version=args.kubernetes_version, role_arn=role.arn,
            vpc_config=aws.eks.ClusterVpcConfigArgs(
                subnet_ids=list(args.subnet_ids), endpoint_private_access=True,
                endpoint_public_access=args.endpoint_public_access,
                public_access_cidrs=list(args.public_access_cidrs) if args.endpoint_public_access else None),
            kubernetes_network_config=aws.eks.ClusterKubernetesNetworkConfigArgs(service_ipv4_cidr=args.service_cidr),
            encryption_config=aws.eks.ClusterEncryptionConfigArgs(
                resources=["secrets"],
                provider=aws.eks.ClusterEncryptionConfigProviderArgs(key_arn=args.secrets_key_arn)),
            enabled_cluster_log_types=list(LOG_TYPES),
            # API mode: access entries only. The identity running `pulumi up` becomes cluster admin so
            # it can create the Kubernetes layer; other humans get access entries from their teams.
            access_config=aws.eks.ClusterAccessConfigArgs(authentication_mode="API",
                                                          bootstrap_cluster_creator_admin_permissions=True),
            # Add-ons are managed by this component, pinned, instead of the unmanaged defaults.
            bootstrap_self_managed_addons=False,
            tags=tags, opts=pulumi.ResourceOptions(parent=self, depends_on=[log_group, encryption]))
        self.cluster_name = cluster.name
        self.cluster_arn = cluster.arn
        self.endpoint = cluster.endpoint
        self.ca_data = cluster.certificate_authority.apply(lambda c: c.data)
        self.cluster_security_group_id = cluster.vpc_config.apply(lambda v: v.cluster_security_group_id)
        # Karpenter finds the security group for its nodes by this tag.
        aws.ec2.Tag(f"{name}-sg-discovery", resource_id=self.cluster_security_group_id,
                    key="karpenter.sh/discovery", value=args.cluster_name, opts=child)
        issuer = cluster.identities.apply(lambda ids: ids[0].oidcs[0].issuer)
        self.oidc_provider = aws.iam.OpenIdConnectProvider(f"{name}-oidc", url=issuer,
                                                           client_id_lists=["sts.amazonaws.com"], tags=tags, opts=child)
        self.kubeconfig = pulumi.Output.secret(pulumi.Output.all(cluster.name, self.endpoint, self.ca_data).apply(
            lambda a: kubeconfig(a[0], a[1], a[2], args.region)))
        self.provider = k8s.Provider(f"{name}-k8s", kubeconfig=self.kubeconfig, enable_server_side_apply=True,
                                     opts=child)

    def _node_addons(self, name: str, args: ClusterArgs, tags: dict[str, str]) -> list[aws.eks.Addon]:
        """The Pod Identity agent, the VPC CNI (with its role) and kube-proxy."""
        cni_role = self._pod_role(f"{name}-vpc-cni", args, iam.CNI_MANAGED_POLICY, f"{args.cluster_name}-vpc-cni")
        pia = self._addon(name, args, "eks-pod-identity-agent", tags)
        cni = self._addon(name, args, "vpc-cni", tags, version=VPC_CNI_VERSION, depends_on=[pia],
                          configuration_values=json.dumps(vpc_cni_configuration()),
                          pod_identity_associations=[aws.eks.AddonPodIdentityAssociationArgs(
                              role_arn=cni_role.arn, service_account="aws-node")])
        return [pia, cni, self._addon(name, args, "kube-proxy", tags)]

    def _system_nodes(self, name: str, args: ClusterArgs, tags: dict[str, str],
                      depends_on: list[pulumi.Resource]) -> aws.eks.NodeGroup:
        """The system node group and its launch template (IMDSv2, encrypted root, the cluster security group)."""
        lt = aws.ec2.LaunchTemplate(
            f"{name}-system", description=f"{args.cluster_name} system nodes",
            metadata_options=metadata_options(1),
            block_device_mappings=[root_volume(args.ebs_key_arn, SYSTEM_ROOT_GB)],
            network_interfaces=[aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                device_index=0, associate_public_ip_address="false", delete_on_termination="true",
                security_groups=[self.cluster_security_group_id])],
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=r, tags=tags)
                                for r in ("instance", "volume", "network-interface")],
            tags=tags, opts=pulumi.ResourceOptions(parent=self))
        # The one managed node group: Karpenter's controller, CoreDNS and the other controllers need
        # nodes before Karpenter can launch any, so these cannot come from Karpenter itself. Its
        # instances are launched by EC2 Auto Scaling's service-linked role, which the ebs key policy
        # names (infra/aws/keys.py).
        return aws.eks.NodeGroup(
            f"{name}-system", cluster_name=self.cluster.name, node_group_name="system",
            node_role_arn=self.node_role.arn, subnet_ids=list(args.subnet_ids), ami_type="AL2023_x86_64_STANDARD",
            capacity_type="ON_DEMAND", instance_types=[args.system_node_type],
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(min_size=args.system_nodes_min,
                                                              max_size=args.system_nodes_max,
                                                              desired_size=args.system_nodes_min),
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str)),
            labels=dict(args.system_labels), update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
            node_repair_config=node_repair_config(args.health),
            tags=tags, opts=pulumi.ResourceOptions(parent=self, depends_on=depends_on))

    def _cluster_addons(self, name: str, args: ClusterArgs, tags: dict[str, str]) -> list[aws.eks.Addon]:
        """The add-ons that need running nodes: CoreDNS, the EBS CSI driver (with its role), the monitoring agent."""
        ebs_role = self._pod_role(f"{name}-ebs-csi", args, iam.EBS_CSI_MANAGED_POLICY, args.ebs_csi_role_name)
        aws.iam.RolePolicy(f"{name}-ebs-csi-kms", role=ebs_role.id,
                           policy=pulumi.Output.from_input(args.ebs_key_arn).apply(
                               lambda k: json.dumps(iam.ebs_kms_policy(k))), opts=pulumi.ResourceOptions(parent=self))
        after_nodes = [self.system_nodes]
        return [self._addon(name, args, "coredns", tags, depends_on=after_nodes),
                self._addon(name, args, "aws-ebs-csi-driver", tags, depends_on=after_nodes,
                            pod_identity_associations=[aws.eks.AddonPodIdentityAssociationArgs(
                                role_arn=ebs_role.arn, service_account="ebs-csi-controller-sa")]),
                self._addon(name, args, NODE_MONITORING_AGENT, tags, version=NODE_MONITORING_AGENT_VERSION,
                            configuration_values=json.dumps(node_monitoring_agent_configuration()),
                            depends_on=after_nodes)]

    def _addon(self, name: str, args: ClusterArgs, addon: str, tags: dict[str, str], *, version: str = "",
               depends_on: list[pulumi.Resource] | None = None, **inputs) -> aws.eks.Addon:
        """A managed add-on `<component>-<add-on>` at `version`, else at EKS's default for the Kubernetes version."""
        default = None if version else aws.eks.get_addon_version_output(
            addon_name=addon, kubernetes_version=args.kubernetes_version, most_recent=False,
            opts=pulumi.InvokeOutputOptions(parent=self)).version
        return aws.eks.Addon(f"{name}-{addon}", cluster_name=self.cluster.name, addon_name=addon,
                             addon_version=version or default, resolve_conflicts_on_update="OVERWRITE", tags=tags,
                             opts=pulumi.ResourceOptions(parent=self, depends_on=depends_on), **inputs)

    def _pod_role(self, res: str, args: ClusterArgs, managed: str, role_name: str) -> aws.iam.Role:
        role = aws.iam.Role(res, name=role_name, assume_role_policy=json.dumps(iam.pod_identity_trust(args.account_id)),
                            tags=dict(args.tags), opts=pulumi.ResourceOptions(parent=self))
        aws.iam.RolePolicyAttachment(res, role=role.name, policy_arn=managed, opts=pulumi.ResourceOptions(parent=self))
        return role
