"""`gpu-train logs`: one rank's log, live from its pod while the pod exists, and from the platform's log store
once the pod (or its node) is gone.

Usage: `for text in logs(session, load_contract, team, job, rank=0, follow=False): print(text, end="")`
(gpu_train.client.Client.logs wraps it). Every check (the rank, a pod not started yet, the log store's access)
runs when `logs` is called; the text then streams from the returned iterator.

Where the log comes from:
- the rank's newest pod (label batch.kubernetes.io/job-completion-index = rank) through the API server,
  followed live with --follow;
- with no pod left, the log store named by the platform contract:
  - EKS, CloudWatch Logs: the team's log group, the streams Fluent Bit named after the container's log file
    (gpu_train.spec.naming.rank_stream_prefix), found with DescribeLogStreams and read with FilterLogEvents
    (boto3, the caller's AWS credentials; the team's reader policy, docs/teams.md);
  - GKE, Cloud Logging: the cluster's k8s_container entries of the team namespace, container and the rank's
    pods (google-cloud-logging, the caller's gcloud application-default credentials).
A rank is the node rank: index N of the JobSet's worker Job runs on the job's N-th node; torchrun writes
every local rank's output to that pod's log.
"""

from __future__ import annotations

import datetime as dt
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from gpu_train.client.cluster import Session, call, team_namespace
from gpu_train.client.errors import ClientError
from gpu_train.client.status import INDEX_LABEL
from gpu_train.jobs import jobset as jobset_api
from gpu_train.spec import naming

DEFAULT_SINCE = dt.timedelta(days=7)


def _since(text: str | None) -> dt.timedelta:
    """--since 30m / 12h / 7d."""
    if not text:
        return DEFAULT_SINCE
    m = re.fullmatch(r"([0-9]+)([smhd])", text)
    if not m:
        raise ClientError(f"--since {text!r} is not a duration like 30m, 12h or 7d")
    return dt.timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]: int(m.group(1))})


def rank_pods(session: Session, ns: str, team: str, job: str, rank: int) -> list[Any]:
    pods = call(session, session.core.list_namespaced_pod, ns,
                label_selector=f"{naming.JOBSET_NAME_LABEL}={job},{INDEX_LABEL}={rank}", doing="list pods",
                namespace=ns, team=team).items
    return sorted(pods, key=lambda p: p.metadata.creation_timestamp or dt.datetime.min.replace(tzinfo=dt.UTC))


def from_pod(session: Session, ns: str, team: str, pod: Any, container: str, follow: bool,
             tail: int | None) -> Iterator[str]:
    """The pod's log as it arrives (the request is made when this is called, the text read while iterating)."""
    name = pod.metadata.name
    kwargs: dict[str, Any] = {"container": container, "follow": follow, "_preload_content": False}
    if tail is not None:
        kwargs["tail_lines"] = tail
    resp = call(session, session.core.read_namespaced_pod_log, name, ns, doing=f"read the log of pod {name}",
                namespace=ns, team=team, **kwargs)

    def chunks() -> Iterator[str]:
        try:
            for chunk in resp.stream(4096):
                yield chunk.decode("utf-8", errors="replace")
        finally:
            resp.release_conn()
    return chunks()


# ------------------------------------------------------------------------------------------ CloudWatch Logs


def cloudwatch_events(client: Any, group: str, prefix: str, marker: str, start_ms: int) -> Iterator[dict[str, Any]]:
    """Events of every stream of `group` whose name starts with `prefix` and holds `marker`, oldest first."""
    names: list[str] = []
    kwargs: dict[str, Any] = {"logGroupName": group, "logStreamNamePrefix": prefix}
    while True:
        page = client.describe_log_streams(**kwargs)
        names += [s["logStreamName"] for s in page.get("logStreams") or [] if marker in s["logStreamName"]]
        if not page.get("nextToken"):
            break
        kwargs["nextToken"] = page["nextToken"]
    events: list[dict[str, Any]] = []
    for i in range(0, len(names), 100):  # FilterLogEvents takes at most 100 stream names
        kwargs = {"logGroupName": group, "logStreamNames": names[i:i + 100], "startTime": start_ms}
        while True:
            page = client.filter_log_events(**kwargs)
            events += page.get("events") or []
            token = page.get("nextToken")
            if not token or not page.get("events"):
                break
            kwargs["nextToken"] = token
    events.sort(key=lambda e: (e.get("timestamp", 0), e.get("ingestionTime", 0), e.get("eventId", "")))
    return iter(events)


def from_cloudwatch(contract, team, job: str, rank: int, container: str, since: dt.timedelta) -> list[str]:
    import boto3
    import botocore.exceptions

    logs = contract.logs
    group = logs.groups.get(team.namespace)
    if not group:
        raise ClientError(f"the platform contract names no log group for {team.namespace}", code=1)
    start = int((dt.datetime.now(dt.UTC) - since).timestamp() * 1000)
    client = boto3.client("logs", region_name=logs.region or contract.region)
    try:
        events = list(cloudwatch_events(client, group, naming.rank_stream_prefix(job, rank), f"_{team.namespace}_{container}-",
                                        start))
    except botocore.exceptions.NoCredentialsError:
        raise ClientError("no AWS credentials to read CloudWatch Logs: sign in (aws sso login, or AWS_PROFILE)", code=1) \
            from None
    except botocore.exceptions.ClientError as exc:
        err = exc.response.get("Error", {})
        if err.get("Code") in ("AccessDeniedException", "UnrecognizedClientException"):
            raise ClientError(f"CloudWatch Logs refused to read {group} ({err.get('Code')}): your AWS identity needs the "
                           f"team's log reader policy (docs/teams.md)", code=1) from None
        if err.get("Code") == "ResourceNotFoundException":
            raise ClientError(f"log group {group} does not exist ({err.get('Message')})", code=1) from None
        raise ClientError(f"CloudWatch Logs: {err.get('Code')}: {err.get('Message')}", code=1) from None
    except botocore.exceptions.BotoCoreError as exc:
        raise ClientError(f"CloudWatch Logs: {exc}", code=1) from None
    if not events:
        raise ClientError(f"no log of rank {rank} of job {job!r} in {group} since {since} (no pod left either)", code=1)
    return [m if m.endswith("\n") else m + "\n" for m in (e.get("message", "") for e in events)]


# ------------------------------------------------------------------------------------------ Cloud Logging


def cloud_logging_client(project: str) -> Any:
    """A Cloud Logging client with the caller's application-default credentials (HTTP/JSON transport)."""
    with warnings.catch_warnings():
        # google-api-core warns about Python versions nearing their end of life on import; not the user's concern.
        warnings.simplefilter("ignore", FutureWarning)
        from google.cloud import logging as gcl

    return gcl.Client(project=project, _use_grpc=False)


def cloud_logging_filter(cluster: str, namespace: str, container: str, job: str, rank: int, since_iso: str) -> str:
    """The Logging query language filter for one rank's container log (its pods' names: <job>-worker-0-<rank>-<5>)."""
    pods = f"^{re.escape(job)}-{naming.REPLICATED_JOB}-0-{rank}-[a-z0-9]{{5}}$"
    return (f'resource.type="k8s_container" AND resource.labels.cluster_name="{cluster}" AND '
            f'resource.labels.namespace_name="{namespace}" AND resource.labels.container_name="{container}" AND '
            f'resource.labels.pod_name=~"{pods}" AND timestamp>="{since_iso}"')


def from_cloud_logging(contract, team, job: str, rank: int, container: str, since: dt.timedelta,
                       client: Any = None) -> list[str]:
    logs = contract.logs
    project = logs.project
    start = (dt.datetime.now(dt.UTC) - since).strftime("%Y-%m-%dT%H:%M:%SZ")
    query = cloud_logging_filter(logs.cluster or contract.cluster.name, team.namespace, container, job, rank,
                                 start)
    try:
        from google.api_core import exceptions as gexc
        from google.auth import exceptions as auth_exc

        client = client or cloud_logging_client(project)
        entries = list(client.list_entries(resource_names=[f"projects/{project}"], filter_=query,
                                           order_by="timestamp asc", page_size=1000))
    except auth_exc.DefaultCredentialsError:
        raise ClientError("no Google credentials to read Cloud Logging: gcloud auth application-default login",
                       code=1) from None
    except gexc.PermissionDenied as exc:
        raise ClientError(f"Cloud Logging refused to read project {project} (403: {exc.message}): your account needs "
                       "roles/logging.viewer on it (docs/teams.md)", code=1) from None
    except gexc.GoogleAPICallError as exc:
        raise ClientError(f"Cloud Logging: {exc.code} {exc.message}", code=1) from None
    if not entries:
        raise ClientError(f"no log of rank {rank} of job {job!r} in Cloud Logging since {start} (no pod left either)",
                       code=1)
    lines = []
    for entry in entries:
        payload = entry.payload
        line = payload.get("message", str(payload)) if isinstance(payload, dict) else str(payload or "")
        lines.append(line if line.endswith("\n") else line + "\n")
    return lines


# ------------------------------------------------------------------------------------------ either


def logs(session: Session, contract_loader: Callable[[], Any], team: str, job: str, *, rank: int = 0,
         follow: bool = False, container: str = "", since: str | None = None,
         tail: int | None = None) -> Iterator[str]:
    """One rank's log text; `contract_loader()` gives the platform contract, read only when the log must come from
    the store."""
    if rank < 0:
        raise ClientError(f"--rank {rank} must be >= 0")
    container = container or jobset_api.CONTAINER
    ns = team_namespace(team)
    pods = rank_pods(session, ns, team, job, rank)
    if pods and pods[-1].status.phase == "Pending" and not any(
            cs.state and (cs.state.running or cs.state.terminated) for cs in pods[-1].status.container_statuses or []):
        raise ClientError(f"rank {rank}'s pod {pods[-1].metadata.name} has not started yet (Pending: waiting for a node "
                       f"or its image); `gpu-train status {job}` says why", code=1)
    if pods:
        return from_pod(session, ns, team, pods[-1], container, follow, tail)
    window = _since(since)
    contract = contract_loader()
    info = contract.team(team)
    head = f"# rank {rank} of job {job!r} has no pod now; its log from the platform's log store:\n"
    kind = contract.logs.kind
    if kind == "cloudwatch":
        return iter([head, *from_cloudwatch(contract, info, job, rank, container, window)])
    if kind == "cloud-logging":
        return iter([head, *from_cloud_logging(contract, info, job, rank, container, window)])
    raise ClientError(f"the platform contract names an unknown log store {kind!r}", code=1)
