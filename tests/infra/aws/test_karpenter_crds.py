"""Karpenter's EC2NodeClass and NodePool objects against the v1.14.1 CRDs: `pytest tests/infra/aws/test_karpenter_crds.py`.

Uses the general CRD check (tools/validation/crd.py) over the snapshots of the CRDs at the chart
version the program pins (tests/schemas/crds, source ref v1.14.1): structural schema, unknown fields,
enums, and the CEL rules, including the networkInterfaces, capacity-reservation and static NodePool
rules. Broken copies (the primary interface typed "efa", two EFA devices on one card, a GPU limit on
a static NodePool, an unknown field) must be rejected.
"""

from __future__ import annotations

import copy

import pytest

from infra.aws import karpenter
from tools.validation import crd

AWS_PLANS = ("aws-dev", "aws-prod", "aws-prod-p4d", "aws-prod-p5en")
KINDS = {"kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", "kubernetes:karpenter.sh/v1:NodePool"}


def _objects(plan: dict) -> list[dict]:
    return [{k: v for k, v in r["inputs"].items() if v is not None} for r in plan["resources"] if r["type"] in KINDS]


def _by_name(plan: dict, kind: str, name: str) -> dict:
    return next(o for o in _objects(plan) if o["kind"] == kind and o["metadata"]["name"] == name)


def test_the_snapshots_are_of_the_pinned_release():
    for kind in ("EC2NodeClass", "NodePool"):
        group = "karpenter.k8s.aws" if kind == "EC2NodeClass" else "karpenter.sh"
        snap = crd.Snapshots().by_kind()[(group, kind)]
        assert snap["source"]["ref"] == f"v{karpenter.CHART_VERSION}"


@pytest.mark.parametrize("stack", AWS_PLANS)
def test_every_node_class_and_node_pool_is_valid(all_plans, stack):
    objects = _objects(all_plans[stack])
    assert {o["kind"] for o in objects} == {"EC2NodeClass", "NodePool"}
    for obj in objects:
        result = crd.validate(obj)
        assert result.problems == [], (obj["metadata"]["name"], result.problems)
        # The rules on the fields this program sets were evaluated, not skipped.
        skipped = {u.path for u in result.unevaluated}
        assert not any(p.startswith(("spec.networkInterfaces", "spec.capacityReservationSelectorTerms",
                                     "spec.placementGroupSelector")) for p in skipped), skipped


def _rejected(obj: dict, edit, expect: str) -> None:
    assert crd.validate(obj).problems == []
    broken = copy.deepcopy(obj)
    edit(broken)
    problems = crd.validate(broken).problems
    assert problems and any(expect in p for p in problems), problems


def test_an_efa_typed_primary_interface_is_rejected(all_plans):
    # The CRD's interfaceType takes "interface" and "efa-only" only; "efa" is a launch-template value.
    obj = _by_name(all_plans["aws-prod"], "EC2NodeClass", "gpu-h100-spot")
    _rejected(obj, lambda o: o["spec"]["networkInterfaces"][0].update(interfaceType="efa"), "networkInterfaces")


def test_two_efa_devices_on_one_card_are_rejected(all_plans):
    obj = _by_name(all_plans["aws-prod"], "EC2NodeClass", "gpu-h100-spot")
    _rejected(obj, lambda o: o["spec"]["networkInterfaces"].append(
        {"networkCardIndex": 0, "deviceIndex": 2, "interfaceType": "efa-only"}), "violates the CRD's rule")


def test_a_missing_primary_interface_is_rejected(all_plans):
    obj = _by_name(all_plans["aws-prod"], "EC2NodeClass", "gpu-h100-reserved")
    _rejected(obj, lambda o: o["spec"]["networkInterfaces"].pop(0), "violates the CRD's rule")


def test_a_gpu_limit_on_a_static_node_pool_is_rejected(all_plans):
    obj = _by_name(all_plans["aws-prod"], "NodePool", "h100-reserved-static")
    _rejected(obj, lambda o: o["spec"]["limits"].update({"nvidia.com/gpu": "16"}), "violates the CRD's rule")


def test_an_unknown_field_is_rejected(all_plans):
    obj = _by_name(all_plans["aws-dev"], "EC2NodeClass", "gpu-l4-spot")
    _rejected(obj, lambda o: o["spec"].update(efaInterfaces=32), "unknown field")


def test_a_malformed_reservation_id_is_rejected(all_plans):
    obj = _by_name(all_plans["aws-prod"], "EC2NodeClass", "gpu-h100-reserved")
    _rejected(obj, lambda o: o["spec"]["capacityReservationSelectorTerms"][0].update(id="reservation-1"),
              "capacityReservationSelectorTerms")
