"""Broken copies of the real plans: one security-relevant change each, and the rule that must catch it.

Usage: `from tests.policies.mutations import MUTATIONS`; `expect = m.mutate(plan)` breaks a deep copy
of `plans[m.stack]` in place and returns the text the finding must name (a resource's quoted logical
name), so `python -m policies.check` on the written copy must print a line with `[m.rule]` and it.

Resources are found by type and property, never by logical name, so the table keeps working while
the program changes names and counts. Each entry says which class of the security review it covers.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HALVES = ["0.0.0.0/1", "128.0.0.0/1"]
ROOT = "arn:aws:iam::123456789012:root"
SG = "aws:ec2/securityGroup:SecurityGroup"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
DAEMONSET = "kubernetes:apps/v1:DaemonSet"
DEPLOYMENT = "kubernetes:apps/v1:Deployment"
SERVICE = "kubernetes:core/v1:Service"
NETPOL = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
ROLE = "kubernetes:rbac.authorization.k8s.io/v1:Role"
ROLE_BINDING = "kubernetes:rbac.authorization.k8s.io/v1:RoleBinding"
GCS = "gcp:storage/bucket:Bucket"
NODE_POOL = "gcp:container/nodePool:NodePool"
GKE = "gcp:container/cluster:Cluster"
EKS = "aws:eks/cluster:Cluster"


@dataclass(frozen=True, kw_only=True)
class Mutation:
    id: str  # test id
    klass: str  # the class of the security review it belongs to
    stack: str  # which real plan it breaks
    rule: str  # the rule that must report it
    mutate: Callable[[dict], str]  # breaks the plan in place; returns the text the finding names


MUTATIONS: list[Mutation] = []


def mutation(id_: str, klass: str, stack: str, rule: str):
    def register(fn: Callable[[dict], str]) -> Callable[[dict], str]:
        MUTATIONS.append(Mutation(id=id_, klass=klass, stack=stack, rule=rule, mutate=fn))
        return fn
    return register


# ---- finding resources ------------------------------------------------------------------------


def pick(plan: dict, typ: str, where: Callable[[dict], Any] = lambda i: True) -> dict:
    """The first resource record of a type whose inputs match (fails loudly when there is none)."""
    found = [r for r in plan["resources"] if r["type"] == typ and where(r["inputs"])]
    assert found, f"{plan['stack']}: no {typ} matching the mutation's filter"
    return found[0]


def named(record: dict) -> str:
    return f"'{record['name']}'"


def ns(inputs: dict) -> str:
    return (inputs.get("metadata") or {}).get("namespace", "")


def edit_policy(record: dict, key: str, fn: Callable[[dict], None]) -> None:
    doc = json.loads(record["inputs"][key])
    fn(doc)
    record["inputs"][key] = json.dumps(doc)


def add_statement(record: dict, statement: dict, key: str = "policy") -> str:
    edit_policy(record, key, lambda d: d["Statement"].append(statement))
    return named(record)


def pod(record: dict) -> dict:
    spec = record["inputs"]["spec"]
    if "replicatedJobs" in spec:
        return spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return spec["template"]["spec"]


def trainer(record: dict) -> dict:
    return next(c for c in pod(record)["containers"] if c["name"] == "trainer")


def tls_deny(doc: dict) -> dict:
    return next(s for s in doc["Statement"] if "aws:SecureTransport" in json.dumps(s.get("Condition", {})))


def everything_but(*holes: str) -> list[str]:
    nets = [ipaddress.ip_network("0.0.0.0/0")]
    for hole in map(ipaddress.ip_network, holes):
        nets = [n for net in nets for n in (net.address_exclude(hole) if hole.subnet_of(net) else [net])]
    return [str(n) for n in nets]


# ---- public exposure -------------------------------------------------------------------------

@mutation("sg-two-halves", "the whole internet written another way", "aws-prod", "no-open-ingress")
def sg_two_halves(plan):
    sg = pick(plan, SG, lambda i: i.get("ingress"))
    sg["inputs"]["ingress"][0]["cidrBlocks"] = HALVES
    return named(sg)


@mutation("sg-ipv6-zero", "the whole internet written another way", "aws-dev", "no-open-ingress")
def sg_ipv6_zero(plan):
    sg = pick(plan, SG, lambda i: i.get("ingress"))
    sg["inputs"]["ingress"][0]["ipv6CidrBlocks"] = ["0::/0"]
    return named(sg)


@mutation("sg-256-slash-8s", "the whole internet written another way", "aws-dev", "no-open-ingress")
def sg_many_small(plan):
    sg = pick(plan, SG, lambda i: i.get("ingress"))
    sg["inputs"]["ingress"][0]["cidrBlocks"] = [f"{i}.0.0.0/8" for i in range(256)]
    return named(sg)


@mutation("sg-split-across-rule-resources", "the whole internet written another way", "aws-prod",
          "no-open-ingress")
def sg_split(plan):
    rule = pick(plan, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
    # Plans give every resource the id "<logical name>-id"; the rule's securityGroupId is its group's.
    owner = next(r for r in plan["resources"]
                 if r["type"] == SG and f"{r['name']}-id" == rule["inputs"]["securityGroupId"])
    owner["inputs"]["ingress"] = [{"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["0.0.0.0/1"]}]
    rule["inputs"].update(ipProtocol="tcp", fromPort=22, toPort=22, cidrIpv4="128.0.0.0/1")
    rule["inputs"].pop("referencedSecurityGroupId", None)
    return named(owner)


@mutation("firewall-all-but-rfc1918", "the whole internet written another way", "gcp-prod", "no-open-ingress")
def firewall_everything_but_private(plan):
    fw = pick(plan, "gcp:compute/firewall:Firewall", lambda i: i.get("allows") and i.get("direction") == "INGRESS")
    fw["inputs"]["sourceRanges"] = everything_but("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
    return named(fw)


@mutation("gke-authorized-halves", "the whole internet written another way", "gcp-prod", "gke-private-cluster")
def gke_authorized_halves(plan):
    gke = pick(plan, GKE)
    gke["inputs"]["masterAuthorizedNetworksConfig"]["cidrBlocks"] = [{"cidrBlock": c} for c in HALVES]
    return named(gke)


@mutation("eks-public-halves", "the whole internet written another way", "aws-prod", "eks-endpoint-restricted")
def eks_public_halves(plan):
    eks = pick(plan, EKS)
    eks["inputs"]["vpcConfig"].update(endpointPublicAccess=True, publicAccessCidrs=HALVES)
    return named(eks)


@mutation("eks-public-default", "public exposure", "aws-dev", "eks-endpoint-restricted")
def eks_public_default(plan):
    eks = pick(plan, EKS)
    eks["inputs"]["vpcConfig"]["endpointPublicAccess"] = True
    eks["inputs"]["vpcConfig"].pop("publicAccessCidrs", None)
    return named(eks)


@mutation("node-subnet-public-lb-tier", "public exposure", "aws-dev", "no-public-node-ips")
def node_subnet_elb(plan):
    refs = {s for r in plan["resources"] if r["type"] == "aws:eks/nodeGroup:NodeGroup"
            for s in r["inputs"].get("subnetIds", [])}
    sub = next(r for r in plan["resources"] if r["type"] == "aws:ec2/subnet:Subnet" and f"{r['name']}-id" in refs)
    sub["inputs"]["tags"]["kubernetes.io/role/elb"] = "1"
    sub["inputs"]["mapPublicIpOnLaunch"] = True
    return named(sub)


@mutation("launch-template-public-ip", "public exposure", "aws-prod", "no-public-node-ips")
def lt_public_ip(plan):
    lt = pick(plan, "aws:ec2/launchTemplate:LaunchTemplate")
    lt["inputs"]["networkInterfaces"][0]["associatePublicIpAddress"] = "true"
    return named(lt)


@mutation("gke-node-pool-public", "public exposure", "gcp-prod", "no-public-node-ips")
def node_pool_public(plan):
    np = pick(plan, NODE_POOL)
    np["inputs"].setdefault("networkConfig", {})["enablePrivateNodes"] = False
    return named(np)


@mutation("service-load-balancer", "public exposure", "aws-dev", "no-public-load-balancer")
def service_lb(plan):
    svc = pick(plan, SERVICE)
    svc["inputs"]["spec"]["type"] = "LoadBalancer"
    return named(svc)


@mutation("service-lb-other-clouds-annotation", "public exposure", "gcp-prod", "no-public-load-balancer")
def service_lb_wrong_cloud(plan):
    svc = pick(plan, SERVICE)
    svc["inputs"]["spec"]["type"] = "LoadBalancer"
    svc["inputs"]["metadata"]["annotations"] = {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}
    return named(svc)


@mutation("bucket-policy-principal-star", "public exposure", "aws-dev", "no-public-resource-policy")
def bucket_policy_star(plan):
    return add_statement(pick(plan, "aws:s3/bucketPolicy:BucketPolicy"),
                         {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "*"})


@mutation("bucket-policy-aws-star-list", "public exposure", "aws-prod", "no-public-resource-policy")
def bucket_policy_aws_star(plan):
    return add_statement(pick(plan, "aws:s3/bucketPolicy:BucketPolicy"),
                         {"Effect": "Allow", "Principal": {"AWS": ["*"]}, "Action": "s3:ListBucket",
                          "Resource": "*"})


@mutation("queue-policy-not-principal", "public exposure", "aws-dev", "no-public-resource-policy")
def queue_not_principal(plan):
    return add_statement(pick(plan, "aws:sqs/queuePolicy:QueuePolicy"),
                         {"Effect": "Allow", "NotPrincipal": {"AWS": ROOT}, "Action": "sqs:*", "Resource": "*"})


@mutation("role-trust-anyone", "public exposure", "aws-prod", "no-public-resource-policy")
def role_trust_anyone(plan):
    role = pick(plan, "aws:iam/role:Role")
    return add_statement(role, {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"},
                         key="assumeRolePolicy")


@mutation("gcs-all-users", "public exposure", "gcp-dev", "no-public-resource-policy")
def gcs_all_users(plan):
    member = pick(plan, "gcp:storage/bucketIAMMember:BucketIAMMember")
    member["inputs"]["member"] = "allUsers"
    return named(member)


@mutation("kms-all-authenticated", "public exposure", "gcp-prod", "no-public-resource-policy")
def kms_all_authenticated(plan):
    member = pick(plan, "gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember")
    member["inputs"]["member"] = "allAuthenticatedUsers"
    return named(member)


# ---- wildcard privilege ----------------------------------------------------------------------

@mutation("iam-action-star", "wildcard privilege", "aws-dev", "no-wildcard-iam")
def iam_star(plan):
    return add_statement(pick(plan, "aws:iam/rolePolicy:RolePolicy"),
                         {"Effect": "Allow", "Action": "*", "Resource": "*"})


@mutation("iam-service-star", "wildcard privilege", "aws-prod", "no-wildcard-iam")
def iam_service_star(plan):
    return add_statement(pick(plan, "aws:iam/rolePolicy:RolePolicy"),
                         {"Effect": "Allow", "Action": ["s3:*"], "Resource": ["*"]})


@mutation("iam-not-action", "wildcard privilege", "aws-dev", "no-wildcard-iam")
def iam_not_action(plan):
    return add_statement(pick(plan, "aws:iam/rolePolicy:RolePolicy"),
                         {"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"})


@mutation("iam-administrator-access", "wildcard privilege", "aws-prod", "no-wildcard-iam")
def iam_admin(plan):
    att = pick(plan, "aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    att["inputs"]["policyArn"] = "arn:aws:iam::aws:policy/AdministratorAccess"
    return named(att)


@mutation("gcp-project-owner", "wildcard privilege", "gcp-dev", "no-wildcard-iam")
def gcp_owner(plan):
    member = pick(plan, "gcp:projects/iAMMember:IAMMember")
    member["inputs"]["role"] = "roles/owner"
    return named(member)


@mutation("key-policy-kms-star-to-everyone", "wildcard privilege", "aws-dev", "no-public-resource-policy")
def key_policy_star(plan):
    return add_statement(pick(plan, "aws:kms/key:Key"),
                         {"Effect": "Allow", "Principal": "*", "Action": "kms:*", "Resource": "*"})


@mutation("team-binding-cluster-admin", "wildcard privilege", "aws-prod", "rbac-least-privilege")
def binding_cluster_admin(plan):
    rb = pick(plan, ROLE_BINDING)
    rb["inputs"]["roleRef"].update(kind="ClusterRole", name="cluster-admin")
    return named(rb)


@mutation("team-binding-system-masters", "wildcard privilege", "gcp-dev", "rbac-least-privilege")
def binding_masters(plan):
    rb = pick(plan, ROLE_BINDING)
    rb["inputs"]["subjects"].append({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                                     "name": "system:masters"})
    return named(rb)


@mutation("team-role-star-verbs", "wildcard privilege", "gcp-prod", "rbac-least-privilege")
def role_star(plan):
    role = pick(plan, ROLE)
    role["inputs"]["rules"][0]["verbs"] = ["*"]
    return named(role)


@mutation("team-role-impersonate", "wildcard privilege", "aws-dev", "rbac-least-privilege")
def role_impersonate(plan):
    role = pick(plan, ROLE)
    role["inputs"]["rules"].append({"apiGroups": [""], "resources": ["users", "groups", "serviceaccounts"],
                                    "verbs": ["impersonate"]})
    return named(role)


# ---- weaker encryption or transport --------------------------------------------------------------

SSE = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"


@mutation("sse-aws-managed-key", "weaker encryption or transport", "aws-dev", "bucket-encryption-cmk")
def sse_alias(plan):
    sse = pick(plan, SSE)
    sse["inputs"]["rules"][0]["applyServerSideEncryptionByDefault"]["kmsMasterKeyId"] = "alias/aws/s3"
    return f"'{sse['name']}'"


@mutation("sse-no-key-id", "weaker encryption or transport", "aws-prod", "bucket-encryption-cmk")
def sse_no_key(plan):
    sse = pick(plan, SSE)
    sse["inputs"]["rules"][0]["applyServerSideEncryptionByDefault"].pop("kmsMasterKeyId")
    return f"'{sse['name']}'"


@mutation("tls-deny-one-action", "weaker encryption or transport", "aws-dev", "bucket-tls-only")
def tls_one_action(plan):
    policy = pick(plan, "aws:s3/bucketPolicy:BucketPolicy")
    edit_policy(policy, "policy", lambda d: tls_deny(d).update(Action="s3:PutObject"))
    return f"'{policy['name']}'"


@mutation("tls-deny-one-principal", "weaker encryption or transport", "aws-prod", "bucket-tls-only")
def tls_one_principal(plan):
    policy = pick(plan, "aws:s3/bucketPolicy:BucketPolicy")
    edit_policy(policy, "policy", lambda d: tls_deny(d).update(Principal={"AWS": ROOT}))
    return f"'{policy['name']}'"


@mutation("kms-rotation-off", "weaker encryption or transport", "aws-dev", "kms-rotation")
def kms_rotation(plan):
    key = pick(plan, "aws:kms/key:Key")
    key["inputs"]["enableKeyRotation"] = False
    return named(key)


@mutation("gke-secrets-decrypted", "weaker encryption or transport", "gcp-dev", "cluster-secrets-cmk")
def gke_secrets(plan):
    gke = pick(plan, GKE)
    gke["inputs"]["databaseEncryption"]["state"] = "DECRYPTED"
    return named(gke)


@mutation("log-group-without-key", "weaker encryption or transport", "aws-prod", "logs-queues-cmk")
def log_group(plan):
    lg = pick(plan, "aws:cloudwatch/logGroup:LogGroup")
    lg["inputs"].pop("kmsKeyId")
    return named(lg)


@mutation("gke-boot-disk-google-key", "weaker encryption or transport", "gcp-prod", "disk-encryption-cmk")
def boot_disk(plan):
    np = pick(plan, NODE_POOL)
    np["inputs"]["nodeConfig"].pop("bootDiskKmsKey")
    return named(np)


@mutation("rds-public", "public exposure", "aws-prod", "rds-encrypted-private")
def rds_public(plan):
    db = pick(plan, "aws:rds/instance:Instance")
    db["inputs"]["publiclyAccessible"] = True
    return named(db)


@mutation("cloud-sql-public-ip", "public exposure", "gcp-prod", "cloud-sql-encrypted-private")
def sql_public(plan):
    db = pick(plan, "gcp:sql/databaseInstance:DatabaseInstance")
    db["inputs"]["settings"]["ipConfiguration"]["ipv4Enabled"] = True
    return named(db)


@mutation("gcs-public-access-inherited", "public exposure", "gcp-prod", "bucket-public-access-blocked")
def gcs_pap(plan):
    bucket = pick(plan, GCS)
    bucket["inputs"]["publicAccessPrevention"] = "inherited"
    return named(bucket)


# ---- lost history and audit ------------------------------------------------------------------

@mutation("checkpoint-versioning-suspended", "lost history and audit", "aws-dev", "bucket-history-kept")
def s3_suspended(plan):
    bucket = pick(plan, "aws:s3/bucket:Bucket", lambda i: i["tags"].get("purpose") == "checkpoints")
    versioning = pick(plan, "aws:s3/bucketVersioning:BucketVersioning",
                      lambda i: i["bucket"] == f"{bucket['name']}-id")  # plan ids are "<logical name>-id"
    versioning["inputs"]["versioningConfiguration"]["status"] = "Suspended"
    return named(bucket)


@mutation("gcs-versioning-off", "lost history and audit", "gcp-prod", "bucket-history-kept")
def gcs_versioning_off(plan):
    bucket = pick(plan, GCS, lambda i: i["labels"].get("purpose") == "checkpoints")
    bucket["inputs"]["versioning"]["enabled"] = False
    return named(bucket)


@mutation("gcs-versioning-and-soft-delete-off", "lost history and audit", "gcp-dev", "bucket-history-kept")
def gcs_history_off(plan):
    bucket = pick(plan, GCS, lambda i: (i.get("versioning") or {}).get("enabled"))
    bucket["inputs"]["versioning"]["enabled"] = False
    bucket["inputs"]["softDeletePolicy"] = {"retentionDurationSeconds": 0}
    return named(bucket)


@mutation("eks-control-plane-logs-off", "lost history and audit", "aws-prod", "control-plane-audit-logs")
def eks_logs(plan):
    eks = pick(plan, EKS)
    eks["inputs"]["enabledClusterLogTypes"] = []
    return named(eks)


@mutation("gke-logging-off", "lost history and audit", "gcp-dev", "control-plane-audit-logs")
def gke_logging(plan):
    gke = pick(plan, GKE)
    gke["inputs"]["loggingService"] = "none"
    return named(gke)


# ---- node credentials within reach -----------------------------------------------------------

@mutation("node-class-hop-limit-3", "node credentials within reach", "aws-dev", "imdsv2-required")
def hop_limit(plan):
    nc = pick(plan, "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")
    nc["inputs"]["spec"]["metadataOptions"]["httpPutResponseHopLimit"] = 3
    return named(nc)


@mutation("launch-template-imdsv1", "node credentials within reach", "aws-prod", "imdsv2-required")
def imdsv1(plan):
    lt = pick(plan, "aws:ec2/launchTemplate:LaunchTemplate")
    lt["inputs"]["metadataOptions"]["httpTokens"] = "optional"
    return named(lt)


@mutation("gke-legacy-metadata-endpoints", "node credentials within reach", "gcp-prod", "imdsv2-required")
def legacy_endpoints(plan):
    np = pick(plan, NODE_POOL)
    np["inputs"]["nodeConfig"]["metadata"] = {"disable-legacy-endpoints": "false"}
    return named(np)


@mutation("gke-node-metadata-exposed", "node credentials within reach", "gcp-dev", "imdsv2-required")
def gce_metadata(plan):
    np = pick(plan, NODE_POOL)
    np["inputs"]["nodeConfig"]["workloadMetadataConfig"]["mode"] = "GCE_METADATA"
    return named(np)


# ---- cluster escalation ----------------------------------------------------------------------

@mutation("training-pod-host-network", "cluster escalation", "aws-dev", "pod-host-isolation")
def jobset_host_network(plan):
    job = pick(plan, JOBSET)
    pod(job)["hostNetwork"] = True
    return named(job)


@mutation("training-pod-host-pid", "cluster escalation", "gcp-dev", "pod-host-isolation")
def jobset_host_pid(plan):
    job = pick(plan, JOBSET)
    pod(job)["hostPID"] = True
    return named(job)


@mutation("training-pod-root-host-path", "cluster escalation", "aws-prod", "pod-host-isolation")
def jobset_root_path(plan):
    job = pick(plan, JOBSET)
    pod(job)["volumes"].append({"name": "host-root", "hostPath": {"path": "/"}})
    trainer(job).setdefault("volumeMounts", []).append({"name": "host-root", "mountPath": "/host"})
    return named(job)


@mutation("training-pod-cap-sys-admin", "cluster escalation", "gcp-prod", "pod-host-isolation")
def jobset_sys_admin(plan):
    job = pick(plan, JOBSET)
    trainer(job)["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    return named(job)


@mutation("training-pod-escalation", "cluster escalation", "gcp-prod", "training-pod-security")
def jobset_escalation(plan):
    job = pick(plan, JOBSET)
    trainer(job)["securityContext"]["allowPrivilegeEscalation"] = True
    return named(job)


@mutation("training-pod-writable-driver-dir", "cluster escalation", "gcp-prod", "pod-host-isolation")
def jobset_writable_driver(plan):
    job = pick(plan, JOBSET, lambda i: "nvidia-lib" in json.dumps(i))
    for m in trainer(job)["volumeMounts"]:
        if m["name"] == "nvidia-lib":
            m["readOnly"] = False
    return named(job)


@mutation("privileged-daemonset-outside-teams", "cluster escalation", "aws-dev", "pod-host-isolation")
def privileged_daemonset(plan):
    ds = pick(plan, DAEMONSET)
    pod(ds)["containers"][0]["securityContext"]["privileged"] = True
    return named(ds)


@mutation("host-agent-image-swapped", "cluster escalation", "gcp-dev", "pod-host-isolation")
def agent_image(plan):
    ds = pick(plan, DAEMONSET, lambda i: any(c.get("securityContext", {}).get("privileged")
                                             for c in i["spec"]["template"]["spec"].get("initContainers", [])))
    privileged = next(c for c in pod(ds)["initContainers"] if c.get("securityContext", {}).get("privileged"))
    privileged["image"] = "ghcr.io/acme/tools:1.0"
    return named(ds)


@mutation("host-agent-copied-into-team-namespace", "cluster escalation", "aws-prod", "pod-host-isolation")
def agent_moved(plan):
    ds = pick(plan, DAEMONSET)
    ds["inputs"]["metadata"]["namespace"] = "team-research"
    return named(ds)


@mutation("platform-pod-as-root", "cluster escalation", "aws-dev", "pod-non-root")
def deployment_root(plan):
    dep = pick(plan, DEPLOYMENT, lambda i: not ns(i).startswith("team-"))
    pod(dep)["securityContext"].update(runAsNonRoot=False, runAsUser=0)
    return named(dep)


@mutation("platform-pod-host-port", "cluster escalation", "gcp-dev", "pod-host-isolation")
def deployment_host_port(plan):
    dep = pick(plan, DEPLOYMENT)
    pod(dep)["containers"][0].setdefault("ports", []).append({"containerPort": 5000, "hostPort": 5000})
    return named(dep)


@mutation("allow-all-beside-default-deny", "cluster escalation", "aws-prod", "network-policy-no-allow-all")
def allow_all(plan):
    np = pick(plan, NETPOL, lambda i: ns(i).startswith("team-") and i["spec"].get("egress"))
    np["inputs"]["spec"] = {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [{}], "egress": [{}]}
    return named(np)


@mutation("egress-to-the-internet-on-every-port", "cluster escalation", "gcp-dev", "network-policy-no-allow-all")
def egress_everywhere(plan):
    np = pick(plan, NETPOL, lambda i: ns(i).startswith("team-") and i["spec"].get("egress"))
    np["inputs"]["spec"]["egress"] = [{"to": [{"ipBlock": {"cidr": c}} for c in HALVES]}]
    return named(np)


@mutation("namespace-without-default-deny", "cluster escalation", "aws-dev", "namespace-default-deny")
def no_default_deny(plan):
    deny = pick(plan, NETPOL, lambda i: ns(i).startswith("team-") and set(i["spec"]) == {"podSelector", "policyTypes"})
    plan["resources"].remove(deny)
    namespace = pick(plan, "kubernetes:core/v1:Namespace", lambda i: i["metadata"]["name"] == ns(deny["inputs"]))
    return named(namespace)


# ---- images, requests, registries, placement, capacity (classes the pack already covered) -----

@mutation("training-image-by-tag", "supply chain", "aws-prod", "training-image-digest")
def training_tag(plan):
    job = pick(plan, JOBSET)
    trainer(job)["image"] = trainer(job)["image"].split("@")[0] + ":latest"
    return named(job)


@mutation("platform-image-by-tag", "supply chain", "aws-dev", "image-digest")
def platform_tag(plan):
    ds = pick(plan, DAEMONSET)
    ds_pod = pod(ds)["containers"][0]
    ds_pod["image"] = ds_pod["image"].split("@")[0]
    return ds_pod["name"]  # the container the advisory finding names


@mutation("training-container-without-requests", "capacity", "gcp-dev", "container-requests")
def no_requests(plan):
    job = pick(plan, JOBSET)
    trainer(job)["resources"].pop("requests")
    return named(job)


@mutation("ecr-mutable-tags", "supply chain", "aws-dev", "registry-immutable-scanned")
def ecr_mutable(plan):
    repo = pick(plan, "aws:ecr/repository:Repository", lambda i: i.get("imageTagMutability") == "IMMUTABLE")
    repo["inputs"]["imageTagMutability"] = "MUTABLE"
    return named(repo)


@mutation("aws-stack-in-another-region", "placement", "aws-dev", "allowed-regions")
def aws_region(plan):
    text = json.dumps(plan["resources"]).replace("us-east-1", "ap-south-1")
    plan["resources"] = json.loads(text)
    return pick(plan, "aws:ec2/subnet:Subnet")["name"]


@mutation("gcp-stack-in-another-region", "placement", "gcp-prod", "allowed-regions")
def gcp_region(plan):
    gke = pick(plan, GKE)
    gke["inputs"]["location"] = "asia-east1"
    return named(gke)


@mutation("bucket-without-required-tags", "placement", "aws-prod", "required-tags")
def no_tags(plan):
    bucket = pick(plan, "aws:s3/bucket:Bucket")
    bucket["inputs"]["tags"].pop("stack")
    return named(bucket)


@mutation("spot-interruptions-ignored", "capacity", "aws-dev", "spot-interruption-handling")
def spot_queue(plan):
    release = pick(plan, "kubernetes:helm.sh/v3:Release", lambda i: str(i.get("chart", "")).endswith("/karpenter"))
    release["inputs"]["values"]["settings"]["interruptionQueue"] = "some-other-queue"
    return named(release)


@mutation("gpu-pool-over-cap", "capacity", "gcp-prod", "gpu-total-cap")
def gpu_cap(plan):
    np = pick(plan, NODE_POOL, lambda i: i["nodeConfig"].get("guestAccelerators"))
    np["inputs"]["autoscaling"]["totalMaxNodeCount"] = 40
    return ""  # a stack-wide finding


@mutation("dev-gpu-pool-kept-warm", "capacity", "gcp-dev", "gpu-scale-to-zero")
def gpu_warm(plan):
    np = pick(plan, NODE_POOL, lambda i: i["nodeConfig"].get("guestAccelerators"))
    np["inputs"]["autoscaling"]["totalMinNodeCount"] = 1
    return named(np)
