"""RBAC rules over one Kubernetes object: no cluster-admin bindings, no wildcard or escalating roles.

Usage:
    from policies import rbac
    rbac.rbac_problems({"kind": "ClusterRoleBinding", "roleRef": {"kind": "ClusterRole", "name": "cluster-admin"}, ...})
    list(rbac.rbac_least_privilege(res, ctx))

- A RoleBinding or ClusterRoleBinding to the ClusterRole `cluster-admin` grants every verb on every
  resource (in the namespace, or everywhere); no binding the stack creates may use it.
- A binding whose subjects include `system:masters` (a group that bypasses RBAC authorization
  entirely), `system:anonymous` or `system:unauthenticated` hands rights to callers nobody vouches for.
- A Role or ClusterRole may not use `*` in apiGroups, resources or verbs, and may not grant the
  verbs `escalate`, `bind` or `impersonate`, which let the holder create or assume rights it does not
  have (https://kubernetes.io/docs/concepts/security/rbac-good-practices/#privilege-escalation-risks).
  Teams get rights only through the roles the stack defines for them, so checking every role the
  stack creates also checks every role bound to a team group. Roles inside Helm charts (the
  platform's controllers) are not visible to the pack.

Each check reads only the object it is given, so an admission policy can apply the same function to
what a team submits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from policies.core import Context, Resource, dig, items
from policies.pods import k8s_object

ROLE_KINDS = ("Role", "ClusterRole")
BINDING_KINDS = ("RoleBinding", "ClusterRoleBinding")
ADMIN_ROLE = "cluster-admin"
ESCALATING_VERBS = ("escalate", "bind", "impersonate")
UNSAFE_SUBJECTS = {"system:masters": "bypasses RBAC authorization", "system:anonymous": "is any unauthenticated caller",
                   "system:unauthenticated": "is any unauthenticated caller"}


def _role_problems(obj: Mapping[str, Any]) -> list[str]:
    problems = []
    for i, rule in enumerate(items(obj.get("rules"))):
        for field in ("apiGroups", "resources", "verbs"):
            wild = [v for v in items(dig(rule, field)) if "*" in str(v)]
            if wild:
                problems.append(f"rules[{i}].{field} uses the wildcard {', '.join(map(str, wild))}.")
        escalating = [v for v in items(dig(rule, "verbs")) if v in ESCALATING_VERBS]
        if escalating:
            problems.append(f"rules[{i}] grants {', '.join(escalating)} on {', '.join(map(str, items(dig(rule, 'resources')))) or 'nothing'}, "
                            "which lets the holder gain rights it was not given.")
    return problems


def _binding_problems(obj: Mapping[str, Any]) -> list[str]:
    problems = []
    ref = obj.get("roleRef") or {}
    if dig(ref, "kind") == "ClusterRole" and dig(ref, "name") == ADMIN_ROLE:
        scope = "every namespace" if obj.get("kind") == "ClusterRoleBinding" else "its namespace"
        who = ", ".join(f"{dig(s, 'kind')} {dig(s, 'name')}" for s in items(obj.get("subjects"))) or "no subject"
        problems.append(f"binds {who} to ClusterRole {ADMIN_ROLE}: every verb on every resource in {scope}.")
    for s in items(obj.get("subjects")):
        why = UNSAFE_SUBJECTS.get(str(dig(s, "name")))
        if why:
            problems.append(f"subject {dig(s, 'kind')} {dig(s, 'name')} {why}.")
    return problems


def rbac_problems(obj: Mapping[str, Any]) -> list[str]:
    """Problems of one Role, ClusterRole, RoleBinding or ClusterRoleBinding; [] for other kinds."""
    if str(obj.get("apiVersion", "")).split("/")[0] != "rbac.authorization.k8s.io":
        return []
    kind = obj.get("kind")
    if kind in ROLE_KINDS:
        return _role_problems(obj)
    if kind in BINDING_KINDS:
        return _binding_problems(obj)
    return []


def rbac_least_privilege(res: Resource, ctx: Context) -> Iterator[str]:
    """No binding to cluster-admin or to RBAC-bypassing groups; no role with wildcards or escalate/bind/impersonate."""
    obj = k8s_object(res)
    if obj is not None:
        yield from rbac_problems(obj)
