"""MLflow server component: `.venv/bin/pytest tests/infra/k8s/test_mlflow.py -q`.

Pure manifest builders are checked directly (and against MLflow's own CLI and Host-header check); the component
runs under Pulumi mocks with a fresh event loop and fresh mocks per test. Every Kubernetes object is validated
against the API schema of the cluster version the stacks default to.
"""

from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import unquote, urlsplit

import kubernetes_validate
import pulumi
import pulumi_kubernetes as k8s
import pytest
from mlflow.cli import server as mlflow_server_command
from mlflow.server.security_utils import is_allowed_host_header
from pulumi.runtime import mocks as runtime_mocks
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from gpu_train.spec import naming
from gpu_train.spec.settings import ClusterSettings, MlflowSettings
from infra.k8s import mlflow as m
from infra.platform import (
    Buckets,
    ClusterPlatform,
    EgressTarget,
    ManagedDatabase,
    StorageClassSpec,
    WorkloadIdentity,
)

K8S_VERSION = ClusterSettings().kubernetes_version
COMMON = {"project": "gpu-train", "stack": "test", "environment": "dev", "managed-by": "pulumi"}
IRSA = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/gpu-train-test-mlflow"}
OBJECT_STORE = ("52.216.0.0/15", "3.5.0.0/19")
API_SERVER = ("10.0.16.0/20",)
CLUSTER_CIDRS = ("10.0.0.0/16", "100.64.0.0/16")
_SIG_KEY = "4dabf18193072939515e22adb298388d"


def _validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _identity(name: str = "mlflow", namespaces: tuple[str, ...] = ("mlflow",)) -> WorkloadIdentity:
    return WorkloadIdentity(namespaces=namespaces, name=name, annotations=IRSA)


# ------------------------------------------------------------------------------------------ pure functions
def test_database_uri_round_trips_passwords_with_url_syntax():
    password = "p@ss:w/rd?#%&="
    uri = m.database_uri(user="mlflow", password=password, host="db.internal", port=5432, database="mlflow",
                         sslmode="require")
    parts = urlsplit(uri)
    assert parts.scheme == "postgresql" and parts.hostname == "db.internal" and parts.port == 5432
    assert unquote(parts.password) == password and parts.username == "mlflow"
    assert parts.path == "/mlflow" and parts.query == "sslmode=require"


def test_generated_passwords_are_long_url_safe_and_distinct():
    a, b = m.generate_password(), m.generate_password()
    assert a != b and len(a) >= 40
    assert set(a) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_artifacts_destination_accepts_only_bucket_uris():
    assert m.artifacts_destination("s3://gpu-train-aws-dev-artifacts", "mlflow") == \
        "s3://gpu-train-aws-dev-artifacts/mlflow"
    assert m.artifacts_destination("gs://b/", "") == "gs://b"
    with pytest.raises(ValueError, match="platform.buckets.artifacts"):
        m.artifacts_destination("https://example.com/bucket", "mlflow")


def test_allowed_hosts_admit_cluster_clients_and_port_forward_only():
    hosts = m.allowed_hosts(CLUSTER_CIDRS)
    # MLflow's own Host-header check, as the server runs it.
    assert is_allowed_host_header(hosts, urlsplit(m.TRACKING_URI).netloc)
    assert is_allowed_host_header(hosts, "mlflow.mlflow:5000")
    assert is_allowed_host_header(hosts, "localhost:5000")  # kubectl port-forward
    assert is_allowed_host_header(hosts, "10.0.3.7:5000")  # Prometheus scraping a pod IP
    assert not is_allowed_host_header(hosts, "evil.example.com")
    assert not is_allowed_host_header(hosts, "192.168.1.1:5000")
    # Each pattern only admits addresses inside the CIDR's leading octets.
    for pattern in m.host_patterns(CLUSTER_CIDRS):
        prefix = pattern.rstrip("*").rstrip(".")
        assert any(ipaddress.ip_network(c).network_address.exploded.startswith(prefix) for c in CLUSTER_CIDRS)


def test_server_args_parse_with_the_real_mlflow_cli():
    args = m.server_args("s3://bucket/mlflow", m.allowed_hosts(CLUSTER_CIDRS))
    assert args[:2] == ["mlflow", "server"]
    ctx = mlflow_server_command.make_context("server", list(args[2:]))
    assert ctx.params["artifacts_destination"] == "s3://bucket/mlflow"
    assert ctx.params["serve_artifacts"] is True
    assert ctx.params["port"] == naming.MLFLOW_PORT and ctx.params["host"] == "0.0.0.0"
    assert "mlflow.mlflow.svc.cluster.local:5000" in ctx.params["allowed_hosts"].split(",")


def test_deployment_is_hardened_and_pinned():
    dep = m.deployment_manifest(common=COMMON, image=m.MLFLOW_IMAGE, replicas=1,
                                args=m.server_args("gs://b/mlflow", ["mlflow"]),
                                node_selector={naming.SYSTEM_LABEL: "true"}, tmp_size_gb=20)
    _validate(dep)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["image"].rsplit(":", 1)[1] == "v3.17.2-full"  # exact version, never latest
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys()
    # The database URL only ever comes from a Secret.
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == m.DB_URI_SECRET
    assert not any("postgresql://" in str(a) for a in container["args"])
    # Every path the server writes is a mounted volume.
    assert env["HOME"]["value"] == env["TMPDIR"]["value"] == container["volumeMounts"][0]["mountPath"]


def test_service_is_cluster_ip_only():
    svc = m.service_manifest(COMMON)
    _validate(svc)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"][0]["port"] == naming.MLFLOW_PORT
    assert urlsplit(m.TRACKING_URI).hostname == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}" \
        ".svc.cluster.local"


def _egress_ports(policy: dict) -> dict[int, list]:
    out: dict[int, list] = {}
    for rule in policy["spec"].get("egress", []):
        for port in rule["ports"]:
            out.setdefault(port["port"], []).extend(rule["to"])
    return out


def _manifests(policies) -> list[dict]:
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {"name": name, "namespace": m.NAMESPACE}, "spec": spec} for name, spec in policies]


def test_network_policies_in_cluster_database():
    policies = _manifests(m.mlflow_network_policies(database="in-cluster", object_store_cidrs=OBJECT_STORE,
                                                    api_server_cidrs=API_SERVER))
    for p in policies:
        _validate(p)
    by_name = {p["metadata"]["name"]: p for p in policies}
    deny = by_name["default-deny-all"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny

    server = by_name["mlflow-server"]["spec"]
    (ingress,) = server["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [naming.MLFLOW_PORT]
    team_peer, monitoring_peer = ingress["from"]
    assert team_peer["namespaceSelector"]["matchExpressions"][0]["key"] == naming.TEAM_LABEL
    assert monitoring_peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": naming.MONITORING_NAMESPACE}
    egress = _egress_ports(by_name["mlflow-server"])
    assert {peer["ipBlock"]["cidr"] for peer in egress[443]} == set(OBJECT_STORE)
    assert egress[5432] == [{"podSelector": {"matchLabels": {"cnpg.io/cluster": m.DB_CLUSTER}}}]
    assert 53 in egress and set(egress) == {53, 5432, 443}

    db = by_name["mlflow-db"]["spec"]
    assert db["podSelector"]["matchLabels"]["cnpg.io/cluster"] == m.DB_CLUSTER
    db_from_server = db["ingress"][0]
    assert db_from_server["from"] == [{"podSelector": {"matchLabels": m.selector()}}]
    assert {peer["ipBlock"]["cidr"] for peer in _egress_ports(by_name["mlflow-db"])[443]} == set(API_SERVER)


def test_network_policies_managed_database_and_identity_endpoint():
    policies = _manifests(m.mlflow_network_policies(
        database="managed", db_cidrs=("10.0.48.0/24",), db_port=5433, object_store_cidrs=OBJECT_STORE,
        api_server_cidrs=API_SERVER, identity_egress=(EgressTarget("169.254.170.23/32", 80),)))
    for p in policies:
        _validate(p)
    assert {p["metadata"]["name"] for p in policies} == {"default-deny-all", "mlflow-server"}
    egress = _egress_ports(next(p for p in policies if p["metadata"]["name"] == "mlflow-server"))
    assert egress[5433] == [{"ipBlock": {"cidr": "10.0.48.0/24"}}]
    assert egress[80] == [{"ipBlock": {"cidr": "169.254.170.23/32"}}]


def test_postgres_cluster_uses_encrypted_class_and_generated_secret():
    cluster = m.postgres_cluster_manifest(common=COMMON, storage_class="gpu-train-encrypted", storage_gb=30,
                                          instances=2, node_selector={naming.SYSTEM_LABEL: "true"})
    # A CRD: kubernetes_validate has no schema for it, so check the fields CNPG requires and we rely on.
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1" and cluster["kind"] == "Cluster"
    spec = cluster["spec"]
    assert spec["instances"] == 2
    assert spec["storage"] == {"size": "30Gi", "storageClass": "gpu-train-encrypted"}
    assert spec["bootstrap"]["initdb"]["secret"]["name"] == m.DB_SECRET
    assert spec["bootstrap"]["initdb"]["owner"] == spec["managed"]["roles"][0]["name"] == m.DB_USER
    assert spec["enableSuperuserAccess"] is False
    # MLflow connects to the read-write service CNPG creates for this cluster.
    assert m.in_cluster_db_host().startswith(f"{cluster['metadata']['name']}-rw.")


def test_namespace_service_account_and_secrets_validate():
    ns = m.namespace_manifest(COMMON)
    sa = m.service_account_manifest(COMMON, IRSA)
    auth = m.secret_manifest(COMMON, m.DB_SECRET, "kubernetes.io/basic-auth",
                             {"username": "mlflow", "password": "x"}, "database")
    for obj in (ns, sa, auth):
        _validate(obj)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert sa["metadata"]["annotations"] == IRSA and sa["metadata"]["name"] == naming.MLFLOW_SERVICE_ACCOUNT


def _platform(*, provider=None, identity: WorkloadIdentity | None = None,
              database_endpoint: ManagedDatabase | None = None, identity_egress=(),
              object_store_cidrs=OBJECT_STORE) -> ClusterPlatform:
    """The platform fields MLflow reads; the rest are placeholders the component never touches."""
    return ClusterPlatform(
        cloud="aws", region="us-east-1", cluster_name="c", kubernetes_version=K8S_VERSION, provider=provider,
        kubeconfig="", gpu_pools=[], system_node_selector={naming.SYSTEM_LABEL: "true"}, nvme_host_path="/nvme",
        buckets=Buckets(datasets="s3://d", checkpoints="s3://c", artifacts="s3://bucket"), object_store_endpoint="",
        object_store_cidrs=object_store_cidrs, api_server_cidrs=API_SERVER, pod_cidr=CLUSTER_CIDRS[0],
        vpc_cidr=CLUSTER_CIDRS[1], storage_class=StorageClassSpec(name="enc", provisioner="ebs.csi.aws.com", parameters={}),
        identities={"mlflow": identity or _identity()}, registry=None, internal_lb_annotations={},
        workload_identity_egress=identity_egress, mlflow_database=database_endpoint)


def _args(*, database: str = "in-cluster", **kw) -> m.MlflowServerArgs:
    return m.MlflowServerArgs(platform=_platform(**kw), settings=MlflowSettings(database=database),
                              storage_class="enc", labels=COMMON)


def test_validate_names_each_bad_setting():
    with pytest.raises(ValueError, match=r"mlflow\.database is 'managed' but .*mlflow_database"):
        m.validate(_args(database="managed"))
    with pytest.raises(ValueError, match=r"identities\['mlflow'\] must bind service account 'mlflow'"):
        m.validate(_args(identity=_identity(name="trainer")))
    with pytest.raises(ValueError, match="'10.0.0.0/33' is not a valid network"):
        m.validate(_args(object_store_cidrs=("10.0.0.0/33",)))
    m.validate(_args())


# ------------------------------------------------------------------------------------------ under mocks
class _Mocks(pulumi.runtime.Mocks):
    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        return f"{args.name}-id", dict(args.inputs)

    def call(self, args: pulumi.runtime.MockCallArgs):
        raise AssertionError(f"unexpected invoke {args.token}")


@pytest.fixture
def mocked():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    mocks = _Mocks()
    monitor = runtime_mocks.MockMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="test", preview=False, monitor=monitor)
    yield monitor
    loop.close()
    asyncio.set_event_loop(None)


def _deploy(monitor, **kw) -> tuple[dict, list[dict]]:
    """Run the component under mocks; return its outputs and every registered resource (type, name, state)."""
    result = {}

    def program():
        provider = k8s.Provider("k8s", kubeconfig="{}")
        server = m.MlflowServer("mlflow", _args(provider=provider, **kw))
        result["server"] = server

    _sync_await(run_pulumi_func(program))
    server = result["server"]
    outputs = {"tracking_uri": _sync_await(server.tracking_uri.future()),
               "destination": _sync_await(server.artifacts_destination.future())}
    resources = []
    for urn, (_, _, state) in monitor.get_registered_resources().items():
        typ = urn.split("::")[-2].split("$")[-1]
        resources.append({"type": typ, "name": urn.split("::")[-1], "state": state})
    return outputs, resources


def _unsecret(value):
    """The plain value, with the engine's secret wrappers (at any depth) removed."""
    if isinstance(value, dict):
        if _SIG_KEY in value:
            return _unsecret(value["value"])
        return {k: _unsecret(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unsecret(v) for v in value]
    return value


def _secret_field(string_data, key: str) -> str:
    """A stringData value that must be secret: either the whole map or the field is wrapped."""
    if _SIG_KEY in string_data:
        return _unsecret(string_data["value"])[key]
    field = string_data[key]
    assert isinstance(field, dict) and _SIG_KEY in field, f"stringData.{key} is not a Pulumi secret"
    return _unsecret(field)


def _k8s_objects(resources: list[dict]) -> list[dict]:
    objs = []
    for r in resources:
        state = r["state"]
        if r["type"].startswith("kubernetes:") and "apiVersion" in state and "kind" in state:
            objs.append({k: _unsecret(v) for k, v in state.items() if v not in (None, {}, [])})
    return objs


def _of(resources: list[dict], typ: str) -> list[dict]:
    return [r for r in resources if r["type"] == typ]


def test_component_in_cluster_database(mocked):
    outputs, resources = _deploy(mocked)
    assert outputs["tracking_uri"] == "http://mlflow.mlflow.svc.cluster.local:5000"
    assert outputs["destination"] == "s3://bucket/mlflow"
    assert _of(resources, "gpu-train:k8s:MlflowServer")

    objects = _k8s_objects(resources)
    for obj in objects:
        if obj["kind"] == "Cluster":
            continue
        _validate(obj)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ServiceAccount", "Secret", "Secret", "Cluster", "NetworkPolicy",
                            "NetworkPolicy", "NetworkPolicy", "Deployment", "Service"])
    assert all(o["metadata"].get("namespace", m.NAMESPACE) == m.NAMESPACE for o in objects)

    (release,) = _of(resources, "kubernetes:helm.sh/v3:Release")
    assert release["state"]["chart"] == "cloudnative-pg"
    assert release["state"]["version"] == m.CNPG_CHART_VERSION
    assert release["state"]["repositoryOpts"]["repo"] == m.CNPG_REPO

    (sa,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    assert sa["metadata"]["annotations"] == IRSA
    # The generated password is a Pulumi secret in both Secrets; it never shows in plain inputs.
    secrets_ = {r["state"]["metadata"]["name"]: r["state"] for r in _of(resources, "kubernetes:core/v1:Secret")}
    assert secrets_[m.DB_SECRET]["type"] == "kubernetes.io/basic-auth"
    password = _secret_field(secrets_[m.DB_SECRET]["stringData"], "password")
    uri = urlsplit(_secret_field(secrets_[m.DB_URI_SECRET]["stringData"], "uri"))
    assert unquote(uri.password) == password and uri.hostname == m.in_cluster_db_host()

    (dep,) = [o for o in objects if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--artifacts-destination") + 1] == "s3://bucket/mlflow"
    assert "--serve-artifacts" in args
    (svc,) = [o for o in objects if o["kind"] == "Service"]
    assert svc["spec"]["type"] == "ClusterIP"
    assert not any(o["kind"] in ("Ingress", "Gateway") for o in objects)


def test_component_managed_database(mocked):
    db = ManagedDatabase(host="mlflow.cluster-x.us-east-1.rds.amazonaws.com", username="mlflow",
                            password=pulumi.Output.secret("s3cr:t@"), cidrs=("10.0.48.0/24",))
    _, resources = _deploy(mocked, database="managed", database_endpoint=db,
                           identity_egress=(EgressTarget("169.254.170.23/32", 80),))
    assert not _of(resources, "kubernetes:helm.sh/v3:Release")
    assert not _of(resources, "kubernetes:postgresql.cnpg.io/v1:Cluster")
    objects = _k8s_objects(resources)
    for obj in objects:
        _validate(obj)
    (secret,) = _of(resources, "kubernetes:core/v1:Secret")
    uri = urlsplit(_secret_field(secret["state"]["stringData"], "uri"))
    assert uri.hostname == db.host and unquote(uri.password) == "s3cr:t@"
    (server_policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"
                        and o["metadata"]["name"] == "mlflow-server"]
    assert {"ipBlock": {"cidr": "10.0.48.0/24"}} in [peer for rule in server_policy["spec"]["egress"]
                                                    for peer in rule["to"]]


def test_component_rejects_bad_args_before_creating_anything(mocked):
    with pytest.raises(ValueError, match="gpu-train:mlflow.database is 'managed'"):
        _deploy(mocked, database="managed")
    registered = list(mocked.get_registered_resources())
    assert not [urn for urn in registered if "$kubernetes:" in urn or "MlflowServer" in urn]

