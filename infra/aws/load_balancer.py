"""AWS Load Balancer Controller: serves the platform's internal load balancers (Services with
`platform.internal_lb_annotations`) as internal NLBs with IP targets.

Usage:
    lbc = LoadBalancerController("lb-controller", LoadBalancerControllerArgs(...))
    lbc.release           # add to platform.ready: Services of type LoadBalancer need its webhook
    helm_values(...)      # pure: the chart values

EKS's in-tree cloud provider only makes Classic/NLB instance-mode balancers and ignores the
`service.beta.kubernetes.io/aws-load-balancer-type: external` annotation; the controller owns such
Services (https://kubernetes-sigs.github.io/aws-load-balancer-controller/latest/guide/service/nlb/).
It runs on the system nodes with a Pod Identity role. Nodes keep an IMDS hop limit of 1, so the
controller cannot discover its VPC and region from instance metadata: both are set in the values.

Helm installs the chart's `crds/` (TargetGroupBinding, IngressClassParams and the controller's other
kinds) on the first install only and never upgrades them
(https://helm.sh/docs/chart_best_practices/custom_resource_definitions/). A cluster whose release
was first installed from an older chart keeps that chart's CRDs until they are applied by hand
(docs/aws.md, "Load balancers"). Neither the program nor, with these values, the chart creates objects
of these kinds; the controller itself creates a TargetGroupBinding for each Service it serves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.aws import iam
from infra.aws.identities import pod_identity_role

CHART_REPO = "https://aws.github.io/eks-charts"
CHART = "aws-load-balancer-controller"
# Chart 3.5.0 ships controller v3.5.0 (its appVersion); iam.load_balancer_controller_policy follows that
# tag's published IAM policy.
CHART_VERSION = "3.5.0"
CONTROLLER_VERSION = "v3.5.0"
NAMESPACE = "kube-system"
SERVICE_ACCOUNT = "aws-load-balancer-controller"


def helm_values(*, cluster_name: str, region: str, vpc_id: str, system_selector: Mapping[str, str]) -> dict:
    """Chart values (https://github.com/aws/eks-charts/tree/master/stable/aws-load-balancer-controller)."""
    return {
        "clusterName": cluster_name,
        "region": region,
        "vpcId": vpc_id,
        # Pod Identity binds the role to this service account; no IRSA annotation.
        "serviceAccount": {"create": True, "name": SERVICE_ACCOUNT},
        "replicaCount": 2,
        "nodeSelector": dict(system_selector),
        "podDisruptionBudget": {"maxUnavailable": 1},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        # Services without a target-type annotation also get pod (IP) targets, which work with VPC CNI
        # custom networking and skip the extra NodePort hop.
        "defaultTargetType": "ip",
        # A Service that names no scheme still gets an internal balancer, whatever the controller's
        # built-in default (`--default-load-balancer-scheme`, chart 3.x).
        "defaultLoadBalancerScheme": "internal",
        # No ALB Ingress on this platform: no `alb` IngressClass, and so no IngressClassParams object
        # (a custom resource the chart would otherwise render next to it).
        "createIngressClassResource": False,
        # Internal NLBs only: the IAM policy grants none of the WAF / Shield APIs these would call.
        "enableShield": False,
        "enableWaf": False,
        "enableWafv2": False,
        # Reuse the webhook certificate on upgrades (chart 3.x defaults to a new CA on every upgrade).
        # A new CA reaches the webhook configurations at once but the running pods only when the kubelet
        # refreshes the mounted Secret; until then every call fails TLS, and the Service webhook
        # (failurePolicy Fail) rejects LoadBalancer Services created right after the upgrade
        # (https://github.com/kubernetes-sigs/aws-load-balancer-controller/issues/2473).
        "keepTLSSecret": True,
    }


@dataclass(frozen=True, kw_only=True)
class LoadBalancerControllerArgs:
    cluster_name: pulumi.Input[str]  # EKS cluster (Pod Identity association and chart value)
    region: str  # AWS region (chart value and policy scope)
    account_id: str  # policy scope and trust
    vpc_id: pulumi.Input[str]  # the cluster VPC (chart value)
    role_name: str  # IAM role name
    provider: k8s.Provider  # the cluster's Kubernetes provider
    system_selector: Mapping[str, str]  # where the controller runs
    depends_on: Sequence[pulumi.Resource]  # system nodes, CoreDNS and the Pod Identity agent
    tags: Mapping[str, str]  # common tags


class LoadBalancerController(pulumi.ComponentResource):
    def __init__(self, name: str, args: LoadBalancerControllerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:LoadBalancerController", name, None, opts)
        role, association = pod_identity_role(
            name, parent=self, role_name=args.role_name, account_id=args.account_id,
            policy=json.dumps(iam.load_balancer_controller_policy(region=args.region, account_id=args.account_id)),
            cluster_name=args.cluster_name, namespace=NAMESPACE, service_account=SERVICE_ACCOUNT,
            depends_on=args.depends_on, tags=args.tags)
        values = pulumi.Output.all(args.cluster_name, args.vpc_id).apply(lambda a: helm_values(
            cluster_name=a[0], region=args.region, vpc_id=a[1], system_selector=args.system_selector))
        self.release = k8s.helm.v3.Release(
            name, name=CHART, chart=CHART, version=CHART_VERSION,
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=CHART_REPO), namespace=NAMESPACE,
            values=values, atomic=True, timeout=600,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[*args.depends_on, association]))
        self.register_outputs({"role_arn": role.arn, "release": self.release.name})
