"""Access rules: no policy opens a resource to everyone, no identity gets wildcard or admin rights.

Usage:
    from policies import iam
    iam.public_statements('{"Statement": [{"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject"}]}')
    # -> ["statement 0 allows s3:GetObject to every principal (Principal '*') with no condition ..."]
    list(iam.no_public_resource_policy(res, ctx)); list(iam.no_wildcard_iam(res, ctx))

AWS policy documents are found wherever an AWS resource carries one (`policy`, `assumeRolePolicy`,
`policyDocument`, a role's `inlinePolicies`), so a bucket, queue, key, repository, topic or role
trust policy is covered without a per-type list. A document whose statements name a `Principal` or
`NotPrincipal` is a resource policy; one without is an identity policy.

- Public: whether an Allow statement reaches anyone is decided by policyuniverse (Netflix), which
  parses `Principal: "*"`, `{"AWS": "*"}`, lists, account wildcards and `NotPrincipal`, and counts a
  statement as restricted only by conditions on the caller's account, organisation, ARN, source
  VPC/endpoint or source IP that are not themselves wildcards. GCP grants to `allUsers` or
  `allAuthenticatedUsers` on any IAM member, binding or policy resource are public too.
- Wildcard: an identity policy statement that allows `*` or a whole service (`s3:*`), or uses
  `NotAction`, on `Resource: "*"` (or `NotResource`); attaching AWS's AdministratorAccess,
  PowerUserAccess or IAMFullAccess; GCP's basic roles (roles/owner, roles/editor). The wildcard test
  is lexical on purpose: `ec2:Describe*` on `*` is how read-only discovery is granted and stays
  allowed, while expanding actions through a catalogue would tie the rule to that catalogue's date.

References: IAM JSON policy elements
(https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements.html), S3 bucket policy
public access (https://docs.aws.amazon.com/AmazonS3/latest/userguide/access-control-block-public-access.html#access-control-block-public-access-policy-status),
GCP principal identifiers (https://cloud.google.com/iam/docs/principal-identifiers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from policyuniverse.statement import Statement

from policies.core import Context, Resource, is_list

# Props that hold a policy document (a JSON string, or an object under some providers).
POLICY_PROPS = ("policy", "assumeRolePolicy", "policyDocument", "accessPolicies")
PUBLIC_MEMBERS = frozenset({"allUsers", "allAuthenticatedUsers"})
BASIC_ROLES = frozenset({"roles/owner", "roles/editor"})
# AWS managed policies that amount to administrator rights (or the power to grant them).
ADMIN_POLICY = re.compile(r"^arn:aws[a-z-]*:iam::aws:policy/(AdministratorAccess|PowerUserAccess|IAMFullAccess)$")
_SERVICE_WILDCARD = re.compile(r"^[a-z0-9-]+:\*$", re.IGNORECASE)
_GCP_IAM_TYPE = re.compile(r"(IAMMember|IamMember|IAMBinding|IamBinding|IAMPolicy|IamPolicy)$")


def plain(value: Any) -> Any:
    """Nested mappings/sequences as dicts/lists (CrossGuard props are read-only proxies)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if is_list(value):
        return [plain(v) for v in value]
    return value


def document(value: Any) -> dict[str, Any] | None:
    """A policy document from a JSON string or an object; None when it is neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    value = plain(value)
    return value if isinstance(value, dict) else None


def as_list(value: Any) -> list[Any]:
    """IAM fields take a single value or a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def statements(doc: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    if not doc:
        return []
    return [s for s in as_list(doc.get("Statement")) if isinstance(s, dict)]


def is_resource_policy(doc: Mapping[str, Any] | None) -> bool:
    return any("Principal" in s or "NotPrincipal" in s for s in statements(doc))


def documents(res: Resource) -> list[tuple[str, dict[str, Any]]]:
    """(where, document) for every policy document an AWS resource carries."""
    if not res.type.startswith("aws:"):
        return []
    found = []
    for key in POLICY_PROPS:
        doc = document(res.get(key))
        if doc is not None and "Statement" in doc:
            found.append((key, doc))
    for i, inline in enumerate(as_list(plain(res.get("inlinePolicies")))):
        doc = document(inline.get("policy")) if isinstance(inline, dict) else None
        if doc is not None:
            found.append((f"inlinePolicies[{i}]", doc))
    return found


def _label(i: int, st: Mapping[str, Any]) -> str:
    return f"statement {i}" + (f" ({st['Sid']})" if st.get("Sid") else "")


def _who(st: Mapping[str, Any]) -> str:
    if "NotPrincipal" in st:
        return f"everyone except NotPrincipal {json.dumps(st['NotPrincipal'])}"
    return f"Principal {json.dumps(st.get('Principal'))}"


def public_statements(doc: Any) -> list[str]:
    """Allow statements of a resource policy that reach any principal (policyuniverse's test)."""
    parsed = document(doc)
    out = []
    for i, st in enumerate(statements(parsed)):
        if "Principal" not in st and "NotPrincipal" not in st:
            continue
        if Statement(st).is_internet_accessible():
            actions = ", ".join(str(a) for a in as_list(st.get("Action") or st.get("NotAction"))) or "(no action)"
            out.append(f"{_label(i, st)} allows {actions} to {_who(st)} with no condition limiting the caller "
                       "to an account, organisation, ARN, VPC or address range.")
    return out


def wildcard_statements(doc: Any) -> list[str]:
    """Allow statements of an identity policy that grant everything, or a whole service, on every resource."""
    parsed = document(doc)
    out = []
    for i, st in enumerate(statements(parsed)):
        if st.get("Effect") != "Allow" or "Principal" in st or "NotPrincipal" in st:
            continue
        all_resources = "NotResource" in st or "*" in as_list(st.get("Resource"))
        if not all_resources:
            continue
        if "NotAction" in st:
            out.append(f"{_label(i, st)} allows every action except {json.dumps(st['NotAction'])} "
                       "(NotAction) on Resource '*'.")
            continue
        wild = [a for a in as_list(st.get("Action")) if isinstance(a, str) and (a == "*" or _SERVICE_WILDCARD.match(a))]
        if wild:
            out.append(f"{_label(i, st)} allows {', '.join(wild)} on Resource '*'.")
    return out


def _gcp_members(res: Resource) -> list[tuple[str, str]]:
    """(role, member) pairs of a GCP IAM member, binding or policy resource."""
    if not res.type.startswith("gcp:") or not _GCP_IAM_TYPE.search(res.type):
        return []
    pairs = []
    role = res.get("role")
    if isinstance(res.get("member"), str):
        pairs.append((str(role), res.get("member")))
    pairs += [(str(role), str(m)) for m in as_list(plain(res.get("members")))]
    policy = document(res.get("policyData"))
    for binding in as_list((policy or {}).get("bindings")):
        if isinstance(binding, dict):
            pairs += [(str(binding.get("role")), str(m)) for m in as_list(binding.get("members"))]
    return pairs


def no_public_resource_policy(res: Resource, ctx: Context) -> Iterator[str]:
    """No resource policy or IAM grant lets anyone (any AWS principal, allUsers) use a resource."""
    for where, doc in documents(res):
        if is_resource_policy(doc):
            for problem in public_statements(doc):
                yield f"{where}: {problem}"
    for role, member in _gcp_members(res):
        if member in PUBLIC_MEMBERS:
            yield f"grants {role} to {member}, which is anyone (with a Google account, for allAuthenticatedUsers)."


def no_wildcard_iam(res: Resource, ctx: Context) -> Iterator[str]:
    """No identity policy grants `*`/`service:*` on `*`; no admin managed policy; no GCP basic role."""
    for where, doc in documents(res):
        if not is_resource_policy(doc):
            for problem in wildcard_statements(doc):
                yield f"{where}: {problem}"
    if res.type.startswith("aws:iam/"):
        arns = [res.get("policyArn"), *as_list(plain(res.get("managedPolicyArns")))]
        for arn in arns:
            if isinstance(arn, str) and ADMIN_POLICY.match(arn):
                yield f"attaches the AWS managed policy {arn}, which grants administrator-level rights."
    for role, member in _gcp_members(res):
        if role in BASIC_ROLES:
            yield f"grants the basic role {role} to {member}; grant a predefined or custom role instead."
