"""Component tests: the whole Kubernetes layer built under Pulumi mocks for every stack's settings on
a platform whose GPU nodes the cloud layer describes (tests/infra/k8s/harness.py), checked resource by resource.

Usage: .venv/bin/pytest tests/infra/k8s/test_layer.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from gpu_train.spec import naming
from infra import clouds
from infra.k8s import cache, common, gpu, health, monitoring, tenancy
from tests.infra.k8s.checks import containers_without_resources, cr_problems, selector_matches
from tests.infra.k8s.harness import STACKS, build_layer, load_stack, objects, of_kind, releases

CREATED_NAMESPACES = {naming.CACHE_NAMESPACE, naming.MONITORING_NAMESPACE, monitoring.AGENTS_NAMESPACE, common.GPU_NAMESPACE,
                      common.KUEUE_NAMESPACE, common.JOBSET_NAMESPACE, naming.KUBERAY_NAMESPACE, health.NAMESPACE,
                      naming.MLFLOW_NAMESPACE}
KUBE_DNS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


@pytest.mark.parametrize("stack", STACKS)
def test_every_created_namespace_has_default_deny(layers, stack):
    records, _ = layers[stack]
    cfg = load_stack(stack)
    namespaces = {o["metadata"]["name"] for o in of_kind(records, "Namespace")}
    assert namespaces == CREATED_NAMESPACES | {naming.team_namespace(t.name) for t in cfg.teams}
    for ns in namespaces:
        policies = [o for o in of_kind(records, "NetworkPolicy") if o["metadata"]["namespace"] == ns]
        deny = [p for p in policies if p["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}]
        assert [p["metadata"]["name"] for p in deny] == ["default-deny-all"], f"{stack}: namespace {ns}"
        assert any(KUBE_DNS in rule["to"] and {"protocol": "UDP", "port": 53} in rule["ports"]
                   for p in policies for rule in p["spec"].get("egress", [])), f"{stack}: no DNS from {ns}"


@pytest.mark.parametrize("stack", STACKS)
def test_monitors_and_rules_are_selected_by_the_release_prometheus(layers, stack):
    records, _ = layers[stack]
    values = releases(records)[naming.MONITORING_RELEASE]["values"]["prometheus"]["prometheusSpec"]
    selectors = {"ServiceMonitor": values["serviceMonitorSelector"], "PodMonitor": values["podMonitorSelector"],
                 "PrometheusRule": values["ruleSelector"]}
    found = 0
    for kind, selector in selectors.items():
        for obj in of_kind(records, kind):
            found += 1
            assert selector_matches(selector, obj["metadata"]["labels"]), f"{stack}: {kind} {obj}"
    # dcgm ServiceMonitor, trainer PodMonitor, Alluxio PodMonitor, rules, node-problem-detector's
    # PodMonitor, node-readiness-controller's ServiceMonitor.
    assert found == 6


@pytest.mark.parametrize("stack", STACKS)
def test_custom_resources_have_their_required_fields(layers, stack):
    records, _ = layers[stack]
    problems = [p for o in objects(records) if "/" in o["apiVersion"] and not o["apiVersion"].startswith(
        ("v1", "apps/", "rbac.", "networking.k8s.io/", "storage.k8s.io/", "admissionregistration.k8s.io/"))
        for p in cr_problems(o)]
    assert problems == []


@pytest.mark.parametrize("stack", STACKS)
def test_every_container_has_requests_and_limits(layers, stack):
    records, _ = layers[stack]
    assert [b for o in objects(records) for b in containers_without_resources(o)] == []


@pytest.mark.parametrize("stack", STACKS)
def test_queues_and_quotas_come_from_settings(layers, stack):
    records, fields = layers[stack]
    cfg = load_stack(stack)
    flavors = {o["metadata"]["name"]: o for o in of_kind(records, "ResourceFlavor")}
    assert set(flavors) == {naming.CPU_FLAVOR, *(p.name for p in cfg.gpu_pools)}
    for p in cfg.gpu_pools:
        assert flavors[p.name]["spec"]["nodeLabels"][naming.CAPACITY_LABEL] == p.capacity
    # The CPU flavor is the platform's system nodes, where data preparation runs.
    assert flavors[naming.CPU_FLAVOR]["spec"] == {"nodeLabels": dict(fields["platform"].system_node_selector)}
    queues = {o["metadata"]["name"]: o for o in of_kind(records, "ClusterQueue")}
    for team in cfg.teams:
        spec = queues[naming.team_namespace(team.name)]["spec"]
        gpus = sum(r["nominalQuota"] for f in spec["resourceGroups"][0]["flavors"] for r in f["resources"]
                   if r["name"] == "nvidia.com/gpu")
        assert gpus == sum(cfg.team_quota(team).values())
        cpu = next(f for f in spec["resourceGroups"][0]["flavors"] if f["name"] == naming.CPU_FLAVOR)
        assert cpu["resources"][0] == {"name": "cpu", "nominalQuota": team.prepare_quota.cpus,
                                       "borrowingLimit": sum(t.prepare_quota.cpus for t in cfg.teams) -
                                       team.prepare_quota.cpus, "lendingLimit": team.prepare_quota.cpus}
        lq = [o for o in of_kind(records, "LocalQueue") if o["metadata"]["namespace"] == naming.team_namespace(team.name)]
        assert [o["spec"]["clusterQueue"] for o in lq] == [naming.team_namespace(team.name)]
        assert fields["layer"].local_queue[team.name] == lq[0]["metadata"]["name"]
        quota = next(o for o in of_kind(records, "ResourceQuota")
                     if o["metadata"]["namespace"] == naming.team_namespace(team.name))
        assert int(quota["spec"]["hard"]["requests.nvidia.com/gpu"]) >= sum(cfg.team_quota(team).values())


@pytest.mark.parametrize("stack", STACKS)
def test_rbac_binds_the_teams_groups(layers, stack):
    records, _ = layers[stack]
    cfg = load_stack(stack)
    bindings = of_kind(records, "RoleBinding")
    for team in cfg.teams:
        ns = naming.team_namespace(team.name)
        for role, groups in (("job-submitter", team.submitters), ("viewer", team.viewers)):
            found = [b for b in bindings if b["metadata"]["namespace"] == ns and b["roleRef"]["name"] == role]
            assert sorted(s["name"] for b in found for s in b["subjects"]) == sorted(groups), (ns, role)


@pytest.mark.parametrize("stack", STACKS)
def test_trainer_cache_and_mlflow_service_accounts_carry_the_platform_identity(layers, stack):
    records, _ = layers[stack]
    cfg = load_stack(stack)
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in of_kind(records, "ServiceAccount")}
    expected = {(naming.team_namespace(t.name), naming.TRAINER_SERVICE_ACCOUNT) for t in cfg.teams}
    expected |= {(naming.CACHE_NAMESPACE, naming.CACHE_SERVICE_ACCOUNT),
                 (naming.MLFLOW_NAMESPACE, naming.MLFLOW_SERVICE_ACCOUNT)}
    identified = set(expected)
    # The GPU pre-flight check talks only to the API server (its own Node): no cloud identity.
    expected.add((common.GPU_NAMESPACE, health.PREFLIGHT_NAME))
    assert set(accounts) == expected
    assert not (accounts[(common.GPU_NAMESPACE, health.PREFLIGHT_NAME)]["metadata"].get("annotations") or {})
    for key in identified:
        ns, sa = key[0], accounts[key]
        ann = sa["metadata"].get("annotations") or {}
        if cfg.cloud == "gcp":
            assert ann.get("iam.gke.io/gcp-service-account", "").endswith(".iam.gserviceaccount.com"), ns
        else:
            assert all("arn:aws:iam::" in v for v in ann.values()), ns
    alluxio = releases(records)["alluxio"]["values"]
    assert alluxio["serviceAccount"] == naming.CACHE_SERVICE_ACCOUNT
    bucket_scheme = "s3://" if cfg.cloud == "aws" else "gs://"
    assert alluxio["properties"]["alluxio.master.mount.table.root.ufs"].startswith(bucket_scheme)


@pytest.mark.parametrize("stack", STACKS)
def test_page_store_uses_the_platform_nvme_path(layers, stack):
    records, _ = layers[stack]
    cfg = load_stack(stack)
    path = clouds.layer(cfg.cloud).NVME_HOST_PATH
    values = releases(records)["alluxio"]["values"]
    assert values["properties"]["alluxio.worker.page.store.dirs"] == cache.page_store_path(path)
    (level,) = values["tieredstore"]["levels"]  # the chart's hostPath mount of the page store
    assert (level["path"], level["quota"]) == (cache.page_store_path(path), f"{cfg.cache.page_store_gb}GB")
    daemonsets = {o["metadata"]["name"]: o for o in of_kind(records, "DaemonSet")}
    # One NVMe DaemonSet on every stack: RAID0 only where GKE leaves raw disks, team directories always.
    name = "nvme-raid0" if cfg.cloud == "gcp" else "nvme-workdirs"
    assert name in daemonsets and not ({"nvme-raid0", "nvme-workdirs"} - {name}) & set(daemonsets)
    init = {c["name"]: c for c in daemonsets[name]["spec"]["template"]["spec"]["initContainers"]}
    if cfg.cloud == "gcp":
        assert list(init) == ["raid0", "workdirs"]
        assert f" {path}" in init["raid0"]["command"][-1]
    else:
        assert list(init) == ["workdirs"]
    assert init["workdirs"]["command"][4:] == sorted(naming.team_namespace(t.name) for t in cfg.teams)
    assert daemonsets[name]["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] == path


@pytest.mark.parametrize("stack", STACKS)
def test_gpu_plugins_match_the_cloud_and_fabric(layers, stack):
    records, _ = layers[stack]
    cfg = load_stack(stack)
    rel = releases(records)
    daemonsets = {o["metadata"]["name"] for o in of_kind(records, "DaemonSet")}
    fabric = any(p.fabric for p in cfg.gpu_pools)
    for name, inputs in rel.items():
        assert inputs.get("version"), f"{stack}: Helm release {name} is not pinned"
        assert inputs.get("namespace"), name
    if cfg.cloud == "aws":
        assert rel["nvidia-device-plugin"]["version"] == gpu.DEVICE_PLUGIN_VERSION
        assert rel["nvidia-device-plugin"]["values"]["gfd"]["enabled"] is True
        assert ("aws-efa-k8s-device-plugin" in rel) == fabric
        # GPU plugins come from Helm; only the NVMe directories and the GPU pre-flight check are ours.
        assert daemonsets == {"nvme-workdirs", health.PREFLIGHT_NAME}
    else:
        # GKE node pools run Google's device plugin; NCCL installers only for fabric pools.
        assert "nvidia-device-plugin" not in rel and "aws-efa-k8s-device-plugin" not in rel
        assert ("nccl-tcpxo-installer" in daemonsets) == fabric
        assert bool(of_kind(records, "GKENetworkParamSet")) == fabric
        assert len(of_kind(records, "Network")) == len(of_kind(records, "GKENetworkParamSet"))
    assert rel["kueue"]["chart"] == tenancy.KUEUE_CHART and rel["jobset"]["chart"] == tenancy.JOBSET_CHART


@pytest.mark.parametrize("stack", STACKS)
def test_layer_outputs(layers, stack):
    _, fields = layers[stack]
    cfg = load_stack(stack)
    layer = fields["layer"]
    assert layer.cache_endpoint == cache.endpoint()
    assert layer.monitoring_release_label == {"release": naming.MONITORING_RELEASE}
    assert set(layer.team_namespaces) == {t.name for t in cfg.teams}
    # The encrypted StorageClass the layer makes holds MLflow's database when it runs in the cluster.
    assert layer.mlflow is not None and layer.serving is None
    assert [db["spec"]["storage"]["storageClass"] for db in of_kind(layers[stack][0], "Cluster")] == (
        ["encrypted-rwo"] if cfg.mlflow.database == "in-cluster" else [])
    assert layer.ready
    if cfg.monitoring.grafana_exposed:
        assert fields["grafana_url"].startswith("http://")
    else:
        assert fields["grafana_url"].startswith("kubectl -n monitoring port-forward")


def test_disabled_cache_leaves_no_alluxio_and_no_cache_egress():
    records, fields = build_layer("aws-dev", lambda cfg: cfg.model_copy(
        update={"cache": cfg.cache.model_copy(update={"enabled": False})}))
    assert fields["layer"].cache_endpoint == ""
    assert "alluxio" not in releases(records)
    assert not [o for o in of_kind(records, "NetworkPolicy") if o["metadata"]["name"] == "allow-cache"]


def test_missing_identity_is_an_error_naming_the_key(monkeypatch):
    from tests.infra.k8s import harness

    real = harness.fake_platform

    def without_cache_identity(cfg):
        platform = real(cfg)
        identities = {k: v for k, v in platform.identities.items() if k != "cache"}
        return dataclasses.replace(platform, identities=identities)

    monkeypatch.setattr(harness, "fake_platform", without_cache_identity)
    with pytest.raises(Exception, match="platform.identities has no 'cache' entry"):
        build_layer("gcp-dev")


@pytest.mark.parametrize("stack", ["aws-prod", "gcp-prod"])
def test_the_layer_installs_what_the_platform_describes_whatever_the_cloud(stack):
    """The Kubernetes layer never asks which cloud it is on: given the same platform (pools, node add-ons, NVMe
    root), a platform that names the other cloud builds exactly the same resources."""
    other = "gcp" if stack.startswith("aws") else "aws"

    def resources(records):
        return {r["urn"]: (r["type"], r["inputs"]) for r in records if r["type"] != "pulumi:pulumi:Stack"}

    same, _ = build_layer(stack)
    swapped, _ = build_layer(stack, edit_platform=lambda p: dataclasses.replace(p, cloud=other))
    assert resources(swapped) == resources(same)


@pytest.mark.parametrize(("stack", "device_plugin"), [("aws-dev", False), ("gcp-dev", True)])
def test_nvidias_device_plugin_is_installed_exactly_when_the_node_add_ons_ask(stack, device_plugin):
    """The cloud layer says whether its GPU nodes need NVIDIA's device plugin (GKE runs its own); the Kubernetes layer
    follows that alone."""
    records, _ = build_layer(stack, edit_platform=lambda p: dataclasses.replace(
        p, node_addons=dataclasses.replace(p.node_addons, device_plugin=device_plugin)))
    assert ("nvidia-device-plugin" in releases(records)) is device_plugin
