"""Audit rules: the Kubernetes control plane's logs stay on.

Usage: `from policies import audit; list(audit.control_plane_logging(res, ctx))` yields one detail
string per problem.

- EKS sends no control-plane log to CloudWatch unless `enabledClusterLogTypes` lists it; the five
  types are api, audit, authenticator, controllerManager and scheduler
  (https://docs.aws.amazon.com/eks/latest/userguide/control-plane-logs.html). All five are required:
  the audit and authenticator logs say who did what, the others explain what the cluster did about it.
- GKE writes system and workload logs to Cloud Logging unless `loggingService` is "none" or
  `loggingConfig.enableComponents` leaves them out (an empty list turns logging off)
  (https://cloud.google.com/kubernetes-engine/docs/how-to/config-logging). Admin-activity audit logs
  are Cloud Audit Logs and cannot be turned off from the cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

from policies.core import Context, Resource, items

EKS_CLUSTER = "aws:eks/cluster:Cluster"
GKE_CLUSTER = "gcp:container/cluster:Cluster"
EKS_LOG_TYPES = ("api", "audit", "authenticator", "controllerManager", "scheduler")
GKE_LOG_COMPONENTS = ("SYSTEM_COMPONENTS", "WORKLOADS")


def control_plane_logging(res: Resource, ctx: Context) -> Iterator[str]:
    """EKS logs every control-plane log type; GKE keeps system and workload logging on."""
    if res.type == EKS_CLUSTER:
        enabled = set(items(res.get("enabledClusterLogTypes")))
        missing = [t for t in EKS_LOG_TYPES if t not in enabled]
        if missing:
            yield (f"enabledClusterLogTypes leaves out {', '.join(missing)}, so those control-plane logs "
                   "(audit: who called the API) are not kept.")
    elif res.type == GKE_CLUSTER:
        service = res.get("loggingService")
        if service == "none":
            yield "loggingService is 'none', so the cluster writes no logs to Cloud Logging."
        config = res.get("loggingConfig")
        if config is not None:
            components = set(items(config.get("enableComponents") if hasattr(config, "get") else None))
            missing = [c for c in GKE_LOG_COMPONENTS if c not in components]
            if missing:
                yield f"loggingConfig.enableComponents leaves out {', '.join(missing)}."
