"""Can every consumer of every customer-managed KMS key use it? Derived from the plan graph, decided by policy.

Usage:
    python -m policies.plan.aws_kms build/plan/aws-prod.json     # exit 1 when a consumer is denied
    consumers(plan)                      # every (principal, action, key, context) the deployed platform needs
    evaluate(request, key_policy, identity_policies) -> Decision
    problems(plan)                       # one line per consumer the policies do not allow

`consumers` reads the plan, not this program's intent: a launch template's or EC2NodeClass's encrypted
volume, a StorageClass's kmsKeyId, a log group's, queue's, repository's, cluster's, bucket's or
database's key, and who acts on each (EC2 Auto Scaling's service-linked role for managed node groups;
the role that the Pod Identity association of Karpenter's or the EBS CSI driver's service account
names; CloudWatch Logs; EventBridge through the event targets that point at a queue; every role whose
IAM policy lets it receive from that queue or read / write the bucket; the EKS cluster role; and the
identity running `pulumi up`, which creates the repository, cluster and database). The actions each
needs are the ones the service documents (links at `_Need`).

`evaluate` implements the part of AWS's policy evaluation these documents use, for a principal in
the key's own account: an explicit Deny in either policy wins; a key policy statement that names the
principal (or "*") allows on its own; a statement that names the account root only delegates, so an
Allow in the principal's IAM policies must match too; a service principal has no IAM policies.
Supported: Principal forms AWS / Service / "*", Action and Resource wildcards, and the condition
operators String(Not)Equals, String(Not)Like, Arn(Not)Equals, Arn(Not)Like, Bool and Null, with
IfExists and ForAnyValue / ForAllValues, over the keys the request context carries (kms:ViaService,
kms:CallerAccount, kms:GrantIsForAWSResource, kms:EncryptionContext:*, aws:PrincipalArn,
aws:SourceAccount, aws:SourceArn). Anything else (NotAction, NotPrincipal, NotResource, another
operator) raises rather than guess. No library evaluates IAM policies offline for a request context
(parliament lints documents; policy_sentry writes them), which is why this is written here; it is
kept to the constructs above and tested against hand-worked cases.

AWS-managed policies attached to roles are not in the plan; the check counts them as granting no KMS
use on customer keys, which is what AWS documents for the ones attached here (AmazonEKSClusterPolicy,
AmazonEBSCSIDriverPolicy, the node policies). The identity running `pulumi up` is assumed to be an
administrator of the account (docs/aws.md, Deploying). Over 400 lines because the evaluator and the consumers it
decides on are one check, read together.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.plan import check_plans_main

ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
DEPLOYER = "deployer"  # the identity running `pulumi up`; its ARN is not in the plan
# EC2 Auto Scaling's service-linked role, which launches the managed node groups' instances: the path
# and name AWS gives it in every account
# (https://docs.aws.amazon.com/autoscaling/ec2/userguide/autoscaling-service-linked-role.html). Written
# here, not read from the program (infra/aws/service_roles.py), so that a wrong name there fails here.
AUTOSCALING_ROLE = "aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"


@dataclass(frozen=True, kw_only=True)
class Principal:
    """Who makes a request: an IAM role (with its identity policies) or an AWS service principal."""

    arn: str = ""  # role ARN ("" for a service principal)
    service: str = ""  # e.g. "logs.us-east-1.amazonaws.com"
    account: str = ""  # the principal's account (roles)
    policies: tuple[Mapping[str, Any], ...] = ()  # identity policies (roles only)

    @property
    def name(self) -> str:
        return self.arn or self.service


@dataclass(frozen=True, kw_only=True)
class Request:
    principal: Principal
    action: str  # e.g. "kms:Decrypt"
    key_arn: str
    context: Mapping[str, Any] = field(default_factory=dict)  # condition keys and their values


@dataclass(frozen=True, kw_only=True)
class Decision:
    allowed: bool
    reason: str


# ---------------------------------------------------------------------------------------------- evaluation

def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str | bool | int) else list(value)


def _statements(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    stmts = doc.get("Statement", [])
    stmts = [stmts] if isinstance(stmts, dict) else list(stmts)
    for s in stmts:
        for unsupported in ("NotAction", "NotPrincipal", "NotResource"):
            if unsupported in s:
                raise ValueError(f"statement {s.get('Sid', '?')!r} uses {unsupported}, which the evaluator "
                                 "does not model")
    return stmts


def _wildcard(pattern: str, value: str, *, case: bool) -> bool:
    # IAM wildcards: * matches any run of characters (including / and :), ? one character.
    if not case:
        pattern, value = pattern.lower(), value.lower()
    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]"))


def _action_matches(stmt: Mapping[str, Any], action: str) -> bool:
    return any(_wildcard(a, action, case=False) for a in _as_list(stmt.get("Action")))


def _resource_matches(stmt: Mapping[str, Any], resource: str) -> bool:
    return any(_wildcard(r, resource, case=True) for r in _as_list(stmt.get("Resource")))


def _arn_matches(pattern: str, value: str) -> bool:
    # ARN operators compare the six colon-separated parts; wildcards stay within a part.
    p, v = pattern.split(":", 5), value.split(":", 5)
    return len(p) == len(v) == 6 and all(_wildcard(a, b, case=True) for a, b in zip(p, v, strict=True))


_BASE_OPERATORS = {
    "StringEquals": lambda want, have: want == have,
    "StringLike": lambda want, have: _wildcard(want, have, case=True),
    "ArnEquals": lambda want, have: want == have,
    "ArnLike": _arn_matches,
    "Bool": lambda want, have: str(want).lower() == str(have).lower(),
}
_NEGATED = {"StringNotEquals": "StringEquals", "StringNotLike": "StringLike", "ArnNotEquals": "ArnEquals",
            "ArnNotLike": "ArnLike"}


def _context_value(context: Mapping[str, Any], key: str) -> list[str] | None:
    # Condition keys are case-insensitive.
    for k, v in context.items():
        if k.lower() == key.lower():
            return [str(x) for x in _as_list(v)]
    return None


def _condition_holds(operator: str, key: str, wanted: Any, context: Mapping[str, Any]) -> bool:
    op = operator
    qualifier = ""
    if ":" in op:
        qualifier, op = op.split(":", 1)
        if qualifier not in ("ForAnyValue", "ForAllValues"):
            raise ValueError(f"condition operator {operator!r} is not supported by the evaluator")
    if_exists = op.endswith("IfExists")
    op = op.removesuffix("IfExists")
    have = _context_value(context, key)
    wants = [str(w) for w in _as_list(wanted)]
    if op == "Null":
        return (have is None) == (wants[0].lower() == "true")
    negated = op in _NEGATED
    base = _NEGATED.get(op, op)
    if base not in _BASE_OPERATORS:
        raise ValueError(f"condition operator {operator!r} is not supported by the evaluator")
    compare = _BASE_OPERATORS[base]
    if have is None:
        # A missing key: IfExists and negated operators hold, the others do not; ForAllValues over no
        # values holds, ForAnyValue does not.
        if qualifier == "ForAllValues":
            return True
        if qualifier == "ForAnyValue":
            return False
        return if_exists or negated
    match_one = (lambda h: not any(compare(w, h) for w in wants)) if negated else \
        (lambda h: any(compare(w, h) for w in wants))
    if qualifier == "ForAllValues":
        return all(match_one(h) for h in have)
    return any(match_one(h) for h in have)


def _conditions_hold(stmt: Mapping[str, Any], context: Mapping[str, Any]) -> bool:
    for operator, keys in (stmt.get("Condition") or {}).items():
        for key, wanted in keys.items():
            if not _condition_holds(operator, key, wanted, context):
                return False
    return True


def _root(account: str) -> set[str]:
    return {f"arn:aws:iam::{account}:root", account}


def _principal_match(stmt: Mapping[str, Any], principal: Principal) -> str:
    """"direct" if the statement names the principal (or everyone), "root" if it names the principal's
    account root (delegation to IAM), "" if neither."""
    p = stmt.get("Principal")
    if p == "*":
        return "direct"
    if not isinstance(p, Mapping):
        raise ValueError(f"key policy statement {stmt.get('Sid', '?')!r} has no Principal")
    unknown = set(p) - {"AWS", "Service"}
    if unknown:
        raise ValueError(f"principal type(s) {sorted(unknown)} are not supported by the evaluator")
    services = _as_list(p.get("Service"))
    aws = _as_list(p.get("AWS"))
    if principal.service:
        return "direct" if principal.service in services or "*" in aws else ""
    if principal.arn in aws or "*" in aws:
        return "direct"
    if principal.account and _root(principal.account) & set(aws):
        return "root"
    return ""


def _base_context(request: Request) -> dict[str, Any]:
    ctx = dict(request.context)
    if request.principal.arn:
        ctx.setdefault("aws:PrincipalArn", request.principal.arn)
        ctx.setdefault("kms:CallerAccount", request.principal.account)
    return ctx


def evaluate(request: Request, key_policy: Mapping[str, Any],
             identity_policies: Iterable[Mapping[str, Any]] | None = None) -> Decision:
    """Whether `request` is allowed by the key policy together with the principal's IAM policies."""
    ctx = _base_context(request)
    principal = request.principal
    identity = list(principal.policies if identity_policies is None else identity_policies)
    key_allows: list[str] = []
    for stmt in _statements(key_policy):
        if not _action_matches(stmt, request.action):
            continue
        resources = _as_list(stmt.get("Resource"))
        if resources and not any(r == "*" or r == request.key_arn for r in resources):
            continue
        how = _principal_match(stmt, principal)
        if not how or not _conditions_hold(stmt, ctx):
            continue
        if stmt.get("Effect") == "Deny":
            return Decision(allowed=False, reason=f"key policy statement {stmt.get('Sid', '?')!r} denies it")
        key_allows.append(how)
    identity_allow = None
    for doc in identity:
        for stmt in _statements(doc):
            if not (_action_matches(stmt, request.action) and _resource_matches(stmt, request.key_arn)
                    and _conditions_hold(stmt, ctx)):
                continue
            if stmt.get("Effect") == "Deny":
                return Decision(allowed=False, reason=f"IAM statement {stmt.get('Sid', '?')!r} denies it")
            identity_allow = identity_allow or stmt.get("Sid", "(no Sid)")
    if "direct" in key_allows:
        return Decision(allowed=True, reason="the key policy names the principal")
    if "root" in key_allows:
        if identity_allow:
            return Decision(allowed=True, reason=f"the key policy delegates to the account and IAM statement "
                                                 f"{identity_allow!r} allows it")
        return Decision(allowed=False, reason="the key policy delegates to the account root, but no IAM policy "
                                              "of the principal allows it with this context")
    return Decision(allowed=False, reason="no key policy statement allows this principal with this context")


# ---------------------------------------------------------------------------------------------- consumers

@dataclass(frozen=True, kw_only=True)
class _Need:
    """What a kind of consumer needs on a key: actions, and condition keys the service sends."""

    actions: tuple[str, ...]
    source: str  # where AWS documents it


# Creating / attaching EBS volumes encrypted with a customer key, by the caller through EC2.
# https://docs.aws.amazon.com/ebs/latest/userguide/ebs-encryption-requirements.html
EBS = _Need(actions=("kms:CreateGrant", "kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext",
                     "kms:ReEncryptFrom", "kms:ReEncryptTo"),
            source="https://docs.aws.amazon.com/ebs/latest/userguide/ebs-encryption-requirements.html")
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html
LOGS = _Need(actions=("kms:Encrypt", "kms:Decrypt", "kms:GenerateDataKey", "kms:ReEncryptFrom", "kms:ReEncryptTo"),
             source="https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html")
# https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/sqs-key-management.html
SQS_SEND = _Need(actions=("kms:GenerateDataKey", "kms:Decrypt"),
                 source="https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/sqs-key-management.html")
SQS_RECEIVE = _Need(actions=("kms:Decrypt",), source=SQS_SEND.source)
# ECR creates its grants as the caller when the repository is created, and retires them on delete.
# https://docs.aws.amazon.com/AmazonECR/latest/userguide/encryption-at-rest.html
ECR = _Need(actions=("kms:DescribeKey", "kms:CreateGrant", "kms:RetireGrant"),
            source="https://docs.aws.amazon.com/AmazonECR/latest/userguide/encryption-at-rest.html")
# The cluster role encrypts and decrypts Secrets' data keys.
EKS_SECRETS = _Need(actions=("kms:Encrypt", "kms:Decrypt", "kms:ListGrants", "kms:DescribeKey"),
                    source="https://docs.aws.amazon.com/eks/latest/userguide/envelope-encryption.html")
EKS_CREATE = _Need(actions=("kms:DescribeKey", "kms:CreateGrant"), source=EKS_SECRETS.source)
# https://docs.aws.amazon.com/AmazonS3/latest/userguide/UsingKMSEncryption.html#require-sse-kms
S3_READ = _Need(actions=("kms:Decrypt",), source="https://docs.aws.amazon.com/AmazonS3/latest/userguide/UsingKMSEncryption.html")
S3_WRITE = _Need(actions=("kms:GenerateDataKey", "kms:Decrypt"), source=S3_READ.source)
# https://docs.aws.amazon.com/AmazonRDS/latest/UserGuide/Overview.Encryption.Keys.html
RDS = _Need(actions=("kms:DescribeKey", "kms:CreateGrant"),
            source="https://docs.aws.amazon.com/AmazonRDS/latest/UserGuide/Overview.Encryption.Keys.html")


@dataclass(frozen=True, kw_only=True)
class Consumer:
    what: str  # the resource or object that needs the key, e.g. a log group's URN
    why: str  # one line: which use
    principal: Principal
    key_arn: str
    need: _Need
    context: Mapping[str, Any] = field(default_factory=dict)
    grant_context: Mapping[str, Any] = field(default_factory=dict)  # extra context for kms:CreateGrant

    def requests(self) -> list[Request]:
        return [Request(principal=self.principal, action=a, key_arn=self.key_arn,
                        context={**self.context, **(self.grant_context if a == "kms:CreateGrant" else {})})
                for a in self.need.actions]


class _Graph:
    """Indexes over a plan document: resources by URN and by type, and what the engine computed."""

    def __init__(self, plan: Mapping[str, Any]):
        self.plan = plan
        self.resources = list(plan["resources"])
        self.by_urn = {r["urn"]: r for r in self.resources}
        self.reg = plan.get("registrations") or {}
        if not self.reg:
            raise ValueError("the plan has no 'registrations' (provider-computed outputs); plan it again with "
                             "python -m infra.plan")
        providers = [r for r in self.resources if r["type"] == "pulumi:providers:aws"]
        if len(providers) != 1 or not providers[0]["inputs"].get("region"):
            raise ValueError("the plan must have exactly one AWS provider with a region")
        self.region = providers[0]["inputs"]["region"]
        key_arns = [self.out(r, "arn") for r in self.of("aws:kms/key:Key")]
        self.account = key_arns[0].split(":")[4] if key_arns else ""

    def of(self, typ: str) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["type"] == typ]

    def out(self, res: Mapping[str, Any], key: str) -> Any:
        return res["inputs"].get(key) or (self.reg.get(res["urn"], {}).get("outputs") or {}).get(key)

    def ident(self, res: Mapping[str, Any]) -> str | None:
        return self.reg.get(res["urn"], {}).get("id")

    def find(self, typ: str, value: Any, *keys: str) -> dict[str, Any] | None:
        """The resource of `typ` whose id or one of the named (input or computed) properties is `value`."""
        for r in self.of(typ):
            if value and (value == self.ident(r) or any(value == self.out(r, k) for k in keys)):
                return r
        return None

    def role(self, arn: str) -> Principal:
        res = self.find("aws:iam/role:Role", arn, "arn")
        if res is None:
            raise ValueError(f"no IAM role in the plan has ARN {arn}")
        names = {self.ident(res), self.out(res, "name"), self.out(res, "arn")} - {None}
        docs = [_parse(p["inputs"]["policy"]) for p in self.of("aws:iam/rolePolicy:RolePolicy")
                if p["inputs"].get("role") in names]
        for att in self.of("aws:iam/rolePolicyAttachment:RolePolicyAttachment"):
            if att["inputs"].get("role") in names:
                managed = self.find("aws:iam/policy:Policy", att["inputs"].get("policyArn"), "arn")
                if managed is not None:
                    docs.append(_parse(managed["inputs"]["policy"]))
        return Principal(arn=arn, account=arn.split(":")[4], policies=tuple(docs))

    def roles(self) -> list[Principal]:
        return [self.role(self.out(r, "arn")) for r in self.of("aws:iam/role:Role")]

    def service_account_role(self, namespace: str, name: str) -> Principal | None:
        for a in self.of("aws:eks/podIdentityAssociation:PodIdentityAssociation"):
            if a["inputs"].get("namespace") == namespace and a["inputs"].get("serviceAccount") == name:
                return self.role(a["inputs"]["roleArn"])
        for addon in self.of("aws:eks/addon:Addon"):
            for assoc in addon["inputs"].get("podIdentityAssociations") or []:
                if namespace == "kube-system" and assoc.get("serviceAccount") == name:
                    return self.role(assoc["roleArn"])
        return None

    def deployer(self) -> Principal:
        return Principal(arn=f"arn:aws:iam::{self.account}:role/{DEPLOYER}", account=self.account,
                         policies=(ADMIN_POLICY,))


def _parse(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else json.loads(value)


def _via(service: str, region: str) -> dict[str, str]:
    return {"kms:ViaService": f"{service}.{region}.amazonaws.com"}


def _grant() -> dict[str, str]:
    return {"kms:GrantIsForAWSResource": "true"}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj["inputs"].get("spec") or {}


def consumers(plan: Mapping[str, Any]) -> list[Consumer]:
    g = _Graph(plan)
    region, account = g.region, g.account
    out: list[Consumer] = list(_volume_consumers(g))

    # CloudWatch Logs encrypts each log group under its own encryption context.
    logs = Principal(service=f"logs.{region}.amazonaws.com")
    for lg in g.of("aws:cloudwatch/logGroup:LogGroup"):
        key = lg["inputs"].get("kmsKeyId")
        if key:
            arn = f"arn:aws:logs:{region}:{account}:log-group:{lg['inputs']['name']}"
            out.append(Consumer(what=lg["urn"], why="log group encryption", principal=logs, key_arn=key, need=LOGS,
                                context={"kms:EncryptionContext:aws:logs:arn": arn}))

    roles = g.roles()
    out += _queue_consumers(g, roles)
    deployer = g.deployer()
    for repo in g.of("aws:ecr/repository:Repository"):
        for enc in repo["inputs"].get("encryptionConfigurations") or []:
            if enc.get("kmsKey"):
                out.append(Consumer(what=repo["urn"], why="repository creation (ECR grants)", principal=deployer,
                                    key_arn=enc["kmsKey"], need=ECR, context=_via("ecr", region),
                                    grant_context=_grant()))

    for cluster in g.of("aws:eks/cluster:Cluster"):
        key = ((cluster["inputs"].get("encryptionConfig") or {}).get("provider") or {}).get("keyArn")
        if key:
            out.append(Consumer(what=cluster["urn"], why="Secrets envelope encryption (cluster role)",
                                principal=g.role(cluster["inputs"]["roleArn"]), key_arn=key, need=EKS_SECRETS))
            out.append(Consumer(what=cluster["urn"], why="cluster creation with secrets encryption",
                                principal=deployer, key_arn=key, need=EKS_CREATE, context=_via("eks", region),
                                grant_context=_grant()))

    out += _bucket_consumers(g, roles)
    for db in g.of("aws:rds/instance:Instance"):
        for prop in ("kmsKeyId", "performanceInsightsKmsKeyId"):
            key = db["inputs"].get(prop)
            if key:
                out.append(Consumer(what=db["urn"], why=f"database {prop}", principal=deployer, key_arn=key,
                                    need=RDS, context=_via("rds", region), grant_context=_grant()))
    return out


def _volume_consumers(g: _Graph) -> Iterator[Consumer]:
    """Encrypted EBS volumes, by who creates them: node groups, Karpenter, the EBS CSI driver."""
    via_ec2 = _via("ec2", g.region)
    # EBS through EC2 Auto Scaling: managed node groups launch with their launch template's volumes.
    asg = Principal(arn=f"arn:aws:iam::{g.account}:role/{AUTOSCALING_ROLE}", account=g.account)
    for ng in g.of("aws:eks/nodeGroup:NodeGroup"):
        template = ng["inputs"].get("launchTemplate") or {}
        lt = g.find("aws:ec2/launchTemplate:LaunchTemplate", template.get("id") or template.get("name"), "name")
        for bdm in (lt or {}).get("inputs", {}).get("blockDeviceMappings") or []:
            key = (bdm.get("ebs") or {}).get("kmsKeyId")
            if key:
                yield Consumer(what=ng["urn"], why="managed node group volumes (EC2 Auto Scaling)", principal=asg,
                               key_arn=key, need=EBS, context=via_ec2, grant_context=_grant())

    # EBS through Karpenter: the controller's role launches EC2NodeClass volumes.
    karpenter = next((r for r in g.of("kubernetes:helm.sh/v3:Release")
                      if str(r["inputs"].get("chart", "")).rstrip("/").endswith("/karpenter")), None)
    for nc in g.of("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"):
        for bdm in _spec(nc).get("blockDeviceMappings") or []:
            key = (bdm.get("ebs") or {}).get("kmsKeyID")
            if not key:
                continue
            if karpenter is None:
                raise ValueError(f"{nc['urn']}: an EC2NodeClass but no Karpenter release in the plan")
            sa = ((karpenter["inputs"].get("values") or {}).get("serviceAccount") or {}).get("name", "karpenter")
            role = g.service_account_role(karpenter["inputs"].get("namespace", ""), sa)
            if role is None:
                raise ValueError(f"no Pod Identity association binds Karpenter's service account {sa!r} to a role")
            yield Consumer(what=nc["urn"], why="Karpenter node volumes", principal=role, key_arn=key, need=EBS,
                           context=via_ec2, grant_context=_grant())

    # EBS through the EBS CSI driver: persistent volumes of an encrypted StorageClass.
    for sc in g.of("kubernetes:storage.k8s.io/v1:StorageClass"):
        params = sc["inputs"].get("parameters") or {}
        if sc["inputs"].get("provisioner") == "ebs.csi.aws.com" and params.get("kmsKeyId"):
            role = g.service_account_role("kube-system", "ebs-csi-controller-sa")
            if role is None:
                raise ValueError("an EBS StorageClass with a KMS key but no role for the EBS CSI controller")
            yield Consumer(what=sc["urn"], why="EBS CSI persistent volumes", principal=role,
                           key_arn=params["kmsKeyId"], need=EBS, context=via_ec2, grant_context=_grant())


def _queue_consumers(g: _Graph, roles: Sequence[Principal]) -> Iterator[Consumer]:
    """SQS: EventBridge sends through the targets that point at the queue; roles that may receive decrypt."""
    for q in g.of("aws:sqs/queue:Queue"):
        key = q["inputs"].get("kmsMasterKeyId")
        if not key:
            continue
        queue_arn = g.out(q, "arn")
        for target in g.of("aws:cloudwatch/eventTarget:EventTarget"):
            if target["inputs"].get("arn") == queue_arn:
                rule = g.find("aws:cloudwatch/eventRule:EventRule", target["inputs"].get("rule"), "name")
                rule_arn = g.out(rule, "arn") if rule else ""
                yield Consumer(what=target["urn"], why="EventBridge sends to the encrypted queue",
                               principal=Principal(service="events.amazonaws.com"), key_arn=key, need=SQS_SEND,
                               context={"aws:SourceAccount": g.account, "aws:SourceArn": rule_arn,
                                        **_via("sqs", g.region)})
        for role in roles:
            if _identity_allows(role.policies, "sqs:ReceiveMessage", queue_arn):
                yield Consumer(what=q["urn"], why="receives from the encrypted queue", principal=role,
                               key_arn=key, need=SQS_RECEIVE, context=_via("sqs", g.region))


def _bucket_consumers(g: _Graph, roles: Sequence[Principal]) -> Iterator[Consumer]:
    """S3: every role that may read or write objects of an SSE-KMS bucket."""
    for sse in g.of("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"):
        bucket = g.find("aws:s3/bucket:Bucket", sse["inputs"].get("bucket"), "bucket")
        for rule in sse["inputs"].get("rules") or []:
            default = rule.get("applyServerSideEncryptionByDefault") or {}
            key = default.get("kmsMasterKeyId")
            if not (bucket and default.get("sseAlgorithm") == "aws:kms" and key):
                continue
            name = g.out(bucket, "bucket")
            # With a bucket key the encryption context is the bucket's ARN.
            ctx = {**_via("s3", g.region), "kms:EncryptionContext:aws:s3:arn": f"arn:aws:s3:::{name}"}
            for role in roles:
                if _identity_allows_prefix(role.policies, "s3:PutObject", f"arn:aws:s3:::{name}/"):
                    yield Consumer(what=bucket["urn"], why="writes objects", principal=role, key_arn=key,
                                   need=S3_WRITE, context=ctx)
                elif _identity_allows_prefix(role.policies, "s3:GetObject", f"arn:aws:s3:::{name}/"):
                    yield Consumer(what=bucket["urn"], why="reads objects", principal=role, key_arn=key,
                                   need=S3_READ, context=ctx)


def _identity_allows(policies: Sequence[Mapping[str, Any]], action: str, resource: str) -> bool:
    return any(s.get("Effect") == "Allow" and _action_matches(s, action) and _resource_matches(s, resource)
               for doc in policies for s in _statements(doc))


def _identity_allows_prefix(policies: Sequence[Mapping[str, Any]], action: str, prefix: str) -> bool:
    """True if some Allow statement grants `action` on an object ARN under `prefix` (any object or key prefix)."""
    return any(s.get("Effect") == "Allow" and _action_matches(s, action)
               and any(str(r).startswith(prefix) or r == "*" for r in _as_list(s.get("Resource")))
               for doc in policies for s in _statements(doc))


def _key_policies(plan: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    g = _Graph(plan)
    return {g.out(k, "arn"): _parse(k["inputs"]["policy"]) for k in g.of("aws:kms/key:Key")}


def named_principals_exist(plan: Mapping[str, Any]) -> list[str]:
    """A role named directly as a key policy principal must exist before the key: created in the plan
    (and the key depends on it) or looked up at deploy time. One line per principal that is neither."""
    g = _Graph(plan)
    looked_up = {(i["args"].get("pathPrefix"), i["args"].get("nameRegex")) for i in plan.get("invokes") or []
                 if i["token"] == "aws:iam/getRoles:getRoles"}
    problems = []
    for key in g.of("aws:kms/key:Key"):
        deps = set(g.reg.get(key["urn"], {}).get("dependencies") or [])
        for stmt in _statements(_parse(key["inputs"]["policy"])):
            p = stmt.get("Principal")
            for arn in _as_list(p.get("AWS")) if isinstance(p, Mapping) else []:
                if arn == "*" or arn.endswith(":root") or arn.isdigit():
                    continue
                made = [r["urn"] for r in g.resources if r["type"].startswith("aws:iam/")
                        and g.out(r, "arn") == arn]
                name = arn.rsplit("/", 1)[-1]
                path = arn.split(":role", 1)[-1][: -len(name)] if ":role" in arn else ""
                if made and set(made) & deps:
                    continue
                if (path, f"^{name}$") in looked_up:
                    continue
                line = f"{key['urn']}: the key policy names {arn}, which the plan neither creates before the key " \
                       "nor looks up"
                if line not in problems:
                    problems.append(line)
    return problems


def problems(plan: Mapping[str, Any]) -> list[str]:
    """One line per consumer request the key policy and the principal's IAM policies do not allow."""
    policies = _key_policies(plan)
    out = named_principals_exist(plan)
    for c in consumers(plan):
        policy = policies.get(c.key_arn)
        if policy is None:
            out.append(f"{c.what}: {c.why}: key {c.key_arn} is not a customer-managed key of this plan")
            continue
        for req in c.requests():
            decision = evaluate(req, policy)
            if not decision.allowed:
                out.append(f"{c.what}: {c.why}: {c.principal.name} may not {req.action} on {c.key_arn}: "
                           f"{decision.reason} (needed per {c.need.source})")
    return out


def main(argv: list[str] | None = None) -> int:
    return check_plans_main(argv, prog="python -m policies.plan.aws_kms", description=__doc__.split("\n\n")[0],
                            check=problems,
                            summarize=lambda plan, lines: f"{len(consumers(plan))} key consumers, {len(lines)} denied")


if __name__ == "__main__":
    sys.exit(main())
