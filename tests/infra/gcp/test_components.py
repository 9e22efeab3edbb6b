"""GCP components under Pulumi mocks: `pytest tests/infra/gcp/test_components.py`.

Runs `build_platform` for a stack with A3 High and A3 Ultra pools and a managed MLflow database
(the committed stacks cover G2 and A3 Mega), records every registration with its parent and the
dependencies it declared, and checks the registered resources, their order (APIs, service agents,
key grants) and the returned contract.
"""

from __future__ import annotations

import asyncio

import pulumi
from pulumi.runtime import mocks as runtime_mocks

from infra.gcp.mocks import PROJECT_NUMBER
from infra.mocks import MockContext, PlanMocks
from policies.plan import gcp_gpu, gcp_kms, gcp_services
from tests.infra.gcp.conftest import fabric_pool, stack_cfg


class Recorder(runtime_mocks.MockMonitor):
    """Keeps each registration as a plan record (with `dependencies`) and every invoke token."""

    def __init__(self, mocks):
        super().__init__(mocks)
        self.requests = []
        self.records = []
        self.invokes = []

    def RegisterResource(self, request):  # noqa: N802 - gRPC method name
        from pulumi.runtime import rpc
        inputs = rpc.deserialize_properties(request.object)
        response = super().RegisterResource(request)
        self.requests.append((request, inputs))
        self.records.append({"urn": response.urn, "type": request.type, "name": request.name,
                             "parent": request.parent or None, "inputs": inputs,
                             "dependencies": list(request.dependencies)})
        return response

    def Invoke(self, request):  # noqa: N802 - gRPC method name
        from pulumi.runtime import rpc
        self.invokes.append((request.tok, rpc.deserialize_properties(request.args)))
        return super().Invoke(request)


def _run(cfg):
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region=cfg.region, project=cfg.project))
    monitor = Recorder(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack=cfg.stack, preview=False, monitor=monitor)
    from gpu_train.spec import naming
    from infra.gcp import build_platform
    return build_platform(cfg, naming.common_tags(cfg.stack, cfg.environment, cfg.tags)), monitor


def _cfg():
    cfg = stack_cfg([fabric_pool("hi", "a3-highgpu-8g"), fabric_pool("ultra", "a3-ultragpu-8g", "reservation")])
    return cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"enabled": True, "database": "managed"})})


def _waits(platform):
    """Every pool, grant and identity, so all registrations have reached the monitor."""
    return [platform.cluster_name, platform.kubeconfig, *[r.urn for r in platform.ready],
            *[i.annotations["iam.gke.io/gcp-service-account"] for i in platform.identities.values()],
            platform.registry.password, platform.registry.cache_repository, platform.buckets.checkpoints,
            platform.mlflow_database.host]


@pulumi.runtime.test
def test_a3_high_and_ultra_pools_under_mocks():
    cfg = _cfg()
    platform, monitor = _run(cfg)

    def check(_):
        by_name = {req.name: (req, inputs) for req, inputs in monitor.requests}
        hi = by_name["gpu-hi-pool"][1]
        ultra = by_name["gpu-ultra-pool"][1]
        assert len(hi["networkConfig"]["additionalNodeNetworkConfigs"]) == 4
        assert hi["nodeConfig"]["localNvmeSsdBlockConfig"]["localSsdCount"] == 16
        assert hi["nodeConfig"]["diskType"] == "pd-ssd"
        extra = ultra["networkConfig"]["additionalNodeNetworkConfigs"]
        assert len(extra) == 9 and len({e["network"] for e in extra}) == 2
        assert ultra["nodeConfig"]["localNvmeSsdBlockConfig"]["localSsdCount"] == 32
        assert ultra["nodeConfig"]["diskType"] == "hyperdisk-balanced"
        assert ultra["nodeConfig"]["reservationAffinity"]["values"] == ["ultra-res"]
        roce = [(r.name, i) for r, i in monitor.requests if i.get("networkProfile")]
        assert [i["networkProfile"] for _, i in roce] == \
            ["projects/acme-ml-test/global/networkProfiles/us-central1-a-vpc-roce"]
        fabric_vpcs = {r.name: i["mtu"] for r, i in monitor.requests
                       if r.type == "gcp:compute/network:Network" and r.name != "network-vpc"}
        assert len(fabric_vpcs) == 4 + 2
        assert {n: m for n, m in fabric_vpcs.items() if "tcpx" in n} == {
            f"network-tcpx-gvnic-{i}": 8244 for i in range(1, 5)}
        assert {m for n, m in fabric_vpcs.items() if "rdma" in n} == {8896}
        # The RoCE VPC gets no VPC firewall rule; every gVNIC fabric VPC gets one.
        (roce_name, _), = roce
        firewalled = {i["network"] for r, i in monitor.requests if r.type == "gcp:compute/firewall:Firewall"}
        assert f"{roce_name}-id" not in firewalled
        assert all(f"{n}-id" in firewalled for n in fabric_vpcs if n != roce_name)
        # Prod keys are protected and every key rotates.
        keys = [(r, i) for r, i in monitor.requests if r.type == "gcp:kms/cryptoKey:CryptoKey"]
        assert len(keys) == 5 and all(r.protect and i["rotationPeriod"] == "7776000s" for r, i in keys)
        # Service agents: generated for the four APIs that support it, the storage one read through the
        # Storage API (which creates it).
        identities = {i["service"] for r, i in monitor.requests if r.type == "gcp:projects/serviceIdentity:ServiceIdentity"}
        assert identities == {"container.googleapis.com", "compute.googleapis.com",
                              "artifactregistry.googleapis.com", "sqladmin.googleapis.com"}
        assert ("gcp:storage/getProjectServiceAccount:getProjectServiceAccount", {"project": "acme-ml-test"}) in [
            (t, {k: v for k, v in a.items() if k == "project"}) for t, a in monitor.invokes]
        # The two repositories: immutable images, a mutable build cache, both on the registry key.
        repos = {r.name: i for r, i in monitor.requests if r.type == "gcp:artifactregistry/repository:Repository"}
        assert repos["registry-docker"]["dockerConfig"]["immutableTags"] is True
        assert repos["registry-cache"]["dockerConfig"]["immutableTags"] is False
        assert repos["registry-cache"]["kmsKeyName"] == repos["registry-docker"]["kmsKeyName"]
        assert repos["registry-cache"]["labels"]["purpose"] == "build-cache"
        gke = by_name["cluster-gke"][1]
        assert gke["enableMultiNetworking"] is True
        assert gke["controlPlaneEndpointsConfig"]["dnsEndpointConfig"]["allowExternalTraffic"] is True
        assert gke["privateClusterConfig"]["enablePrivateEndpoint"] is True
        assert {p.fabric.kind for p in platform.gpu_pools} == {"tcpx", "rdma"}
        assert set(platform.identities) == {"cache", "mlflow", "trainer/research", "sweeps/research",
                                            "data-prep/research"}
        assert (platform.identities["sweeps/research"].namespaces, platform.identities["sweeps/research"].name) == \
            (["team-research"], "sweep-controller")
        # The plan-graph checks, with the order each registration declared.
        records = monitor.records
        assert gcp_kms.key_access_problems(records, PROJECT_NUMBER) == []
        assert gcp_kms.ordering_problems(records, PROJECT_NUMBER) == []
        assert gcp_services.api_problems(records, cfg.project, check_order=True) == []
        assert gcp_gpu.gpu_problems(records) == []

    return pulumi.Output.all(*_waits(platform)).apply(check)


@pulumi.runtime.test
def test_kubeconfig_and_contract_name_the_dns_endpoint():
    cfg = _cfg()
    platform, _ = _run(cfg)

    def check(args):
        kubeconfig, cache_repository, repository = args
        import json
        server = json.loads(kubeconfig)["clusters"][0]["cluster"]["server"]
        assert server.startswith("https://gke-") and server.endswith(".us-central1.gke.goog")
        assert cache_repository == "us-central1-docker.pkg.dev/acme-ml-test/gpu-train-gcp-test-buildcache/trainer"
        assert repository.rsplit("/", 1)[0] != cache_repository.rsplit("/", 1)[0]

    return pulumi.Output.all(platform.kubeconfig, platform.registry.cache_repository,
                             platform.registry.repository).apply(check)


def test_workload_identity_bindings_wait_for_the_cluster():
    from pulumi.runtime.stack import run_pulumi_func
    from pulumi.runtime.sync_await import _sync_await

    from gpu_train.spec import naming
    from infra.gcp import build_platform
    from policies.plan.graph import PlanGraph

    cfg = _cfg()
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region=cfg.region, project=cfg.project))
    monitor = Recorder(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack=cfg.stack, preview=False, monitor=monitor)
    # run_pulumi_func returns once every registration has reached the monitor, so no binding can be
    # missed by checking too early.
    _sync_await(run_pulumi_func(lambda: build_platform(cfg, naming.common_tags(cfg.stack, cfg.environment, cfg.tags))))
    graph = PlanGraph(monitor.records)
    (cluster,) = [r for r in monitor.records if r["type"] == "gcp:container/cluster:Cluster"]
    bindings = [r for r in monitor.records if r["type"] == "gcp:serviceaccount/iAMMember:IAMMember"]
    # Each team's trainer, sweep controllers and data preparation (Ray pods), the cache, MLflow.
    assert len(bindings) == 3 * len(cfg.teams) + 2
    assert all(cluster["urn"] in graph.waits_for(b["urn"]) for b in bindings)


def test_components_build_from_plain_values_without_stack_settings():
    """Network and Storage from their Args alone (no StackSettings): what the Args say is what they create."""
    from pulumi.runtime.stack import run_pulumi_func
    from pulumi.runtime.sync_await import _sync_await

    from infra.gcp.network import Network, NetworkArgs
    from infra.gcp.storage import Storage, StorageArgs

    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region="europe-west4", project="acme-ml-unit"))
    monitor = Recorder(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="gcp-unit", preview=False, monitor=monitor)

    def program():
        Network("network", NetworkArgs(
            stack="gcp-unit", project="acme-ml-unit", region="europe-west4", vpc_cidr="10.20.0.0/20",
            pod_cidr="10.24.0.0/14", service_cidr="10.28.0.0/20", master_cidr="172.16.0.48/28", flow_logs=False,
            nat_logs="ERRORS_ONLY", fabric={}, labels={"stack": "gcp-unit"}))
        Storage("storage", StorageArgs(stack="gcp-unit", project="acme-ml-unit", region="europe-west4",
                                       environment="dev", protect=False, labels={"stack": "gcp-unit"},
                                       kms_key="projects/acme-ml-unit/locations/europe-west4/keyRings/r/cryptoKeys/s"))

    _sync_await(run_pulumi_func(program))
    by_name = {req.name: (req, inputs) for req, inputs in monitor.requests}
    subnet = by_name["network-nodes"][1]
    assert (subnet["project"], subnet["region"], subnet["ipCidrRange"]) == ("acme-ml-unit", "europe-west4", "10.20.0.0/20")
    assert [r["ipCidrRange"] for r in subnet["secondaryIpRanges"]] == ["10.24.0.0/14", "10.28.0.0/20"]
    assert "logConfig" not in subnet  # flow_logs=False
    assert by_name["network-nat"][1]["logConfig"]["filter"] == "ERRORS_ONLY"
    assert by_name["network-allow-internal"][1]["sourceRanges"] == [
        "10.20.0.0/20", "10.24.0.0/14", "10.28.0.0/20", "172.16.0.48/28"]
    assert not [r for r, _ in monitor.requests if r.type == "gcp:compute/network:Network" and r.name != "network-vpc"]
    req, ckpt = by_name["storage-checkpoints"]
    assert ckpt["name"] == "gpu-train-gcp-unit-checkpoints-acme-ml-unit" and ckpt["location"] == "EUROPE-WEST4"
    assert ckpt["forceDestroy"] is True and not req.protect
    (delete,) = [r for r in ckpt["lifecycleRules"] if r["action"]["type"] == "Delete"]
    assert delete["condition"]["daysSinceNoncurrentTime"] == 3  # dev keeps old checkpoint versions 3 days
