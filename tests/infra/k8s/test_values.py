"""Pure-function tests of the Kubernetes layer (no Pulumi mocks): Helm values, quotas, policies,
manifests, dashboards and the counters CSV.

Usage: .venv/bin/pytest tests/infra/k8s/test_values.py -q
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess

import pytest

from gpu_train.spec import naming
from gpu_train.spec.contract import Fabric, GpuPool
from gpu_train.spec.settings import CacheSettings, MonitoringSettings
from infra.aws import node_addons as aws_addons
from infra.gcp import node_addons as gcp_addons
from infra.k8s import cache, common, gpu, monitoring, nvme, storage, tenancy
from infra.platform import EgressTarget, StorageClassSpec
from tests.infra.k8s.checks import selector_matches

SYSTEM = {naming.SYSTEM_LABEL: "true"}


# Where GKE's driver installer keeps the NVIDIA libraries on the host
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus#cuda); raw local SSDs on GKE node pools
# (https://cloud.google.com/kubernetes-engine/docs/how-to/persistent-volumes/local-ssd-raw).
GKE_DRIVER_DIR = "/home/kubernetes/bin/nvidia"
GKE_SSD_GLOB = "/dev/disk/by-id/google-local-nvme-ssd-*"


def pool(name="h100", gpus=8, max_nodes=4, capacity="spot", kind="none"):
    return GpuPool(name=name, instance_type="p5.48xlarge", capacity=capacity, gpu_type="H100", gpus_per_node=gpus,
                   min_nodes=0, max_nodes=max_nodes, zone="", node_selector={naming.POOL_LABEL: name},
                   tolerations=naming.gpu_tolerations(), fabric=Fabric(kind=kind), provisioner="karpenter")


def walk(value, path=""):
    """Yield (path, key, value) for every mapping entry at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path, k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk(v, f"{path}[{i}]")


# ---------------------------------------------------------------- cache


def alluxio(nvme_path="/mnt/k8s-disks/0", bucket="s3://ds-bucket", **settings):
    return cache.alluxio_values(settings=CacheSettings(**settings), nvme_host_path=nvme_path, datasets_bucket=bucket,
                                region="us-east-1", storage_class="enc", gpu_pools=[pool()], system_selector=SYSTEM)


@pytest.mark.parametrize("nvme_path", ["/mnt/k8s-disks/0", "/mnt/stateful_partition/kube-ephemeral-ssd/nvme/"])
def test_page_store_lives_on_the_nvme_path_with_the_configured_quota(nvme_path):
    values = alluxio(nvme_path=nvme_path, page_store_gb=1234)
    expected = nvme_path.rstrip("/") + "/alluxio"
    assert values["properties"]["alluxio.worker.page.store.dirs"] == expected
    # The chart mounts host storage only through a tiered-store level of type hostPath.
    (level,) = values["tieredstore"]["levels"]
    assert (level["type"], level["path"], level["quota"]) == ("hostPath", expected, "1234GB")
    assert values["properties"]["alluxio.worker.page.store.sizes"] == "1234GB"
    assert values["properties"]["alluxio.worker.block.store.type"] == "PAGE"
    # The worker runs as the user the NVMe DaemonSet creates the directory for.
    assert values["user"] == values["group"] == values["fsGroup"] == cache.ALLUXIO_UID
    assert (cache.PAGE_STORE_DIR, cache.ALLUXIO_UID, cache.ALLUXIO_UID) in nvme.SERVICE_DIRS


def test_cache_jvm_options_are_lists_as_the_chart_concatenates_them():
    values = alluxio()
    for component in ("master", "worker"):
        opts = values[component]["jvmOptions"]
        assert isinstance(opts, list) and all(isinstance(o, str) and " " not in o for o in opts)
        assert any(o.startswith("-Xmx") for o in opts)


def test_cache_reads_the_datasets_bucket_through_workload_identity_only():
    values = alluxio(bucket="gs://acme-datasets")
    assert values["properties"]["alluxio.master.mount.table.root.ufs"] == "gs://acme-datasets/"
    assert values["serviceAccount"] == naming.CACHE_SERVICE_ACCOUNT
    secretish = [f"{p}.{k}" for p, k, _ in walk(values)
                 if re.search(r"(access.?key|secret|credential|password)", str(k), re.IGNORECASE)]
    assert secretish == [], f"static credentials in the Alluxio values: {secretish}"


def test_cache_workers_run_on_gpu_nodes_and_masters_on_system_nodes_with_encrypted_journal():
    values = alluxio(masters=3, journal_gb=42)
    # The chart places workers by nodeSelector only: the labels the pool's nodes carry.
    assert values["worker"]["nodeSelector"] == {naming.GPU_NODE_LABEL: "true"}
    assert values["worker"]["nodeSelector"].items() <= naming.pool_node_labels("h100", "spot", "none", "H100").items()
    assert naming.SYSTEM_LABEL not in values["worker"]["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in values["worker"]["tolerations"]
    assert values["master"]["nodeSelector"] == SYSTEM and values["master"]["count"] == 3
    assert values["journal"] == {"type": "EMBEDDED", "folder": "/journal", "volumeType": "persistentVolumeClaim",
                                 "storageClass": "enc", "size": "42Gi", "accessModes": ["ReadWriteOnce"]}
    for component in ("master", "jobMaster", "worker", "jobWorker", "proxy"):
        res = values[component]["resources"]
        assert res["requests"] and res["limits"], component


def test_cache_workers_select_every_gpu_node_and_only_gpu_nodes():
    """Pools that share no other label (capacity, fabric, GPU type) all get workers; system nodes none."""
    mixed = [pool("a", capacity="spot"), pool("b").model_copy(update={"capacity": "on-demand", "gpu_type": "L4",
                                                                      "fabric": Fabric(kind="efa")})]
    selector = cache.worker_node_selector(mixed)
    for p in mixed:
        node = naming.pool_node_labels(p.name, p.capacity, p.fabric.kind, p.gpu_type)
        assert selector.items() <= node.items()
    assert not selector.items() <= {naming.SYSTEM_LABEL: "true"}.items()
    with pytest.raises(ValueError, match="at least one GPU pool"):
        cache.worker_node_selector([])


def test_cache_rejects_bad_settings_with_the_key():
    with pytest.raises(ValueError, match="cache.masters"):
        alluxio(masters=2)
    with pytest.raises(ValueError, match="platform.buckets.datasets"):
        alluxio(bucket="https://not-a-bucket")


def test_cache_endpoint_is_the_proxy_service_s3_path():
    assert cache.endpoint() == (f"http://{naming.CACHE_PROXY_SERVICE}.{naming.CACHE_NAMESPACE}.svc.cluster.local:"
                                f"{naming.CACHE_PROXY_PORT}/api/v1/s3")


# ---------------------------------------------------------------- monitoring


def test_monitors_and_rules_carry_the_labels_prometheus_selects():
    values = monitoring.prometheus_stack_values(settings=MonitoringSettings(), storage_class="enc",
                                                system_selector=SYSTEM, internal_lb_annotations={}, is_prod=False)
    spec = values["prometheus"]["prometheusSpec"]
    for key in ("serviceMonitorSelector", "podMonitorSelector", "ruleSelector"):
        assert selector_matches(spec[key], monitoring.release_labels()), key
        assert not selector_matches(spec[key], {"app": "x"}), key
        # With the NilUsesHelmValues flags left true, the chart would default to the release label
        # anyway; the explicit selector must agree with it.
        assert spec[key]["matchLabels"]["release"] == naming.MONITORING_RELEASE
    for key in ("serviceMonitorNamespaceSelector", "podMonitorNamespaceSelector", "ruleNamespaceSelector"):
        assert spec[key] == {}, f"{key}: monitors in the alluxio and team namespaces must be found"


def test_selector_semantics():
    sel = {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"},
                                                          {"key": "c", "operator": "NotIn", "values": ["x"]}]}
    assert selector_matches(sel, {"a": "1", "b": "", "c": "y"})
    assert not selector_matches(sel, {"a": "1", "c": "y"})
    assert not selector_matches(sel, {"a": "1", "b": "", "c": "x"})


def test_prometheus_retention_storage_and_placement_come_from_settings():
    s = MonitoringSettings(retention="30d", storage_gb=200, grafana_storage_gb=7)
    values = monitoring.prometheus_stack_values(settings=s, storage_class="enc", system_selector=SYSTEM,
                                                internal_lb_annotations={}, is_prod=True)
    spec = values["prometheus"]["prometheusSpec"]
    assert spec["retention"] == "30d"
    claim = spec["storageSpec"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "enc" and claim["resources"]["requests"]["storage"] == "200Gi"
    assert spec["nodeSelector"] == SYSTEM and spec["replicas"] == 2
    grafana = values["grafana"]
    assert grafana["persistence"]["size"] == "7Gi" and grafana["persistence"]["storageClassName"] == "enc"
    assert grafana["sidecar"]["dashboards"]["label"] == "grafana_dashboard"
    assert grafana["sidecar"]["dashboards"]["labelValue"] == monitoring.DASHBOARD_LABEL["grafana_dashboard"]


def test_grafana_exposure():
    hidden = monitoring.prometheus_stack_values(settings=MonitoringSettings(), storage_class="enc",
                                                system_selector=SYSTEM, internal_lb_annotations={"a": "b"},
                                                is_prod=False)
    assert hidden["grafana"]["service"]["type"] == "ClusterIP"
    assert monitoring.grafana_url(MonitoringSettings()).startswith(
        f"kubectl -n {naming.MONITORING_NAMESPACE} port-forward svc/{monitoring.GRAFANA_SERVICE}")
    exposed_cfg = MonitoringSettings(grafana_exposed=True)
    lb = {"networking.gke.io/load-balancer-type": "Internal"}
    exposed = monitoring.prometheus_stack_values(settings=exposed_cfg, storage_class="enc", system_selector=SYSTEM,
                                                 internal_lb_annotations=lb, is_prod=False)
    assert exposed["grafana"]["service"] == {"type": "LoadBalancer", "port": 80, "annotations": lb}
    assert monitoring.grafana_url(exposed_cfg) is None
    with pytest.raises(ValueError, match="internal_lb_annotations"):
        monitoring.prometheus_stack_values(settings=exposed_cfg, storage_class="enc", system_selector=SYSTEM,
                                           internal_lb_annotations={}, is_prod=False)


REQUIRED_COUNTERS = {"DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                     "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                     "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_GPU_UTIL",
                     "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP"}


def test_counters_csv_has_the_profiling_ecc_remap_and_xid_fields():
    fields = [r[0] for r in monitoring.read_counters_csv()]
    assert set(fields) >= REQUIRED_COUNTERS, REQUIRED_COUNTERS - set(fields)
    assert len(fields) == len(set(fields))


def test_counters_csv_rejects_a_malformed_row(tmp_path):
    bad = tmp_path / "c.csv"
    bad.write_text("DCGM_FI_DEV_GPU_UTIL, gauge, ok\nDCGM_FI_DEV_GPU_TEMP; gauge\n")
    with pytest.raises(ValueError, match=r"c\.csv:2"):
        monitoring.read_counters_csv(bad)


def test_dcgm_values_mount_the_counters_and_stay_on_gpu_nodes():
    values = monitoring.dcgm_values([pool()])
    mount = next(m for m in values["extraVolumeMounts"] if m["name"] == monitoring.COUNTERS_CONFIGMAP)
    assert values["arguments"] == ["-f", f"{mount['mountPath']}/dcgm-counters.csv"]
    assert values["extraConfigMapVolumes"][0]["configMap"]["name"] == monitoring.COUNTERS_CONFIGMAP
    assert values["serviceMonitor"]["enabled"] is False
    assert values["affinity"] == common.pool_affinity([pool()])
    assert "extraHostVolumes" not in values
    # Where the cloud layer says the driver lives on the host (GKE), the exporter reads it from there.
    assert gcp_addons.DRIVER_HOST_PATH == GKE_DRIVER_DIR
    gke = monitoring.dcgm_values([pool()], gcp_addons.DRIVER_HOST_PATH)
    assert gke["extraHostVolumes"][0]["hostPath"] == GKE_DRIVER_DIR
    assert {"name": "nvidia-install-dir-host", "mountPath": "/usr/local/nvidia", "readOnly": True} in \
        gke["extraVolumeMounts"]


TRAINER_METRICS = ["trainer_loss", "trainer_tokens_per_second", "trainer_mfu", "trainer_step_seconds",
                   "trainer_data_wait_seconds", "trainer_forward_backward_seconds", "trainer_optimizer_seconds",
                   "trainer_checkpoint_duration_seconds", "trainer_checkpoint_last_success_timestamp_seconds",
                   "trainer_restarts_total", "trainer_checkpoint_blocking_seconds"]


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_dashboards_are_templated_and_use_only_known_metrics():
    boards = {name: json.loads(text) for name, text in monitoring.load_dashboards().items()}
    gpu_board, train_board = boards["gpu.json"], boards["training.json"]
    assert {v["name"] for v in gpu_board["templating"]["list"]} >= {"Hostname", "gpu"}
    gpu_text = " ".join(_exprs(gpu_board))
    for needed in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                   "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS"):
        assert needed in gpu_text, needed
    exported = {r[0] for r in monitoring.read_counters_csv()}
    used = set(re.findall(r"DCGM_FI_[A-Z_]+", gpu_text))
    assert used <= exported, f"dashboard uses counters the exporter does not export: {used - exported}"
    train_text = " ".join(_exprs(train_board))
    for metric in TRAINER_METRICS:
        assert metric in train_text, metric
    for expr in _exprs(gpu_board) + _exprs(train_board):
        assert expr.count("(") == expr.count(")"), expr


def test_dashboard_loader_rejects_broken_json(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"x\.json"):
        monitoring.load_dashboards(tmp_path)


def test_trainer_pod_monitor_covers_every_local_rank_port():
    spec = monitoring.trainer_pod_monitor_spec(["team-b", "team-a"], 8)
    assert [e["port"] for e in spec["podMetricsEndpoints"]] == [f"metrics-{r}" for r in range(8)]
    assert spec["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert spec["podMetricsEndpoints"][0]["relabelings"][0]["targetLabel"] == "jobset"


# ---------------------------------------------------------------- scheduling and tenancy


# Kueue's queue objects: tests/gpu_train/jobs/test_queues.py; its configuration and the namespace quota:
# tests/infra/k8s/test_tenancy.py.


def test_team_namespaces_start_from_default_deny_and_open_only_what_jobs_need():
    class Stub:  # the three platform fields the policies read
        object_store_cidrs = ["52.216.0.0/15"]
        api_server_cidrs = ["10.0.0.0/16"]
        gpu_pools = [pool(gpus=8)]
        workload_identity_egress = [EgressTarget("169.254.170.23/32", 80)]

    policies = dict(tenancy.team_network_policies(Stub, cache_enabled=True))
    first = tenancy.team_network_policies(Stub, cache_enabled=True)[0]
    assert first == ("default-deny-all", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})
    assert set(policies) == {"default-deny-all", "allow-dns", "allow-object-store", "allow-jobset-peers",
                             "allow-mlflow", "allow-metrics-scrape", "allow-cache", "allow-ray-peers",
                             "allow-ray-dashboard-from-operator"}
    scrape = policies["allow-metrics-scrape"]["ingress"][0]["ports"][0]
    assert (scrape["port"], scrape["endPort"]) == (naming.METRICS_PORT, naming.METRICS_PORT + 7)
    assert policies["allow-mlflow"]["egress"][0]["ports"] == [{"protocol": "TCP", "port": naming.MLFLOW_PORT}]
    identity = policies["allow-object-store"]["egress"][1]
    assert identity == {"to": [{"ipBlock": {"cidr": "169.254.170.23/32"}}], "ports": [{"protocol": "TCP", "port": 80}]}
    assert policies["allow-cache"]["egress"][0]["ports"] == [{"protocol": "TCP", "port": naming.CACHE_PROXY_PORT}]
    assert "allow-cache" not in dict(tenancy.team_network_policies(Stub, cache_enabled=False))
    with pytest.raises(ValueError, match="default-deny"):
        common.network_policies("x", [common.allow_dns()], None, None)


def test_roles():
    submit = {(g, r): set(rule["verbs"]) for rule in tenancy.submitter_rules()
              for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "get", "list", "watch", "delete"} <= submit[("jobset.x-k8s.io", "jobsets")]
    assert {"create", "delete"} <= submit[("batch", "jobs")]
    assert submit[("", "pods/log")] == {"get", "list", "watch"}
    for rule in tenancy.viewer_rules():
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule


# ---------------------------------------------------------------- GPU stack, NVMe, storage


def test_device_plugin_only_on_gpu_pools_with_gfd():
    values = gpu.device_plugin_values([pool("a"), pool("b")], SYSTEM)
    assert values["gfd"]["enabled"] is True and values["devicePlugin"]["enabled"] is True
    expr = values["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"]
    assert expr == [{"key": naming.POOL_LABEL, "operator": "In", "values": ["a", "b"]}]
    assert values["nfd"]["master"]["nodeSelector"] == SYSTEM
    # Whether a cloud needs it is the cloud layer's word (node_addons.device_plugin): tests/infra/k8s/test_layer.py.


def test_efa_plugin_selects_efa_nodes():
    values = gpu.fabric_plugin_values(aws_addons.EFA_PLUGIN, [pool(kind="efa")])
    assert values["nodeSelector"] == {naming.FABRIC_LABEL: "efa"}
    assert values["tolerations"] == common.gpu_tolerations([pool(kind="efa")])
    assert values["resources"]["limits"]


def test_nccl_installer_per_fabric_kind():
    # Google's installers, one per GPUDirect flavour, as the GCP layer describes them.
    assert {k: i.fabric for k, i in gcp_addons.NCCL_INSTALLERS.items()} == {"tcpx": "tcpx", "tcpxo": "tcpxo",
                                                                            "rdma": "rdma"}
    ds = gpu.host_installer(gcp_addons.NCCL_INSTALLERS["tcpxo"], [pool(kind="tcpxo")], "gpu-system")
    spec = ds["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": naming.FABRIC_LABEL, "operator": "In", "values": ["tcpxo"]} in \
        terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert spec["initContainers"][0]["image"].endswith(":v1.0.3")
    assert ds["metadata"]["annotations"], "documented checkov skips must travel with the object"
    # TCPX's needs the plugin directory remounted executable on the host; the others copy files only.
    tcpx = gpu.host_installer(gcp_addons.NCCL_INSTALLERS["tcpx"], [pool(kind="tcpx")], "gpu-system")
    assert [c["name"] for c in tcpx["spec"]["template"]["spec"]["initContainers"]] == ["install", "host-mount"]
    assert [c["name"] for c in spec["initContainers"]] == ["install"]


def test_nvme_daemonset_mounts_at_the_contract_path():
    ds = nvme.nvme_daemonset("/mnt/nvme", [pool()], "gpu-system", device_glob=GKE_SSD_GLOB,
                             team_namespaces=["team-a"])
    assert ds["metadata"]["name"] == "nvme-raid0"
    spec = ds["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["raid0", "workdirs"]  # mount first, then dirs
    script = spec["initContainers"][0]["command"][-1]
    assert "mount -o noatime,discard /dev/md/gpu-train-nvme /mnt/nvme" in script
    assert "mdadm --create" in script and "--level=0" in script
    assert GKE_SSD_GLOB in script  # the devices the cloud layer says are raw
    assert gcp_addons.NVME_DEVICE_GLOB == GKE_SSD_GLOB
    assert spec["hostPID"] is True
    with pytest.raises(ValueError, match="nvme_host_path"):
        nvme.raid_script("relative/path", GKE_SSD_GLOB)


def _workdirs(ds):
    (c,) = [c for c in ds["spec"]["template"]["spec"]["initContainers"] if c["name"] == "workdirs"]
    return c


@pytest.mark.parametrize("raid", [True, False])
def test_nvme_workdirs_step_is_root_with_chown_only_and_never_privileged(raid):
    glob = GKE_SSD_GLOB if raid else ""  # raw devices to assemble, or a disk the node's bootstrap mounted
    ds = nvme.nvme_daemonset("/mnt/k8s-disks/0/", [pool()], "gpu-system", device_glob=glob,
                             team_namespaces=["team-b", "team-a"])
    spec = ds["spec"]["template"]["spec"]
    c = _workdirs(ds)
    sc = c["securityContext"]
    assert sc["runAsUser"] == 0 and sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    # The namespaces are arguments of the script ($@), sorted, after $0.
    assert c["command"][:2] == ["sh", "-c"] and c["command"][4:] == ["team-a", "team-b"]
    (vol,) = spec["volumes"]
    assert c["volumeMounts"] == [{"name": vol["name"], "mountPath": nvme.NVME_MOUNT}]
    # Bootstrap (EKS nodeadm) mounted the disk already; raw devices (GKE): raid0 mounts it over a directory the
    # kubelet may create.
    assert vol["hostPath"] == {"path": "/mnt/k8s-disks/0/", "type": "DirectoryOrCreate" if raid else "Directory"}
    if not raid:
        assert ds["metadata"]["name"] == "nvme-workdirs" and [i["name"] for i in spec["initContainers"]] == [
            "workdirs"]
        assert "hostPID" not in spec and all(not i["securityContext"].get("privileged")
                                             for i in spec["initContainers"])
    assert ds["metadata"]["annotations"], "documented checkov skips must travel with the object"
    with pytest.raises(ValueError, match="team namespaces"):
        nvme.nvme_daemonset("/mnt/nvme", [pool()], "gpu-system", device_glob=glob, team_namespaces=[])
    with pytest.raises(ValueError, match="not Kubernetes namespace names"):
        nvme.nvme_daemonset("/mnt/nvme", [pool()], "gpu-system", device_glob=glob, team_namespaces=["a; rm -rf /"])


def test_nvme_workdirs_script_makes_owned_0700_directories_and_is_idempotent(tmp_path):
    """Run the real script against a temporary root, as the current user (chown to ourselves needs no
    capability), twice: the second run changes nothing and fails on nothing. A directory left with
    the wrong mode (as an old pod-created hostPath would be) is corrected."""
    uid, gid = os.getuid(), os.getgid()
    script = nvme.workdirs_script(uid=uid, gid=gid, root=str(tmp_path), service_dirs=[("alluxio", uid, gid)])
    (tmp_path / "alluxio").mkdir(mode=0o755)  # as the kubelet creates a hostPath it mounts first
    (tmp_path / "gpu-train" / "team-a").mkdir(parents=True, mode=0o777)
    (tmp_path / "gpu-train" / "team-a").chmod(0o777)
    for _ in range(2):
        proc = subprocess.run(["sh", "-c", script, "nvme-workdirs", "team-a", "team-b"], capture_output=True,
                              text=True, timeout=30, check=False)
        assert proc.returncode == 0, proc.stderr
        for ns in ("team-a", "team-b"):
            st = (tmp_path / "gpu-train" / ns).stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o700)
        assert stat.S_IMODE((tmp_path / "gpu-train").stat().st_mode) == 0o755
        st = (tmp_path / "alluxio").stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o700)
    with pytest.raises(ValueError, match="one plain path segment"):
        nvme.workdirs_script(service_dirs=[("../etc", 0, 0)])
    assert naming.workdir_path("/mnt/k8s-disks/0/", "team-a") == "/mnt/k8s-disks/0/gpu-train/team-a"


def test_storage_class_must_be_encrypted():
    enc = StorageClassSpec(name="enc", provisioner="ebs.csi.aws.com", parameters={"kmsKeyId": "k", "encrypted": "true"})
    fields = storage.storage_class_fields(enc, retain=True)
    assert fields["reclaim_policy"] == "Retain" and fields["parameters"]["kmsKeyId"] == "k"
    with pytest.raises(ValueError, match="no encryption parameter"):
        storage.storage_class_fields(StorageClassSpec(name="plain", provisioner="x", parameters={"type": "gp3"}), False)


def test_checkov_skips_file_is_documented(tmp_path):
    skips = common.checkov_skips()
    assert set(skips) == {"nvme-raid0", "nvme-workdirs", "nccl-tcpx-installer", "nccl-tcpxo-installer",
                          "nccl-rdma-installer", "mlflow", "gpu-preflight"}
    # The unprivileged NVMe variant carries no privileged-container skips.
    assert not {"CKV_K8S_16", "CKV_K8S_17", "CKV_K8S_20"} & set(skips["nvme-workdirs"])
    ann = common.checkov_skip_annotations("nvme-raid0")
    assert len(ann) == len(skips["nvme-raid0"]) and all(v.startswith("CKV_K8S_") for v in ann.values())
    bad = tmp_path / "bad-skips.yaml"
    bad.write_text("x:\n  CKV_K8S_16: ok\n")
    with pytest.raises(ValueError, match="needs a CKV_K8S_ id and a reason"):
        common.checkov_skips(bad)


@pytest.mark.parametrize("kind", sorted(gcp_addons.NCCL_INSTALLERS))
def test_nccl_installers_mount_every_host_directory_their_script_writes(kind):
    ds = gpu.host_installer(gcp_addons.NCCL_INSTALLERS[kind], [pool(kind=kind)], "gpu-system")
    spec = ds["spec"]["template"]["spec"]
    install = spec["initContainers"][0]
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in install["volumeMounts"]}
    assert set(volumes) == set(mounts)
    for target in re.findall(r"cp -r \S+ (\S+)", install["args"][0]):
        assert any(target.startswith(path) for path in mounts.values()), f"{kind}: {target} is not on the host"
