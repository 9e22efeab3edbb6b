"""How an API server's refusals become one line (gpu_train.client.cluster.api_error): the Status bodies are the ones
the real kube-apiserver 1.34 sends (tests/cluster shows each against it).

Run: .venv/bin/pytest tests/gpu_train/client/test_cluster.py -q
"""

from __future__ import annotations

import json

from kubernetes.client.rest import ApiException

from gpu_train.client.cluster import api_error


def _refusal(code: int, reason: str, message: str) -> ApiException:
    exc = ApiException(status=code, reason=reason)
    exc.body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                           "reason": reason, "code": code})
    return exc


def test_rbac_and_admission_refusals_are_told_apart():
    rbac = api_error(_refusal(403, "Forbidden", 'jobsets.jobset.x-k8s.io is forbidden: User "vera" cannot create '
                              'resource "jobsets" in API group "jobset.x-k8s.io" in the namespace "team-research"'),
                     doing="create jobsets", namespace="team-research", team="research")
    assert "you may not create jobsets in namespace team-research (403 Forbidden" in str(rbac)
    assert "not a member of team 'research'" in str(rbac) and rbac.code == 1
    denied = api_error(_refusal(403, "Forbidden", 'jobsets.jobset.x-k8s.io "x" is forbidden: ValidatingAdmissionPolicy '
                                "'gpu-train-team-jobsets' with binding 'gpu-train-team-jobsets' denied request: "
                                "image-registry: images in a team namespace must come from the platform's registry"),
                       doing="create jobsets", namespace="team-research", team="research")
    assert str(denied).startswith("the cluster refused to create jobsets in namespace team-research (403 Forbidden): ")
    assert "image-registry:" in str(denied) and "member" not in str(denied) and denied.code == 2


def test_no_credential_at_all_is_a_sign_in_problem_not_a_membership_one():
    anonymous = api_error(_refusal(403, "Forbidden", 'jobsets.jobset.x-k8s.io is forbidden: User "system:anonymous" '
                                   'cannot list resource "jobsets" in API group "jobset.x-k8s.io" in the namespace '
                                   '"team-research"'), doing="list jobsets", namespace="team-research", team="research")
    assert "did not accept your credentials (403 Forbidden to system:anonymous: no credential was sent)" in str(anonymous)
    assert "sign in again" in str(anonymous) and "member" not in str(anonymous) and anonymous.code == 1
    expired = api_error(_refusal(401, "Unauthorized", "Unauthorized"), doing="list jobsets")
    assert "did not accept your credentials (401 Unauthorized) to list jobsets" in str(expired)
