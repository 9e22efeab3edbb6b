"""What `gpu-train status` and `gpu-train logs` read from the real cluster: a queued job's position from Kueue's
visibility API (served by the real Kueue behind the API server's aggregation layer), the reason a position is
missing when that API is not installed, a running job's ranks and pods, rank 0's metrics asked through the pod
proxy, a rank's log from its pod (served by kwok from a file, as a kubelet serves it from the container runtime),
a pod not yet started, and, once a rank has no pod, its log from the platform's log store: CloudWatch Logs on a
local moto server, or Cloud Logging from recorded entries.list answers served locally.

What the plane cannot show: the pod proxy's answer. The real API server dials only global unicast pod addresses
and the plane's pods have loopback ones, so rank 0's metrics never arrive here; the tests check that a team member
is authorized for the proxy and that status says why there is no progress, and the progress line itself is checked
against the trainer's own exposition in tests/gpu_train/client/test_status_metrics.py.

Run: .venv/bin/pytest tests/cluster/test_status_logs.py -q
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import sys
import threading
import urllib.request
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest

from gpu_train.client import logs as cli_logs
from gpu_train.jobs.jobset import CONTAINER
from gpu_train.spec import naming
from infra.k8s import log_shipping
from infra.platform import LogStore, WorkloadIdentity
from tests.cluster.conftest import wait_for
from tests.cluster.jobs import (
    NS,
    admitted,
    is_true,
    jobset_of,
    pending,
    pods_of,
    running_pods,
    submit,
    workload_of,
)
from tools.cluster.controllers import pod_log
from tools.cluster.plane import free_port

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "gpu_train" / "cli" / "fixtures"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
APISERVICE = ("apiregistration.k8s.io/v1", "APIService")
VISIBILITY_API = "v1beta2.visibility.kueue.x-k8s.io"


def rank_pod(platform, name: str, rank: int) -> Any:
    return next(p for p in running_pods(platform, name)
                if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == str(rank))


# ------------------------------------------------------------------------------------------ status


def test_a_queued_jobs_position_comes_from_kueues_visibility_api(platform, cli, tmp_path, clean):
    alice = platform.kubeconfigs["alice"]
    assert submit(cli, platform, tmp_path, name="holder", nodes="4:4")[0] == 0
    wait_for("'holder' admitted on all of research's GPUs", lambda: admitted(platform, "holder"))
    # Kueue orders a queue by priority, then by creation time, which the API server keeps to the second: "third" is
    # a sweep trial, below "second", so that it is behind "second" however fast the two are submitted.
    for name, priority in (("second", {}), ("third", {"priorityClass": "sweep"})):
        assert submit(cli, platform, tmp_path, name=name, nodes="2:2", **priority)[0] == 0
        wait_for(f"Kueue to leave '{name}' pending", lambda n=name: pending(platform, n))
    queue = naming.local_queue_name("research")
    # Kueue's queue manager places a new workload asynchronously: wait for its answer, then check it.
    seen: list[str] = []

    def placed() -> str | None:
        code, out, err = cli("status", "third", "--kubeconfig", alice)
        seen.append(out + err)
        return out if code == 0 and "position 2" in out else None

    try:
        out = wait_for("the visibility API to place 'third' behind 'second'", placed)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status said last:\n{seen[-1] if seen else ''}") from None
    assert "job third in team-research: Queued" in out
    assert f"position 2 in queue {queue}, 2 in its cluster queue" in out
    assert "Kueue: couldn't assign flavors to pod set worker" in out
    assert "insufficient unused quota for nvidia.com/gpu in flavor l4-spot" in out
    code, out, err = cli("status", "second", "--kubeconfig", alice)
    assert code == 0 and f"position 1 in queue {queue}, 1 in its cluster queue" in out, out + err
    # A viewer of the team reads the same position through her own identity.
    code, out, err = cli("status", "third", "--kubeconfig", platform.kubeconfigs["vera"])
    assert code == 0 and f"position 2 in queue {queue}" in out, out + err


def test_without_kueues_visibility_api_status_says_why_and_keeps_the_rest(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="holder", nodes="4:4")[0] == 0
    wait_for("'holder' admitted", lambda: admitted(platform, "holder"))
    assert submit(cli, platform, tmp_path, name="waiting", nodes="2:2")[0] == 0
    wait_for("Kueue to leave 'waiting' pending", lambda: pending(platform, "waiting"))
    services = platform.plane.client().resources.get(api_version=APISERVICE[0], kind=APISERVICE[1])
    saved = services.get(name=VISIBILITY_API).to_dict()
    services.delete(name=VISIBILITY_API)
    try:
        # A cluster whose Kueue serves no visibility API (the chart's visibility server off): the API server
        # answers 404 for the group.
        out = wait_for("status without the visibility API", lambda: (
            (r := cli("status", "waiting", "--kubeconfig", platform.kubeconfigs["alice"]))[0] == 0
            and "queue position unknown" in r[1] and r[1]))
        assert "queue position unknown (Kueue's visibility API: 404 Not Found)" in out
        assert "job waiting in team-research: Queued" in out and "insufficient unused quota" in out
    finally:
        saved["metadata"] = {"name": VISIBILITY_API}
        saved.pop("status", None)
        services.create(body=saved)
        wait_for("the visibility API back", lambda: any(
            c["type"] == "Available" and c["status"] == "True"
            for c in (services.get(name=VISIBILITY_API).to_dict().get("status") or {}).get("conditions") or []))


def test_a_running_jobs_status_shows_its_ranks_and_asks_rank_0_through_the_pod_proxy(platform, cli, tmp_path,
                                                                                      clean):
    assert submit(cli, platform, tmp_path, name="watched", nodes="2:2")[0] == 0
    wait_for("both ranks Running", lambda: len(running_pods(platform, "watched")) == 2)
    code, out, err = cli("status", "watched", "--kubeconfig", platform.kubeconfigs["vera"])
    assert code == 0, err
    assert "job watched in team-research: Running" in out
    assert "admitted by cluster queue team-research on pool l4-spot" in out
    for rank in (0, 1):
        pod = rank_pod(platform, "watched", rank)
        assert f"rank {rank}  {pod.metadata.name}  Running" in out
    # The viewer is authorized for the pod proxy (a 403 would end the command with an error); the API server then
    # refuses to dial the pod's loopback address, and status says so instead of a progress line.
    assert "no progress yet:" in out and "address not allowed" in out
    # Someone without a role in the team gets the API server's refusal, and no traceback.
    code, _, err = cli("status", "watched", "--kubeconfig", platform.kubeconfigs["mallory"])
    assert code == 1 and err.startswith("gpu-train: error: ") and "forbidden" in err.lower(), err


# ------------------------------------------------------------------------------------------ logs from pods


def test_a_running_ranks_log_comes_from_its_pod(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="chatty", nodes="2:2")[0] == 0
    wait_for("both ranks Running", lambda: len(running_pods(platform, "chatty")) == 2)
    for rank in (0, 1):
        pod = rank_pod(platform, "chatty", rank)
        platform.plane.apply([pod_log(NS, pod.metadata.name, CONTAINER,
                                      f"rank {rank} step 1\nrank {rank} step 2\nrank {rank} step 3\n",
                                      tmp_path / f"rank{rank}.log")])
    alice, vera = platform.kubeconfigs["alice"], platform.kubeconfigs["vera"]
    out = wait_for("rank 1's log served", lambda: (
        (r := cli("logs", "chatty", "--rank", "1", "--tail", "2", "--kubeconfig", alice))[0] == 0 and r[1]))
    assert out == "rank 1 step 2\nrank 1 step 3\n"  # rank 1's own pod, its last 2 lines
    # A viewer may read logs too, and follow them: the stream stays open while the container runs (as a
    # kubelet's does), so the command is its own process, read until rank 0's three lines have come.
    follow = subprocess.Popen([sys.executable, "-m", "gpu_train.cli", "logs", "chatty", "-f", "--kubeconfig", str(vera)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stuck = threading.Timer(90, follow.kill)  # a stream that never delivers ends the wait, and the test fails
    stuck.start()
    try:
        lines = [follow.stdout.readline() for _ in range(3)]
    finally:
        stuck.cancel()
        follow.kill()
        follow.communicate()
    assert lines == ["rank 0 step 1\n", "rank 0 step 2\n", "rank 0 step 3\n"]
    code, _, err = cli("logs", "chatty", "--kubeconfig", platform.kubeconfigs["mallory"])
    assert code == 1 and err.startswith("gpu-train: error: ") and "forbidden" in err.lower(), err


def test_a_pending_pod_has_no_log_yet(platform, cli, tmp_path, clean):
    """Every l4-spot node cordoned: Kueue admits the job on quota, the scheduler cannot place its pod."""
    core = platform.core()
    pool = [n["metadata"]["name"] for n in platform.nodes
            if n["metadata"]["labels"].get(naming.POOL_LABEL) == "l4-spot"]
    for node in pool:
        core.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        assert submit(cli, platform, tmp_path, name="stuck", nodes="1:1")[0] == 0
        wait_for("'stuck' admitted with its pod Pending", lambda: admitted(platform, "stuck") and any(
            p.status.phase == "Pending" for p in pods_of(platform, "stuck")))
        code, _, err = cli("logs", "stuck", "--kubeconfig", platform.kubeconfigs["alice"])
        assert code == 1 and err.startswith("gpu-train: error: ") and "has not started yet (Pending" in err, err
    finally:
        for node in pool:
            core.patch_node(node, {"spec": {"unschedulable": False}})


# ------------------------------------------------------------------------------------------ logs from the store


@pytest.fixture
def paused(platform, cli, tmp_path, clean) -> str:
    """'gone' submitted by alice and paused at once: Kueue keeps it, and it has no pod, so its log comes from
    the log store. Returns alice's kubeconfig."""
    alice = str(platform.kubeconfigs["alice"])
    assert submit(cli, platform, tmp_path, name="gone", nodes="2:2")[0] == 0
    wait_for("Kueue's Workload for 'gone'", lambda: workload_of(platform, "gone"))
    assert cli("pause", "gone", "--kubeconfig", alice)[0] == 0
    # Kueue may have admitted it just before the pause: wait until it holds no quota for it, its JobSet is
    # suspended and no pod is left.
    wait_for("'gone' evicted, suspended and without pods", lambda: not is_true(workload_of(platform, "gone"),
             "QuotaReserved") and jobset_of(platform, "gone")["spec"]["suspend"] is True and not pods_of(platform, "gone"))
    return alice


@pytest.fixture
def cloudwatch(monkeypatch):
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    # moto keeps its backends in the process: start every test from an empty account.
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).read()
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)  # botocore's endpoint override, read by the command's client
    try:
        yield boto3.client("logs", region_name="us-east-1", endpoint_url=url)
    finally:
        server.stop()


def _stream(pod_name: str, container: str) -> str:
    """The stream Fluent Bit writes a container's log file to, per the shipper's configuration: its
    log_stream_prefix + the tail input's tag of /var/log/containers/<pod>_<namespace>_<container>-<id>.log."""
    store = LogStore(kind="cloudwatch", region="us-east-1", groups={NS: "g"},
                     shipper=WorkloadIdentity(namespaces=["logging"], name="fluent-bit"), endpoint_cidrs=["10.0.0.0/16"])
    conf = log_shipping.outputs_config(store)
    prefix = next(line.split()[1] for line in conf.splitlines() if line.strip().startswith("log_stream_prefix"))
    tag_prefix = log_shipping.fluent_bit_values(store)["input"]["tag"].rstrip("*")
    path = f"/var/log/containers/{pod_name}_{NS}_{container}-0123456789abcdef.log"
    return prefix + tag_prefix + path.lstrip("/").replace("/", ".")


def test_a_gone_ranks_log_comes_from_cloudwatch(platform, paused, cli, cloudwatch):
    group = platform.contract["logs"]["groups"][NS]
    cloudwatch.create_log_group(logGroupName=group)
    now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    streams = {
        _stream("gone-worker-0-1-aaaaa", "trainer"): ["rank 1 first pod: step 10", "rank 1 first pod: died"],
        _stream("gone-worker-0-1-bbbbb", "trainer"): ["rank 1 second pod: resumed at step 10"],
        _stream("gone-worker-0-1-bbbbb", "tcpx-daemon"): ["a sidecar line"],
        _stream("gone-worker-0-0-ccccc", "trainer"): ["rank 0 line"],
        _stream("gone-worker-0-12-ddddd", "trainer"): ["rank 12 line"],
    }
    t = now - 60_000
    for name, lines in streams.items():
        cloudwatch.create_log_stream(logGroupName=group, logStreamName=name)
        cloudwatch.put_log_events(logGroupName=group, logStreamName=name,
                                  logEvents=[{"timestamp": (t := t + 1000), "message": m} for m in lines])
    code, out, err = cli("logs", "gone", "--rank", "1", "--kubeconfig", paused)
    assert code == 0, err
    assert out.splitlines() == ["# rank 1 of job 'gone' has no pod now; its log from the platform's log store:",
                                "rank 1 first pod: step 10", "rank 1 first pod: died",
                                "rank 1 second pod: resumed at step 10"]
    code, out, _ = cli("logs", "gone", "--rank", "1", "--container", "tcpx-daemon", "--kubeconfig", paused)
    assert code == 0 and out.splitlines()[1:] == ["a sidecar line"]


def test_cloudwatch_with_nothing_to_show_or_no_group(platform, paused, cli, cloudwatch):
    group = platform.contract["logs"]["groups"][NS]
    code, _, err = cli("logs", "gone", "--kubeconfig", paused)
    assert code == 1 and err.startswith("gpu-train: error: ") and f"log group {group} does not exist" in err, err
    cloudwatch.create_log_group(logGroupName=group)
    code, _, err = cli("logs", "gone", "--rank", "3", "--since", "2h", "--kubeconfig", paused)
    assert code == 1 and "no log of rank 3 of job 'gone'" in err and "since 2:00:00" in err
    code, _, err = cli("logs", "gone", "--since", "yesterday", "--kubeconfig", paused)
    assert code == 2 and "--since 'yesterday' is not a duration" in err


class _Recorded(BaseHTTPRequestHandler):
    pages: list[dict] = []
    requests: list[dict] = []

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body})
        page = self.pages[1] if body.get("pageToken") == self.pages[0].get("nextPageToken") else self.pages[0]
        data = json.dumps(page).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def recorded_logging(monkeypatch):
    from google.auth.credentials import AnonymousCredentials

    with warnings.catch_warnings():  # google-api-core's notice about Python versions nearing their end of life
        warnings.simplefilter("ignore", FutureWarning)
        from google.cloud import logging as gcl

    _Recorded.pages = json.loads((FIXTURES / "cloud-logging-entries-list.json").read_text())["pages"]
    _Recorded.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    made = []

    def client(project: str):
        made.append(project)
        return gcl.Client(project=project, credentials=AnonymousCredentials(), _use_grpc=False,
                          client_options={"api_endpoint": url})

    monkeypatch.setattr(cli_logs, "cloud_logging_client", client)
    try:
        yield _Recorded.requests, made
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def gke_contract(platform):
    """The team's platform ConfigMap as a GKE stack publishes it (Cloud Logging), put back afterwards."""
    core = platform.core()
    saved = core.read_namespaced_config_map(naming.PLATFORM_CONFIGMAP, NS).data
    doc = {**platform.contract, "cloud": "gcp", "project": "acme-ml-prod",
           "logs": {"kind": "cloud-logging", "project": "acme-ml-prod", "cluster": "gpu-train-gcp-prod-gke"}}
    core.patch_namespaced_config_map(naming.PLATFORM_CONFIGMAP, NS,
                                     {"data": {naming.PLATFORM_CONFIGMAP_KEY: json.dumps(doc)}})
    yield doc
    core.patch_namespaced_config_map(naming.PLATFORM_CONFIGMAP, NS, {"data": saved})


def test_a_gone_ranks_log_comes_from_cloud_logging_on_gke(platform, paused, cli, gke_contract, recorded_logging):
    requests, made = recorded_logging
    code, out, err = cli("logs", "gone", "--rank", "1", "--kubeconfig", paused)
    assert code == 0, err
    assert out.splitlines()[1:] == ["[rank8]: step 1000 loss 3.2011 tokens/s 612,004",
                                    "[rank8]: NCCL WARN NET/FasTrak : Connection closed by remote peer",
                                    "torch.distributed.elastic.agent.server.api: worker group failed, restarting (1/10)"]
    assert made == ["acme-ml-prod"]
    first, second = requests
    assert first["path"].split("?")[0] == "/v2/entries:list" and second["body"]["pageToken"] == "EAE4-page-2"
    body = first["body"]
    assert body["resourceNames"] == ["projects/acme-ml-prod"] and body["orderBy"] == "timestamp asc"
    flt = body["filter"]
    for term in ('resource.type="k8s_container"', 'resource.labels.cluster_name="gpu-train-gcp-prod-gke"',
                 f'resource.labels.namespace_name="{NS}"', 'resource.labels.container_name="trainer"',
                 r'resource.labels.pod_name=~"^gone-worker-0-1-[a-z0-9]{5}$"', "timestamp>="):
        assert term in flt, flt
