"""Lint every IAM policy document of an offline plan with parliament (https://github.com/duo-labs/parliament).

Usage:
    python -m policies.plan.aws_iam_lint build/plan/aws-prod.json [more plans...]   # exit 1 on any finding
    documents(plan)         # every IAM-shaped document in a plan, with its kind and where it sits
    lint(doc, kind)         # parliament's findings for one document, each marked excused or not

Needs the dev extras (parliament 1.6.4). parliament knows which actions, resource ARN formats and
condition keys exist and which condition keys apply to which action, from AWS's Service Authorization
Reference; it finds unknown actions, malformed ARNs, a condition key on an action it does not apply to
(which makes an Allow never match), and resources that cannot match an action.

parliament reads every document as an identity policy. The few findings that are wrong for the kind
of document they sit in, or that come from gaps in its catalogue, are listed once in `EXCUSES`, each
with the reason and the source; every other finding fails. Document kinds: `identity` (role inline
and managed policies), `trust` (role trust policies), `key` (KMS key policies), `bucket`, `queue` and
`repository` (S3, SQS and ECR resource policies). ECR lifecycle policies are not IAM documents (no
actions or principals) and are not linted.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from policies.plan import check_plans_main

# Resource type -> (input holding a policy document, document kind).
DOCUMENT_FIELDS: Mapping[str, tuple[str, str]] = {
    "aws:iam/role:Role": ("assumeRolePolicy", "trust"),
    "aws:iam/rolePolicy:RolePolicy": ("policy", "identity"),
    "aws:iam/policy:Policy": ("policy", "identity"),
    "aws:kms/key:Key": ("policy", "key"),
    "aws:s3/bucketPolicy:BucketPolicy": ("policy", "bucket"),
    "aws:sqs/queuePolicy:QueuePolicy": ("policy", "queue"),
    "aws:ecr/repositoryPolicy:RepositoryPolicy": ("policy", "repository"),
}


@dataclass(frozen=True, kw_only=True)
class PolicyDocument:
    urn: str  # the resource that holds it
    field: str  # its input name
    kind: str  # identity | trust | key | bucket | queue | repository
    document: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Finding:
    issue: str  # parliament's issue id, e.g. UNKNOWN_ACTION
    detail: Any  # parliament's detail (a string or a list of dicts)
    excused_by: str = ""  # the EXCUSES entry that excuses it; "" when it fails


@dataclass(frozen=True, kw_only=True)
class Excuse:
    name: str
    issue: str  # parliament issue id it may excuse
    kinds: frozenset[str]  # document kinds it applies to
    applies: Callable[[Any, dict[str, Any]], bool]  # (finding detail, whole document) -> excused?
    reason: str
    source: str


def _statements(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    stmts = doc.get("Statement", [])
    return [stmts] if isinstance(stmts, dict) else list(stmts)


def _as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value or [])


def _split_launch_covered(detail: Any, doc: dict[str, Any]) -> bool:
    """RESOURCE_MISMATCH for RunInstances / CreateFleet, excused only if every resource format each
    action requires is granted for that action by some statement of the same document."""
    from parliament import is_arn_match

    if not isinstance(detail, list) or not detail:
        return False
    for item in detail:
        action, required = item.get("action", ""), item.get("required_format", "")
        if action not in ("ec2:RunInstances", "ec2:CreateFleet"):
            return False
        resource_type = required.split(":")[5].split("/")[0] if required.count(":") >= 5 else ""
        granted = [r for s in _statements(doc) if s.get("Effect") == "Allow"
                   and action in _as_list(s.get("Action")) for r in _as_list(s.get("Resource"))]
        if not any(is_arn_match(resource_type, required, r) for r in granted):
            return False
    return True


_PUBLIC_SSM = re.compile(r"^arn:aws:ssm:[a-z0-9-]+::parameter/aws/service/")


def _public_ssm_parameters(detail: Any, doc: dict[str, Any]) -> bool:
    if not isinstance(detail, list) or not detail:
        return False
    if not all(d.get("action") == "ssm:GetParameter" for d in detail):
        return False
    resources = [r for s in _statements(doc) if "ssm:GetParameter" in _as_list(s.get("Action"))
                 for r in _as_list(s.get("Resource"))]
    return bool(resources) and all(_PUBLIC_SSM.match(r) for r in resources)


def _elb_create_action(detail: Any, doc: dict[str, Any]) -> bool:
    return detail == "Unknown condition elasticloadbalancing:CreateAction for action elasticloadbalancing:AddTags"


EXCUSES: tuple[Excuse, ...] = (
    Excuse(name="key-policy-resource-star", issue="RESOURCE_STAR", kinds=frozenset({"key"}),
           applies=lambda detail, doc: True,
           reason="In a key policy, Resource \"*\" means the key the policy is attached to; a key policy "
                  "cannot name any other resource.",
           source="https://docs.aws.amazon.com/kms/latest/developerguide/key-policy-overview.html"),
    Excuse(name="trust-policy-has-no-resource", issue="MALFORMED", kinds=frozenset({"trust"}),
           applies=lambda detail, doc: detail == "Statement contains neither Resource nor NotResource",
           reason="A role trust policy names who may assume the role; IAM rejects a Resource element in it.",
           source="https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_resource.html"),
    Excuse(name="launch-resources-in-several-statements", issue="RESOURCE_MISMATCH", kinds=frozenset({"identity"}),
           applies=_split_launch_covered,
           reason="EC2 authorizes RunInstances and CreateFleet once per resource they touch; the policy grants "
                  "the shared resources (image, subnet, security group, ...) and the new, tagged ones "
                  "(instance, volume, network interface, ...) in separate statements, as Karpenter's reference "
                  "policy does. Excused only when the document grants every required format somewhere.",
           source="https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ExamplePolicies_EC2.html#iam-example-runinstances"),
    Excuse(name="public-ssm-parameters", issue="RESOURCE_MISMATCH", kinds=frozenset({"identity"}),
           applies=_public_ssm_parameters,
           reason="AWS public parameters (/aws/service/...) have ARNs with an empty account field, which "
                  "parliament's ARN matcher does not accept; Karpenter's reference policy scopes "
                  "ssm:GetParameter exactly so.",
           source="https://docs.aws.amazon.com/systems-manager/latest/userguide/parameter-store-public-parameters.html"),
    Excuse(name="elb-tag-on-create", issue="UNKNOWN_CONDITION_FOR_ACTION", kinds=frozenset({"identity"}),
           applies=_elb_create_action,
           reason="parliament 1.6.4's catalogue lists elasticloadbalancing:CreateAction for the service but not "
                  "for AddTags; ELB documents it exactly there (tagging during CreateLoadBalancer / "
                  "CreateTargetGroup).",
           source="https://docs.aws.amazon.com/elasticloadbalancing/latest/userguide/tagging-resources-during-creation.html"),
)


def _parse(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            doc = json.loads(value)
        except json.JSONDecodeError:
            return None
        return doc if isinstance(doc, dict) else None
    return None


def _looks_like_policy(doc: Any) -> bool:
    return isinstance(doc, dict) and "Statement" in doc


def documents(plan: Mapping[str, Any]) -> list[PolicyDocument]:
    """Every IAM policy document in a plan. Raises if an AWS resource holds a policy-shaped JSON document
    in an input this module does not know, so a new document kind cannot slip past the lint."""
    out: list[PolicyDocument] = []
    for res in plan["resources"]:
        typ, inputs = res["type"], res["inputs"]
        if not typ.startswith("aws:"):
            continue
        known = DOCUMENT_FIELDS.get(typ)
        for key, value in inputs.items():
            doc = _parse(value)
            if not _looks_like_policy(doc):
                continue
            if known is None or key != known[0]:
                raise ValueError(f"{res['urn']}: input {key!r} holds a policy document that policies.plan.aws_iam_lint "
                                 "does not know; add its type to DOCUMENT_FIELDS")
            out.append(PolicyDocument(urn=res["urn"], field=key, kind=known[1], document=doc))
    return out


def lint(doc: Mapping[str, Any], kind: str) -> list[Finding]:
    """parliament's findings for one document, each marked with the excuse that applies (if any)."""
    with warnings.catch_warnings():
        # parliament imports pkg_resources, which warns about its own deprecation.
        warnings.simplefilter("ignore")
        import parliament

    policy = parliament.analyze_policy_string(json.dumps(doc))
    findings = []
    for f in policy.findings:
        excuse = next((e for e in EXCUSES if e.issue == f.issue and kind in e.kinds
                       and e.applies(f.detail, dict(doc))), None)
        findings.append(Finding(issue=f.issue, detail=f.detail, excused_by=excuse.name if excuse else ""))
    return findings


def failures(plan: Mapping[str, Any]) -> list[str]:
    """One line per finding no excuse covers, naming the resource, the input and the issue."""
    return [f"{d.urn} {d.field} ({d.kind}): {f.issue}: {f.detail}"
            for d in documents(plan) for f in lint(d.document, d.kind) if not f.excused_by]


def main(argv: list[str] | None = None) -> int:
    return check_plans_main(argv, prog="python -m policies.plan.aws_iam_lint", description=__doc__.split("\n\n")[0],
                            check=failures,
                            summarize=lambda plan, lines: f"{len(documents(plan))} IAM documents, {len(lines)} findings")


if __name__ == "__main__":
    sys.exit(main())
