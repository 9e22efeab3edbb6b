"""GCP components under Pulumi mocks: `pytest tests/infra/gcp/test_components.py`.

Runs `build_platform` for a stack with A3 High and A3 Ultra pools (the committed stacks cover
G2 and A3 Mega) and checks the registered resources and the returned contract.
"""

from __future__ import annotations

import asyncio

import pulumi
from pulumi.runtime import mocks as runtime_mocks

from infra.mocks import MockContext, PlanMocks
from tests.infra.gcp.conftest import fabric_pool, stack_cfg


class Recorder(runtime_mocks.MockMonitor):
    def __init__(self, mocks):
        super().__init__(mocks)
        self.requests = []

    def RegisterResource(self, request):  # noqa: N802 - gRPC method name
        from pulumi.runtime import rpc
        self.requests.append((request, rpc.deserialize_properties(request.object)))
        return super().RegisterResource(request)


def _run(cfg):
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region=cfg.region, project=cfg.project))
    monitor = Recorder(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack=cfg.stack, preview=False, monitor=monitor)
    from infra import naming
    from infra.gcp import build_platform
    return build_platform(cfg, naming.common_tags(cfg)), monitor


@pulumi.runtime.test
def test_a3_high_and_ultra_pools_under_mocks():
    cfg = stack_cfg([fabric_pool("hi", "a3-highgpu-8g"), fabric_pool("ultra", "a3-ultragpu-8g", "reservation")])
    platform, monitor = _run(cfg)

    def check(_):
        by_name = {req.name: (req, inputs) for req, inputs in monitor.requests}
        hi = by_name["gpu-hi-pool"][1]
        ultra = by_name["gpu-ultra-pool"][1]
        assert len(hi["networkConfig"]["additionalNodeNetworkConfigs"]) == 4
        assert hi["nodeConfig"]["localNvmeSsdBlockConfig"]["localSsdCount"] == 16
        extra = ultra["networkConfig"]["additionalNodeNetworkConfigs"]
        assert len(extra) == 9 and len({e["network"] for e in extra}) == 2
        assert ultra["nodeConfig"]["localNvmeSsdBlockConfig"]["localSsdCount"] == 32
        assert ultra["nodeConfig"]["reservationAffinity"]["values"] == ["ultra-res"]
        roce = [i for _, i in monitor.requests if i.get("networkProfile")]
        assert [r["networkProfile"] for r in roce] == \
            ["projects/acme-ml-test/global/networkProfiles/us-central1-a-vpc-roce"]
        fabric_vpcs = [i for r, i in monitor.requests
                       if r.type == "gcp:compute/network:Network" and r.name != "network-vpc"]
        assert len(fabric_vpcs) == 4 + 2 and all(i["mtu"] == 8244 for i in fabric_vpcs)
        # Prod keys are protected and every key rotates.
        keys = [(r, i) for r, i in monitor.requests if r.type == "gcp:kms/cryptoKey:CryptoKey"]
        assert len(keys) == 4 and all(r.protect and i["rotationPeriod"] == "7776000s" for r, i in keys)
        # Buckets, registry and cluster wait for their key grants.
        grant_urns = {r.name: r for r, _ in monitor.requests if r.type.endswith("CryptoKeyIAMMember")}
        assert set(grant_urns) == {"keys-gke-agent", "keys-storage-agent", "keys-registry-agent", "keys-disks-agent"}
        storage = by_name["storage"][0]
        assert any("keys-storage-agent" in d for d in storage.dependencies)
        registry = by_name["registry"][0]
        assert any("keys-registry-agent" in d for d in registry.dependencies)
        cluster = by_name["cluster"][0]
        assert any("keys-gke-agent" in d for d in cluster.dependencies)
        assert by_name["cluster-gke"][1]["enableMultiNetworking"] is True
        assert {p.fabric.kind for p in platform.gpu_pools} == {"tcpx", "rdma"}
        assert set(platform.identities) == {"cache", "mlflow", "trainer/research"}

    # Wait for every pool, grant and identity so all registrations have reached the monitor.
    waits = [platform.cluster_name, platform.kubeconfig, *[r.urn for r in platform.ready],
             *[i.annotations["iam.gke.io/gcp-service-account"] for i in platform.identities.values()],
             platform.registry.password, platform.buckets.checkpoints]
    return pulumi.Output.all(*waits).apply(check)
