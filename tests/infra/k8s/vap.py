"""Evaluate ValidatingAdmissionPolicies the way the API server does, with cel-python: match the object's kind
against each policy's resourceRules, bind `object`, `request` and the policy's `variables`, and run every
validation; an expression that errors counts as a denial (failurePolicy Fail).

Usage: `denials = Admission(policies).denials(obj, namespace="team-research")` -> ["host-paths: ...", ...].
Used by tests/infra/k8s/test_pod_admission.py; tests/cluster/test_admission_differential.py checks that it agrees
with the real API server on every one of those cases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import celpy
from celpy import celtypes

# kind -> (API group, resource) the policies' resourceRules name.
RESOURCES = {"Pod": ("", "pods"), "Job": ("batch", "jobs"), "JobSet": ("jobset.x-k8s.io", "jobsets")}
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(expression: str):
    if expression not in _PROGRAMS:
        _PROGRAMS[expression] = _ENV.program(_ENV.compile(expression))
    return _PROGRAMS[expression]


def _matches(policy: Mapping[str, Any], kind: str) -> bool:
    group, resource = RESOURCES[kind]
    return any(group in rule["apiGroups"] and resource in rule["resources"]
               for rule in policy["spec"]["matchConstraints"]["resourceRules"])


class Admission:
    def __init__(self, objects: Sequence[Mapping[str, Any]]):
        self.policies = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
        bound = {o["spec"]["policyName"] for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                 and "Deny" in o["spec"]["validationActions"]}
        self.policies = [p for p in self.policies if p["metadata"]["name"] in bound]

    def denials(self, obj: Mapping[str, Any], namespace: str) -> list[str]:
        """The messages of every failing validation of every policy that admits this kind."""
        out = []
        for policy in self.policies:
            if not _matches(policy, obj["kind"]):
                continue
            activation: dict[str, Any] = {"object": celpy.json_to_cel(dict(obj)),
                                          "request": celpy.json_to_cel({"namespace": namespace,
                                                                        "operation": "CREATE"})}
            variables = {}
            for var in policy["spec"].get("variables") or []:
                variables[celtypes.StringType(var["name"])] = _program(var["expression"]).evaluate(activation)
            activation["variables"] = celtypes.MapType(variables)
            for validation in policy["spec"]["validations"]:
                try:
                    result = _program(validation["expression"]).evaluate(activation)
                except celpy.CELEvalError as exc:
                    out.append(f"{validation['message']} (evaluation error: {exc.args[0]})")
                    continue
                if isinstance(result, celpy.CELEvalError):
                    out.append(f"{validation['message']} (evaluation error: {result.args[0]})")
                elif result is not True and not (isinstance(result, celtypes.BoolType) and bool(result)):
                    out.append(validation["message"])
        return out
