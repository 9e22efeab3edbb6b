"""MLflow tracking server in the cluster: PostgreSQL backend, artifacts in the artifacts bucket, no static keys.

Usage (built by the Kubernetes layer, infra/k8s/__init__.py; see docs/tracking.md):

    mlflow = MlflowServer("mlflow", MlflowServerArgs(platform=platform, settings=cfg.mlflow,
                                                     storage_class=storage.name, labels=tags, depends_on=ready))
    mlflow.tracking_uri   # MLFLOW_TRACKING_URI for jobs

What it creates, in namespace `mlflow`:
- PostgreSQL from CloudNativePG: the operator from its Helm chart (cnpg-system, pinned) and a `Cluster` on the
  encrypted StorageClass. The database password is generated here (a CSPRNG value kept as a Pulumi secret) and
  handed to PostgreSQL and MLflow through Kubernetes Secrets. With `database="managed"` the cloud's database
  (`ExternalDatabase`) is used instead and no PostgreSQL runs in the cluster.
- ServiceAccount `mlflow` annotated for workload identity; the server proxies artifacts
  (`--serve-artifacts --artifacts-destination s3://|gs://<artifacts bucket>/mlflow`), so clients need no
  bucket credentials at all.
- Deployment (non-root, read-only root filesystem, probes, pinned image) and a ClusterIP Service
  `mlflow:5000` only: the server is reachable inside the cluster (or through `kubectl port-forward`).
- NetworkPolicies (through infra/k8s/common.py, like every namespace's): default deny in the namespace; ingress to
  MLflow from team namespaces and monitoring; egress to PostgreSQL, DNS, the object store (and the workload identity
  endpoints).

Every manifest is built by a pure function below; the component only turns them into typed resources.

Over 400 lines because the server, its two database modes and its network fence are one unit, and, as in every
infra/k8s component, its manifests are pure functions beside the component (tested without Pulumi).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.settings import MlflowSettings
from infra.k8s.common import (
    Policy,
    checkov_skip_annotations,
    cidr_peers,
    default_deny,
    helm_release,
    k8s_opts,
    network_policies,
)
from infra.platform import ClusterPlatform, EgressTarget, generate_password

NAMESPACE = naming.MLFLOW_NAMESPACE
SERVICE_ACCOUNT = naming.MLFLOW_SERVICE_ACCOUNT
PORT = naming.MLFLOW_PORT
APP = "mlflow"
TRACKING_URI = f"http://{APP}.{NAMESPACE}.svc.cluster.local:{PORT}"

# The "-full" variant carries the PostgreSQL driver and the S3/GCS clients; the plain image has neither
# (https://github.com/mlflow/mlflow/tree/master/docker, "Image Variants"). Same version as the trainer's client.
MLFLOW_IMAGE = "ghcr.io/mlflow/mlflow:v3.17.2-full"
RUN_AS = 10001  # the image has no USER; any non-root uid works because it only reads /usr/local

# CloudNativePG: a CNCF project with monthly releases; the chart version pins the operator version, and the
# operator pins its default PostgreSQL image (https://cloudnative-pg.io/charts/).
CNPG_REPO = "https://cloudnative-pg.github.io/charts"
CNPG_CHART = "cloudnative-pg"
CNPG_CHART_VERSION = "0.29.0"
CNPG_NAMESPACE = "cnpg-system"
DB_CLUSTER = "mlflow-db"  # CNPG names the read-write Service <cluster>-rw and labels pods cnpg.io/cluster
DB_NAME = "mlflow"
DB_USER = "mlflow"
DB_PORT = 5432
DB_SECRET = "mlflow-db"  # kubernetes.io/basic-auth: username, password (read by CNPG)
DB_URI_SECRET = "mlflow-db-uri"  # key `uri`: the SQLAlchemy URL MLflow reads (MLFLOW_BACKEND_STORE_URI)
CNPG_STATUS_PORT = 8000  # instance manager status endpoint the operator polls

TMP_MOUNT = "/tmp"


@dataclass(frozen=True, kw_only=True)
class MlflowServerArgs:
    # Read: provider, identities["mlflow"], buckets.artifacts, the object-store, API-server, pod and VPC ranges,
    # system_node_selector, workload_identity_egress and mlflow_database.
    platform: ClusterPlatform
    settings: MlflowSettings  # cfg.mlflow: the database's mode and storage
    storage_class: str  # the Kubernetes layer's encrypted StorageClass, for PostgreSQL
    labels: Mapping[str, str] = field(default_factory=dict)  # the stack's common tags, added to every object
    db_instances: int = 1  # PostgreSQL instances (2+ = streaming replicas with automatic failover)
    install_operator: bool = True  # False when CloudNativePG is already installed in the cluster
    artifacts_prefix: str = naming.MLFLOW_ARTIFACTS_PREFIX  # artifacts go to <bucket>/<prefix>/
    image: str = MLFLOW_IMAGE
    replicas: int = 1
    tmp_size_gb: int = 20  # proxied uploads are spooled here: must hold the largest single artifact file
    depends_on: Sequence[pulumi.Resource] = ()


# ------------------------------------------------------------------------------------------- validation
def validate(args: MlflowServerArgs) -> None:
    """Reject what cannot work, naming the culprit (the settings' own bounds are the settings model's)."""
    p, database, problems = args.platform, args.settings.database, []
    if database == "managed" and p.mlflow_database is None:
        problems.append("gpu-train:mlflow.database is 'managed' but the cloud layer provided no database endpoint "
                        "(ClusterPlatform.mlflow_database)")
    if database == "in-cluster" and p.mlflow_database is not None:
        problems.append("gpu-train:mlflow.database is 'in-cluster' but an external database was also given")
    if args.db_instances < 1 or args.replicas < 1 or args.tmp_size_gb < 1:
        problems.append("MlflowServerArgs.db_instances, replicas and tmp_size_gb must be >= 1")
    identity = p.identities.get("mlflow")
    if identity is None or identity.name != SERVICE_ACCOUNT or NAMESPACE not in identity.namespaces:
        got = f"{identity.name!r} in {list(identity.namespaces)}" if identity else "none"
        problems.append(f"platform.identities['mlflow'] must bind service account {SERVICE_ACCOUNT!r} in namespace "
                        f"{NAMESPACE!r} (got {got})")
    if not args.storage_class:
        problems.append("the encrypted StorageClass's name must not be empty")
    for cidr in [*p.object_store_cidrs, *p.api_server_cidrs, p.pod_cidr, p.vpc_cidr,
                 *(p.mlflow_database.cidrs if p.mlflow_database else ()),
                 *(t.cidr for t in p.workload_identity_egress)]:
        try:
            ipaddress.ip_network(cidr)
        except ValueError:
            problems.append(f"MLflow NetworkPolicy CIDR {cidr!r} is not a valid network")
    if problems:
        raise ValueError("invalid MLflow server settings:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------------------------------------- pure helpers
def database_uri(*, user: str, password: str, host: str, port: int, database: str, sslmode: str) -> str:
    """The SQLAlchemy URL for MLflow; user and password are percent-encoded (cloud passwords carry @ : /)."""
    return (f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/"
            f"{quote(database, safe='')}?sslmode={quote(sslmode, safe='')}")


def in_cluster_db_host() -> str:
    return f"{DB_CLUSTER}-rw.{NAMESPACE}.svc.cluster.local"


def artifacts_destination(bucket: str, prefix: str) -> str:
    """s3://bucket/prefix or gs://bucket/prefix; anything else is the cloud layer's mistake."""
    if not bucket.startswith(("s3://", "gs://")) or len(bucket) <= 5:
        raise ValueError(f"platform.buckets.artifacts must be s3://NAME or gs://NAME (got {bucket!r})")
    return f"{bucket.rstrip('/')}/{prefix.strip('/')}" if prefix.strip("/") else bucket.rstrip("/")


def host_patterns(cidrs: Sequence[str]) -> list[str]:
    """fnmatch patterns covering each CIDR by its fixed leading octets: 10.64.0.0/14 -> 10.*."""
    patterns = []
    for cidr in cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        if net.version != 4:
            continue
        fixed = net.network_address.exploded.split(".")[: net.prefixlen // 8]
        pattern = ".".join([*fixed, "*"]) if fixed else "*"
        if pattern not in patterns:
            patterns.append(pattern)
    return patterns


def allowed_hosts(cluster_cidrs: Sequence[str]) -> list[str]:
    """Host headers the server accepts (DNS-rebinding guard, on by default since MLflow 3.5).

    The service names clients use, localhost for `kubectl port-forward`, and pod addresses for Prometheus,
    which scrapes /metrics by pod IP. /health is exempt from the check, so probes need no entry.
    """
    names = [f"{APP}.{NAMESPACE}.svc.cluster.local", f"{APP}.{NAMESPACE}.svc", f"{APP}.{NAMESPACE}", APP]
    hosts = [*names, *(f"{n}:{PORT}" for n in names), "localhost:*", "127.0.0.1:*"]
    return hosts + [f"{p}:{PORT}" for p in host_patterns(cluster_cidrs)]


def labels(common: Mapping[str, str], component: str) -> dict[str, str]:
    """Labels on every object: the common tags plus the standard app labels."""
    return {
        **common,
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "gpu-train",
        "app.kubernetes.io/managed-by": "pulumi",
    }


def selector() -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "server"}


def namespace_manifest(common: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {
            "name": NAMESPACE,
            # Restricted Pod Security: the server and CNPG's PostgreSQL pods both run non-root with no privileges.
            "labels": {**labels(common, "namespace"), "pod-security.kubernetes.io/enforce": "restricted",
                       "pod-security.kubernetes.io/enforce-version": "latest"},
        },
    }


def service_account_manifest(common: Mapping[str, str], annotations: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE, "labels": labels(common, "server"),
                     "annotations": dict(annotations)},
        "automountServiceAccountToken": False,
    }


def secret_manifest(common: Mapping[str, str], name: str, kind: str, string_data: Mapping[str, Any],
                    component: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": kind,
        "metadata": {"name": name, "namespace": NAMESPACE,
                     # CNPG reloads a secret carrying this label when it changes (password rotation).
                     "labels": {**labels(common, component), "cnpg.io/reload": "true"}},
        "stringData": dict(string_data),
    }


def operator_values(node_selector: Mapping[str, str]) -> dict[str, Any]:
    """Values for the cloudnative-pg chart (https://github.com/cloudnative-pg/charts, charts/cloudnative-pg)."""
    return {
        "crds": {"create": True},
        "replicaCount": 1,
        "nodeSelector": dict(node_selector),
        "resources": {"requests": {"cpu": "100m", "memory": "200Mi"}, "limits": {"memory": "512Mi"}},
        "config": {"clusterWide": True},
    }


def postgres_cluster_manifest(*, common: Mapping[str, str], storage_class: str, storage_gb: int, instances: int,
                              node_selector: Mapping[str, str]) -> dict[str, Any]:
    """The CNPG `Cluster` (postgresql.cnpg.io/v1; https://cloudnative-pg.io/documentation/current/cloudnative-pg.v1/)."""
    return {
        "apiVersion": "postgresql.cnpg.io/v1", "kind": "Cluster",
        "metadata": {"name": DB_CLUSTER, "namespace": NAMESPACE, "labels": labels(common, "database")},
        "spec": {
            "instances": instances,
            "storage": {"size": f"{storage_gb}Gi", "storageClass": storage_class},
            "enableSuperuserAccess": False,
            "bootstrap": {"initdb": {"database": DB_NAME, "owner": DB_USER, "secret": {"name": DB_SECRET}}},
            # A managed role keeps the password in the database in step with the Secret (rotation).
            "managed": {"roles": [{"name": DB_USER, "ensure": "present", "login": True,
                                   "passwordSecret": {"name": DB_SECRET}}]},
            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
            "affinity": {"nodeSelector": dict(node_selector)},
            "primaryUpdateStrategy": "unsupervised",
        },
    }


def server_args(destination: str, hosts: Sequence[str], workers: int = 2) -> list[str]:
    """`mlflow server` arguments; the backend store URI comes from env (MLFLOW_BACKEND_STORE_URI)."""
    return [
        "mlflow", "server",
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--workers", str(workers),
        "--serve-artifacts",
        "--artifacts-destination", destination,
        "--allowed-hosts", ",".join(hosts),
        "--expose-prometheus", f"{TMP_MOUNT}/prometheus",
    ]


def deployment_manifest(*, common: Mapping[str, str], image: str, replicas: int, args: pulumi.Input[Sequence[str]],
                        node_selector: Mapping[str, str], tmp_size_gb: int) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": APP, "namespace": NAMESPACE, "labels": labels(common, "server"),
                     "annotations": checkov_skip_annotations(APP)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector()},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": {**labels(common, "server"), **selector()}},
                "spec": {
                    "serviceAccountName": SERVICE_ACCOUNT,
                    # No Kubernetes API token: the server never calls the API. Workload identity does not need
                    # it either (IRSA and Pod Identity inject their own projected token volume; GKE uses the
                    # metadata server).
                    "automountServiceAccountToken": False,
                    "nodeSelector": dict(node_selector),
                    "securityContext": {
                        "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [{
                        "name": APP,
                        "image": image,
                        "imagePullPolicy": "Always",
                        "args": args,
                        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
                        "env": [
                            {"name": "MLFLOW_BACKEND_STORE_URI",
                             "valueFrom": {"secretKeyRef": {"name": DB_URI_SECRET, "key": "uri"}}},
                            {"name": "HOME", "value": TMP_MOUNT},
                            {"name": "TMPDIR", "value": TMP_MOUNT},
                            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                        ],
                        "resources": {
                            "requests": {"cpu": "250m", "memory": "1Gi", "ephemeral-storage": "1Gi"},
                            "limits": {"cpu": "2", "memory": "2Gi", "ephemeral-storage": f"{tmp_size_gb + 1}Gi"},
                        },
                        # First start runs the schema migrations; give it up to 5 minutes before liveness.
                        "startupProbe": {**probe, "failureThreshold": 30},
                        "readinessProbe": {**probe, "failureThreshold": 3},
                        "livenessProbe": {**probe, "failureThreshold": 6},
                        "securityContext": {
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "privileged": False, "capabilities": {"drop": ["ALL"]},
                        },
                        "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT}],
                    }],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": f"{tmp_size_gb}Gi"}}],
                },
            },
        },
    }


def service_manifest(common: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": APP, "namespace": NAMESPACE, "labels": labels(common, "server")},
        "spec": {
            "type": "ClusterIP",
            "selector": selector(),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _ns(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


def mlflow_network_policies(*, database: str, db_cidrs: Sequence[str] = (), db_port: int = DB_PORT,
                            object_store_cidrs: Sequence[str], api_server_cidrs: Sequence[str],
                            identity_egress: Sequence[EgressTarget] = ()) -> list[Policy]:
    """Default deny for the namespace, then exactly the flows MLflow and its database need."""
    db_pods = {"matchLabels": {"cnpg.io/cluster": DB_CLUSTER}}
    dns = {
        "to": [{**_ns("kube-system"), "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
        "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
    }

    def policy(name: str, pod_selector: dict[str, Any], spec: dict[str, Any]) -> Policy:
        return name, {"podSelector": pod_selector, **spec}

    server_egress = [dns]
    if database == "in-cluster":
        server_egress.append({"to": [{"podSelector": db_pods}], "ports": [{"port": DB_PORT, "protocol": "TCP"}]})
    else:
        server_egress.append({"to": cidr_peers(db_cidrs), "ports": [{"port": db_port, "protocol": "TCP"}]})
    server_egress.append({"to": cidr_peers(object_store_cidrs), "ports": [{"port": 443, "protocol": "TCP"}]})
    server_egress += [{"to": cidr_peers([t.cidr]), "ports": [{"port": t.port, "protocol": t.protocol}]}
                      for t in identity_egress]

    policies = [
        default_deny(),
        policy("mlflow-server", {"matchLabels": selector()}, {
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [
                    # Every team namespace carries the team label (set by the scheduling layer).
                    {"namespaceSelector": {"matchExpressions": [{"key": naming.TEAM_LABEL, "operator": "Exists"}]}},
                    _ns(naming.MONITORING_NAMESPACE),
                ],
                "ports": [{"port": PORT, "protocol": "TCP"}],
            }],
            "egress": server_egress,
        }),
    ]
    if database == "in-cluster":
        policies.append(policy("mlflow-db", db_pods, {
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": selector()}}],
                 "ports": [{"port": DB_PORT, "protocol": "TCP"}]},
                # The operator polls each instance's status endpoint and connects for switchovers; replicas
                # stream from the primary (https://cloudnative-pg.io/documentation/current/networking/).
                {"from": [_ns(CNPG_NAMESPACE)],
                 "ports": [{"port": CNPG_STATUS_PORT, "protocol": "TCP"}, {"port": DB_PORT, "protocol": "TCP"}]},
                {"from": [{"podSelector": db_pods}],
                 "ports": [{"port": DB_PORT, "protocol": "TCP"}, {"port": CNPG_STATUS_PORT, "protocol": "TCP"}]},
                {"from": [_ns(naming.MONITORING_NAMESPACE)], "ports": [{"port": 9187, "protocol": "TCP"}]},
            ],
            "egress": [
                dns,
                {"to": [{"podSelector": db_pods}],
                 "ports": [{"port": DB_PORT, "protocol": "TCP"}, {"port": CNPG_STATUS_PORT, "protocol": "TCP"}]},
                # The instance manager watches its Cluster object through the API server.
                {"to": cidr_peers(api_server_cidrs), "ports": [{"port": 443, "protocol": "TCP"}]},
            ],
        }))
    return policies


# ----------------------------------------------------------------------------------------------- component
class MlflowServer(pulumi.ComponentResource):
    """The in-cluster MLflow tracking server; `tracking_uri` is what jobs set as MLFLOW_TRACKING_URI."""

    tracking_uri: pulumi.Output[str]
    namespace: pulumi.Output[str]

    def __init__(self, name: str, args: MlflowServerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        validate(args)  # before anything is registered
        super().__init__("gpu-train:k8s:MlflowServer", name, None, opts)
        p, database = args.platform, args.settings.database
        common = dict(args.labels)
        system = dict(p.system_node_selector)

        def child(extra: pulumi.ResourceOptions | None = None) -> pulumi.ResourceOptions:
            base = k8s_opts(p, self, args.depends_on)
            return pulumi.ResourceOptions.merge(base, extra) if extra else base

        ns = namespace_manifest(common)
        self.ns = k8s.core.v1.Namespace(f"{name}-ns", metadata=ns["metadata"], opts=child())
        after_ns = child(pulumi.ResourceOptions(depends_on=[self.ns]))

        sa = service_account_manifest(common, p.identities["mlflow"].annotations)
        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata=sa["metadata"], automount_service_account_token=False, opts=after_ns)

        # ---- database and the secrets that carry its password
        if database == "in-cluster":
            uri, db_ready = self._in_cluster_database(name, args, common, child)
            db_cidrs: Sequence[str] = ()
            db_port = DB_PORT
        else:
            ext = p.mlflow_database
            assert ext is not None  # validate() guarantees it
            uri = pulumi.Output.all(ext.username, ext.password, ext.host).apply(
                lambda v: database_uri(user=v[0], password=v[1], host=v[2], port=ext.port, database=ext.database,
                                       sslmode=ext.sslmode))
            db_cidrs, db_port, db_ready = ext.cidrs, ext.port, []

        uri_secret = secret_manifest(common, DB_URI_SECRET, "Opaque", {"uri": pulumi.Output.secret(uri)}, "server")
        self.db_uri_secret = k8s.core.v1.Secret(
            f"{name}-db-uri", metadata=uri_secret["metadata"], type=uri_secret["type"],
            string_data=uri_secret["stringData"],
            opts=child(pulumi.ResourceOptions(
                depends_on=[self.ns],
                ignore_changes=["stringData"] if database == "in-cluster" else None)),
        )

        # ---- network policies before the workloads, so nothing ever runs unfenced
        self.network_policies = network_policies(
            NAMESPACE, mlflow_network_policies(
                database=database, db_cidrs=db_cidrs, db_port=db_port, object_store_cidrs=p.object_store_cidrs,
                api_server_cidrs=p.api_server_cidrs, identity_egress=p.workload_identity_egress),
            p, self, [*args.depends_on, self.ns], labels=labels(common, "network-policy"), prefix=f"{name}-netpol")

        # ---- server
        destination = pulumi.Output.from_input(p.buckets.artifacts).apply(
            lambda b: artifacts_destination(b, args.artifacts_prefix))
        hosts = allowed_hosts((p.pod_cidr, p.vpc_cidr))
        container_args = destination.apply(lambda d: server_args(d, hosts))
        deployment = deployment_manifest(common=common, image=args.image, replicas=args.replicas,
                                         args=container_args, node_selector=system, tmp_size_gb=args.tmp_size_gb)
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-server", metadata=deployment["metadata"], spec=deployment["spec"],
            opts=child(pulumi.ResourceOptions(depends_on=[self.service_account, self.db_uri_secret,
                                                          *self.network_policies, *db_ready])),
        )
        svc = service_manifest(common)
        self.service = k8s.core.v1.Service(f"{name}-svc", metadata=svc["metadata"], spec=svc["spec"], opts=after_ns)

        self.namespace = pulumi.Output.from_input(NAMESPACE)
        self.tracking_uri = pulumi.Output.all(self.service.id, self.deployment.id).apply(lambda _: TRACKING_URI)
        self.artifacts_destination = destination
        self.register_outputs({
            "trackingUri": self.tracking_uri,
            "namespace": self.namespace,
            "artifactsDestination": destination,
            "databaseMode": database,
        })

    def _in_cluster_database(self, name: str, args: MlflowServerArgs, common: dict[str, str],
                             child: Callable[..., pulumi.ResourceOptions]
                             ) -> tuple[pulumi.Output[str], list[pulumi.Resource]]:
        """The CloudNativePG cluster (and its operator, unless installed already) with its generated password;
        returns the database URI and what the server must wait for."""
        # Generated once: ignore_changes keeps the first value on every later `pulumi up` (a new random
        # value is drawn each run and discarded). The value lives only in the encrypted Pulumi state and
        # in the cluster's (KMS-encrypted) Secrets. Rotate with `pulumi up --replace` on both secrets.
        password = pulumi.Output.secret(generate_password())
        keep = pulumi.ResourceOptions(ignore_changes=["stringData"], depends_on=[self.ns])
        auth = secret_manifest(common, DB_SECRET, "kubernetes.io/basic-auth",
                               {"username": DB_USER, "password": password}, "database")
        self.db_secret = k8s.core.v1.Secret(f"{name}-db-secret", metadata=auth["metadata"], type=auth["type"],
                                            string_data=auth["stringData"], opts=child(keep))
        uri = password.apply(lambda p: database_uri(user=DB_USER, password=p, host=in_cluster_db_host(),
                                                    port=DB_PORT, database=DB_NAME, sslmode="require"))
        operator: list[pulumi.Resource] = []
        if args.install_operator:
            self.operator = helm_release(
                f"{name}-cnpg", "cnpg", CNPG_CHART, CNPG_CHART_VERSION, CNPG_REPO, CNPG_NAMESPACE,
                create_namespace=True, atomic=True, values=operator_values(args.platform.system_node_selector),
                opts=child())
            operator.append(self.operator)
        cluster = postgres_cluster_manifest(common=common, storage_class=args.storage_class,
                                            storage_gb=args.settings.storage_gb, instances=args.db_instances,
                                            node_selector=args.platform.system_node_selector)
        self.database = k8s.apiextensions.CustomResource(
            f"{name}-db", api_version=cluster["apiVersion"], kind=cluster["kind"],
            metadata=cluster["metadata"], spec=cluster["spec"],
            opts=child(pulumi.ResourceOptions(depends_on=[self.ns, self.db_secret, *operator])),
        )
        return uri, [self.database]
