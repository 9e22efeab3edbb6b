"""tools/validation/crd.py, the plan-time check of custom resources against their CRDs, held to the real API server's
verdicts: every custom resource the four stacks and the serving variant render, and the variants of each that
tests/cluster/crd_cases.py derives from its CRD's schema (one broken type, enum, bound, pattern, format, required
property, undeclared field, list-type set or map, or CEL rule each), checked by `crd.validate` and by a server-side
dry run with `fieldValidation=Strict` (an undeclared field is refused, not dropped) on a plane of this module's own.

Run: .venv/bin/pytest tests/cluster/test_crd_differential.py -q

The plane runs only etcd and the API server, with the CRDs the rest of the lane installs (tools/cluster/platform.py
install_crds): Kueue's and JobSet's as their pinned modules ship them; the others rebuilt from their snapshots
(tests/schemas/crds), since their CRD files (kube-prometheus-stack's, Karpenter's, CloudNativePG's, the node
readiness controller's, KServe's, GKE's networking API's, the VPC CNI's ENIConfig, KubeRay's) are not on this
machine offline. A snapshot keeps every keyword the API server validates with; it drops descriptions and rule
messages, so the API server names a broken rule by its text ("failed rule: ...").

A case whose verdict the check leaves to a rule it reports in `.unevaluated` (Kubernetes' own CEL functions) counts
apart: the API server must accept it or refuse it for those rules only, and must accept the plans' own objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes.dynamic.exceptions import ApiException

from tests.cluster import crd_cases
from tests.cluster.conftest import PLANNED, ROOT
from tools.cluster.plane import Plane
from tools.cluster.platform import install_crds
from tools.validation import crd

# The families of variants crd_cases derives, by the words their mutation starts with after the path.
FAMILIES = ("wrong type", "not in the enum", "required", "unknown field", "not matching pattern", "breaks rule",
            "a repeated item", "below minimum", "longer than maxLength", "more than maxItems")
# The start of the API server's message when server-side apply finds a value its schema's type cannot hold
# (structured-merge-diff, apiserver's fieldmanager).
TYPED_PATCH = "failed to create typed patch object"


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    plane = Plane.start(ROOT / "build" / "cluster" / f"crds-{tmp_path_factory.getbasetemp().name}",
                        controllers=False)
    install_crds(plane, with_modules=True)  # each waited on until Established (Plane.apply)
    yield plane
    plane.stop()


@dataclass
class Verdict:
    case: crd_cases.Case
    check: crd.Result
    applied: list[str]  # why a dry run of server-side apply (as Pulumi applies) would not store the object as sent
    created: list[str]  # the same for a dry-run create, which reaches schema validation with any value's type

    @property
    def undecided(self) -> list[crd.Unevaluated]:
        """The rules the check could not evaluate that could decide this case: none when it found a problem
        (the object is refused whatever they say) or when they are transition rules (run on update only)."""
        if self.check.problems:
            return []
        return [u for u in self.check.unevaluated if u.category != "transition"]


def dropped(sent: Any, stored: Any, path: str = "") -> list[str]:
    """The fields of `sent` that `stored` lacks (pruned by the API server); metadata is the server's own."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        return [d for k, v in sent.items() if not (not path and k == "metadata")
                for d in ([f"{path}.{k}: dropped"] if k not in stored else dropped(v, stored[k], f"{path}.{k}"))]
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        return [d for i, (a, b) in enumerate(zip(sent, stored, strict=True)) for d in dropped(a, b, f"{path}[{i}]")]
    return []


def _why(request: Callable[[], Any], sent: dict) -> list[str]:
    """[] when the API server would store `sent` as it is, else its causes: 422 Invalid (schema, CEL rules), 400
    BadRequest (a field the schema does not declare, under strict field validation), 500 where server-side apply
    cannot type the object, or the fields it would drop."""
    try:
        return dropped(sent, request().to_dict())
    except ApiException as e:
        status = json.loads(e.body)
        if e.status not in (400, 422) and not (e.status == 500 and TYPED_PATCH in status.get("message", "")):
            raise
        causes = (status.get("details") or {}).get("causes") or []
        return [f"{e.status} {c.get('field', '')}: {c.get('message', '')}" for c in causes] or [
            f"{e.status} {status.get('message', '')}"]


def dry_runs(plane: Plane, obj: dict) -> tuple[list[str], list[str]]:
    """What a dry run of server-side apply and one of create, both with `fieldValidation=Strict`, say of `obj`."""
    res = plane.client().resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    namespace = obj["metadata"].get("namespace")
    return (_why(lambda: plane.apply([obj], dry_run=True, field_validation="Strict")[0], obj),
            _why(lambda: res.create(body=obj, namespace=namespace, dry_run="All",
                                    query_params=[("fieldValidation", "Strict")]), obj))


@pytest.fixture(scope="module")
def verdicts(bare, plan_out) -> list[Verdict]:
    seen: set[str] = set()
    cases = [c for stack in PLANNED for c in crd_cases.cases(
        stack, crd.custom_resources(json.loads((plan_out / f"{stack}.json").read_text())), seen)]
    namespaces = sorted({c.obj["metadata"]["namespace"] for c in cases if c.obj["metadata"].get("namespace")})
    bare.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in namespaces])
    return [Verdict(c, crd.validate(c.obj), *dry_runs(bare, c.obj)) for c in cases]


def test_the_plans_own_custom_resources_pass_the_check_and_the_api_server(verdicts, subtests):
    own = [v for v in verdicts if not v.case.mutation]
    assert {v.case.obj["kind"] for v in own} >= {"NodePool", "EC2NodeClass", "ClusterQueue", "JobSet", "PodMonitor",
                                                  "InferenceService", "GKENetworkParamSet", "NodeReadinessRule"}
    for v in own:
        with subtests.test(msg=v.case.id):
            assert (v.check.problems, v.applied, v.created) == ([], [], [])


def test_the_check_agrees_with_the_api_server_on_every_variant(verdicts, subtests):
    decided = [v for v in verdicts if v.case.mutation and not v.undecided]
    for v in decided:
        with subtests.test(msg=v.case.id):
            assert bool(v.check.problems) == bool(v.applied) == bool(v.created), (
                v.check.problems, v.applied, v.created)
    made = {family for v in decided for family in FAMILIES if v.case.mutation.split(": ", 1)[1].startswith(family)}
    assert made == set(FAMILIES)
    # Nearly every variant breaks its CRD as derived (a dropped property with a default does not).
    assert sum(bool(v.created) for v in decided) > 0.95 * len(decided)


def test_every_rule_at_a_place_the_plans_fill_has_a_variant_that_breaks_it(verdicts):
    made = {crd_cases.key(v.case.obj, v.case.mutation) for v in verdicts if v.case.mutation}
    rules = {k for v in verdicts if not v.case.mutation for k in crd_cases.rule_keys(v.case.obj)}
    assert len(rules) > 50
    assert sorted(rules - made) == []


def test_variants_left_to_unevaluated_rules_are_refused_for_those_rules_only(verdicts, subtests):
    """The check found nothing else wrong: the API server stores such a variant, or refuses it naming only rules
    the check reported unevaluated (without their messages in the snapshots, it names a rule by its text)."""
    undecided = [v for v in verdicts if v.case.mutation and v.undecided]
    for v in undecided:
        with subtests.test(msg=v.case.id):
            rules = {u.rule for u in v.undecided}
            causes = v.applied + v.created
            assert [c for c in causes if not any(c.endswith(f"failed rule: {r}") for r in rules)] == [], rules
    # A variant made to break a rule the check left out is refused by the API server: the variant does break it.
    broken = [v for v in undecided if v.case.mutation.split(": ", 1)[1].startswith("breaks rule")]
    assert len(broken) > 5
    assert [v.case.id for v in broken if not v.applied or not v.created] == []
