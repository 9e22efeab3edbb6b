"""The platform contract (infra/k8s/contract.py, the document gpu_train.spec.contract reads) of every planned stack: what `gpu-train` reads is what the stack
built. Its Kueue objects are the planned ClusterQueues and ResourceFlavors, its teams' NVMe directories and
service accounts are what the stack's own JobSet uses, its pools are the planned pools, and the ConfigMap in
each team namespace holds the same document as the `platform` output.

Run: .venv/bin/pytest tests/infra/k8s/test_contract.py -q
"""

from __future__ import annotations

import json

import pytest

from gpu_train.spec import naming
from gpu_train.spec.contract import ContractError, PlatformContract
from gpu_train.spec.pod_rules import image_allowed
from infra import clouds
from infra.plan import kubernetes_objects
from tests.conftest import STACKS
from tests.infra.k8s.harness import load_stack


@pytest.mark.parametrize("stack", STACKS)
def test_the_contract_is_what_the_stack_built(plans, stack):
    plan = plans[stack]
    doc = plan["outputs"]["platform"]
    c = PlatformContract.from_document(doc, stack)
    objs = kubernetes_objects(plan)
    cfg = load_stack(stack)
    assert (c.cloud, c.region) == (cfg.cloud, cfg.region)
    assert [p.name for p in c.pools] == [p.name for p in cfg.gpu_pools]
    # The pools as the cloud layer describes them before any resource (what the job check used), with what a node
    # of each leaves to a training pod; and the environment the cloud gives every training container.
    assert c.pools == clouds.layer(cfg.cloud).describe_pools(cfg)
    assert all(p.allocatable is not None for p in c.pools)
    assert c.pod_env == ({"AWS_REGION": cfg.region} if cfg.cloud == "aws" else {})
    assert [t.name for t in c.teams] == [t.name for t in cfg.teams]
    # Kueue as the cluster has it.
    planned_queues = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "ClusterQueue"}
    assert {q["metadata"]["name"]: q["spec"] for q in c.kueue.cluster_queues} == planned_queues
    planned_flavors = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "ResourceFlavor"}
    assert {f["metadata"]["name"]: f["spec"] for f in c.kueue.resource_flavors} == planned_flavors
    limit_ranges = [o["spec"] for o in objs if o["kind"] == "LimitRange"]
    assert all(lr == c.kueue.limit_range for lr in limit_ranges)
    # The stack's own job runs where the contract says a team's jobs run.
    (jobset,) = [o for o in objs if o["kind"] == "JobSet"]
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    team = c.team(cfg.job.team)
    nvme_volume = next(v for v in pod["volumes"] if v["name"] == "nvme")
    assert nvme_volume["hostPath"]["path"] == team.nvme_workdir == naming.workdir_path(c.nvme_host_path, team.namespace)
    assert doc["identities"][f"trainer/{team.name}"] == {"namespaces": [team.namespace],
                                                         "serviceAccount": pod["serviceAccountName"]}
    assert pod["containers"][0]["image"] == c.image
    assert image_allowed(c.image, c.registries, c.repositories)
    pool = c.pool(cfg.job.pool)
    assert pod["nodeSelector"] == dict(pool.node_selector)
    # Published in every team namespace, readable by the team's roles.
    maps = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "ConfigMap"
            and o["metadata"]["name"] == naming.PLATFORM_CONFIGMAP}
    assert set(maps) == {naming.team_namespace(t.name) for t in cfg.teams}
    for cm in maps.values():
        assert json.loads(cm["data"][naming.PLATFORM_CONFIGMAP_KEY]) == doc
    # No credential travels with it.
    text = json.dumps(doc)
    assert "token" not in text.lower().replace("get-token", "") and "password" not in text.lower()


def test_a_broken_document_is_named(plans):
    doc = plans["aws-dev"]["outputs"]["platform"]
    with pytest.raises(ContractError, match="x.json: pools is required"):
        PlatformContract.from_document({k: v for k, v in doc.items() if k != "pools"}, "x.json")
    with pytest.raises(ContractError, match="x.json: not JSON"):
        PlatformContract.from_json("{", "x.json")
    with pytest.raises(ContractError, match=r"x.json: cloud must be one of 'aws' \| 'gcp' \(got 'azure'\)"):
        PlatformContract.from_document({**doc, "cloud": "azure"}, "x.json")
