"""The log shipper: Fluent Bit on every node, sending the team namespaces' container logs to the store the
cloud layer named (platform.log_store), so a rank's log survives its pod and its node (a spot reclaim, a
quarantined GPU node).

Usage (infra/k8s/__init__.py): `LogShipper("log-shipper", LogShipperArgs(platform=platform))` when
`platform.log_store` is set (EKS: CloudWatch Logs); GKE ships every container's log to Cloud Logging itself.
`fluent_bit_values(store)` and `outputs_config(store)` are pure and tested without mocks.

The chart is aws-for-fluent-bit (https://github.com/aws/eks-charts, stable/aws-for-fluent-bit), whose
image carries Fluent Bit with the cloudwatch_logs output and EKS Pod Identity credentials (aws-for-fluent-bit
2.32.5 and later: https://github.com/aws/aws-for-fluent-bit/pull/888). What it runs:
- input: tail of /var/log/containers/*_team-*_*.log only (the kubelet names each file
  <pod>_<namespace>_<container>-<container id>.log, and pod and container names cannot hold "_"), with the
  CRI multiline parser; its position database lives on the node (/var/log), so a restarted shipper
  resumes where it stopped;
- outputs: one cloudwatch_logs output per team namespace, matching that namespace's files, writing to that
  team's log group (which must exist: auto_create_group stays off), one stream per container file named
  STREAM_PREFIX + the tail tag, sending only the log line (log_key log);
- no Kubernetes metadata filter: routing needs only the file name, so the shipper never calls the API
  server; the chart's own CloudWatch outputs are off.
`gpu-train logs` finds a rank's streams by that name after its pod is gone (gpu_train/cli/logs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.naming import STREAM_PREFIX, TAIL_TAG_PREFIX
from infra.k8s import common
from infra.platform import ClusterPlatform, LogStore

CHART = "aws-for-fluent-bit"
CHART_REPO = "https://aws.github.io/eks-charts"
# Chart 0.2.0 runs AWS for Fluent Bit 3.2.1 (Chart.yaml appVersion, February 2026).
CHART_VERSION = "0.2.0"
RELEASE = "fluent-bit"
TEAM_LOG_FILES = f"/var/log/containers/*_{naming.team_namespace('')}*_*.log"
POSITIONS_DB = "/var/log/gpu-train-fluent-bit.db"


def outputs_config(store: LogStore) -> str:
    """One cloudwatch_logs [OUTPUT] per team namespace (Fluent Bit classic configuration, the chart's
    additionalOutputs). Group names must be resolved strings."""
    if store.kind != "cloudwatch":
        raise ValueError(f"the Fluent Bit shipper writes to CloudWatch Logs, not {store.kind!r}")
    if not store.groups:
        raise ValueError("platform.log_store.groups is empty: no team namespace to ship logs for")
    blocks = []
    for namespace, group in sorted(store.groups.items()):
        if not isinstance(group, str) or not group:
            raise ValueError(f"log group of {namespace} must be a name, got {group!r}")
        blocks.append("\n".join([
            "[OUTPUT]",
            "    Name              cloudwatch_logs",
            f"    Match             {TAIL_TAG_PREFIX}var.log.containers.*_{namespace}_*",
            f"    region            {store.region}",
            f"    log_group_name    {group}",
            f"    log_stream_prefix {STREAM_PREFIX}",
            "    log_key           log",
            "    auto_create_group false",
        ]))
    return "\n".join(blocks) + "\n"


def fluent_bit_values(store: LogStore) -> dict[str, Any]:
    """Values of the aws-for-fluent-bit chart (keys from its values.yaml and templates at CHART_VERSION)."""
    return {
        "input": {"enabled": True, "tag": f"{TAIL_TAG_PREFIX}*", "path": TEAM_LOG_FILES, "db": POSITIONS_DB,
                  "multilineParser": "cri", "memBufLimit": "50MB", "skipLongLines": "On", "refreshInterval": 10},
        "filter": {"enabled": False},
        "cloudWatch": {"enabled": False},
        "cloudWatchLogs": {"enabled": False},
        "additionalOutputs": outputs_config(store),
        "serviceAccount": {"create": True, "name": store.shipper.name},
        # Only the node's log directory (containerd nodes keep no /var/lib/docker/containers).
        "volumes": [{"name": "varlog", "hostPath": {"path": "/var/log"}}],
        "volumeMounts": [{"name": "varlog", "mountPath": "/var/log"}],
        # Every node, GPU nodes (tainted) included: a team's pod may run anywhere it is scheduled.
        "tolerations": [{"operator": "Exists"}],
        "priorityClassName": "system-node-critical",
        # Root reads the kubelet's root-owned log files; nothing more is needed.
        "containerSecurityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "resources": common.resources("100m", "128Mi", "500m", "256Mi"),
    }


def network_policies(store: LogStore, platform: ClusterPlatform) -> list[common.Policy]:
    """DNS, the log store's endpoint on 443 and the workload-identity agent; nothing comes in."""
    return [
        common.default_deny(),
        common.allow_dns(),
        ("allow-log-store", {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": {"cidr": c}} for c in store.endpoint_cidrs],
                        "ports": [{"protocol": "TCP", "port": 443}]},
                       *[{"to": [{"ipBlock": {"cidr": t.cidr}}], "ports": [{"protocol": t.protocol, "port": t.port}]}
                         for t in platform.workload_identity_egress]],
        }),
    ]


@dataclass(frozen=True, kw_only=True)
class LogShipperArgs:
    platform: ClusterPlatform  # log_store (must be set), provider, workload identity egress


class LogShipper(pulumi.ComponentResource):
    """Namespace, NetworkPolicies and the Fluent Bit release."""

    def __init__(self, name: str, args: LogShipperArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:LogShipper", name, None, opts)
        p = args.platform
        store = p.log_store
        if store is None:
            raise ValueError("platform.log_store is None: the cloud keeps container logs itself")
        namespace = store.shipper.namespaces[0]
        # hostPath /var/log: only the privileged Pod Security level allows it; the namespace holds nothing else.
        self.namespace = common.namespace(namespace, p, self, enforce="privileged", depends_on=list(p.ready))
        common.network_policies(namespace, network_policies(store, p), p, self, [self.namespace])
        groups = dict(store.groups)
        values = pulumi.Output.all(*[groups[k] for k in sorted(groups)]).apply(lambda names: fluent_bit_values(
            LogStore(kind=store.kind, region=store.region, groups=dict(zip(sorted(groups), names, strict=True)),
                     shipper=store.shipper, endpoint_cidrs=store.endpoint_cidrs)))
        self.release = k8s.helm.v3.Release(
            f"{name}-release", name=RELEASE, chart=CHART, version=CHART_VERSION,
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=CHART_REPO), namespace=namespace, values=values,
            opts=common.k8s_opts(p, self, [self.namespace]))
        self.register_outputs({"namespace": namespace, "release": RELEASE})
