"""`gpu-train logs`: from the rank's pod while it exists (the fake API server), and once it is gone from the log
store: CloudWatch Logs on a local moto server, holding the streams the Fluent Bit configuration of
infra/k8s/log_shipping.py names, and Cloud Logging from recorded entries.list responses served locally.

Run: .venv/bin/pytest tests/gpu_train/cli/test_logs.py -q
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import socket
import threading
import urllib.request
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest

from gpu_train.client import logs as cli_logs
from gpu_train.spec import naming
from infra.k8s import log_shipping
from infra.platform import LogStore, WorkloadIdentity
from tests.gpu_train.cli.conftest import ALICE, VIEWER, only_error_lines, requests_of, spec
from tests.gpu_train.cli.fake_api import pod

FIXTURES = Path(__file__).parent / "fixtures"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


@pytest.fixture
def submitted(api, tmp_path, cli):
    kubeconfig = api.kubeconfig(tmp_path, ALICE, "team-research")
    assert cli("submit", spec(tmp_path), "--kubeconfig", kubeconfig)[0] == 0
    api.requests.clear()
    return kubeconfig


def test_a_running_ranks_log_comes_from_its_pod(api, submitted, cli):
    js = api.get("jobsets", "team-research", "gpt2-smoke")
    old, new = pod(js, 1, suffix="aaaaa", created="2026-03-01T09:00:00Z"), pod(js, 1, suffix="bbbbb")
    for p in (old, new, pod(js, 0)):
        api.put("pods", p)
    api.logs[("team-research", new["metadata"]["name"], "trainer")] = "step 1\nstep 2\nstep 3\n"
    code, out, err = cli("logs", "gpt2-smoke", "--rank", "1", "--tail", "2", "--kubeconfig", submitted)
    assert code == 0, err
    assert out == "step 2\nstep 3\n"  # the newest pod of rank 1, its last 2 lines
    (listing,) = [r for r in requests_of(api, "GET", "/pods") if r[1].endswith("/pods")]
    assert listing[2]["labelSelector"] == ["jobset.sigs.k8s.io/jobset-name=gpt2-smoke,"
                                           "batch.kubernetes.io/job-completion-index=1"]
    (read,) = requests_of(api, "GET", "/log")
    assert read[1] == f"/api/v1/namespaces/team-research/pods/{new['metadata']['name']}/log"
    assert read[2]["container"] == ["trainer"]
    # A viewer may read logs too.
    code, out, _ = cli("logs", "gpt2-smoke", "--rank", "1", "-f", "--kubeconfig",
                       api.kubeconfig(Path(submitted).parent, VIEWER, "team-research"))
    assert code == 0 and out == "step 1\nstep 2\nstep 3\n"
    # The API server reads query booleans with Go's strconv.ParseBool.
    assert requests_of(api, "GET", "/log")[-1][2]["follow"][0] in ("1", "t", "T", "TRUE", "true", "True")


def test_a_pending_pod_has_no_log_yet(api, submitted, cli):
    api.put("pods", pod(api.get("jobsets", "team-research", "gpt2-smoke"), 0, phase="Pending"))
    code, _, err = cli("logs", "gpt2-smoke", "--kubeconfig", submitted)
    assert code == 1 and only_error_lines(err) and "has not started yet (Pending" in err


# ------------------------------------------------------------------------------------------ CloudWatch Logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cloudwatch(monkeypatch):
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
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


def _stream(pod_name: str, container: str, namespace: str = "team-research") -> str:
    """The stream Fluent Bit writes a container's log file to, per the shipper's configuration: its
    log_stream_prefix + the tail input's tag of /var/log/containers/<pod>_<namespace>_<container>-<id>.log."""
    store = LogStore(kind="cloudwatch", region="us-east-1", groups={namespace: "g"},
                     shipper=WorkloadIdentity(namespaces=["logging"], name="fluent-bit"), endpoint_cidrs=["10.0.0.0/16"])
    conf = log_shipping.outputs_config(store)
    prefix = next(line.split()[1] for line in conf.splitlines() if line.strip().startswith("log_stream_prefix"))
    values = log_shipping.fluent_bit_values(store)
    tag_prefix = values["input"]["tag"].rstrip("*")
    path = f"/var/log/containers/{pod_name}_{namespace}_{container}-0123456789abcdef.log"
    return prefix + tag_prefix + path.lstrip("/").replace("/", ".")


def test_a_gone_ranks_log_comes_from_cloudwatch(api, submitted, cli, cloudwatch):
    group = "/gpu-train/gpu-train-aws-dev/team-research"
    cloudwatch.create_log_group(logGroupName=group)
    now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    streams = {
        _stream("gpt2-smoke-worker-0-1-aaaaa", "trainer"): ["rank 1 first pod: step 10", "rank 1 first pod: died"],
        _stream("gpt2-smoke-worker-0-1-bbbbb", "trainer"): ["rank 1 second pod: resumed at step 10"],
        _stream("gpt2-smoke-worker-0-1-bbbbb", "tcpx-daemon"): ["a sidecar line"],
        _stream("gpt2-smoke-worker-0-0-ccccc", "trainer"): ["rank 0 line"],
        _stream("gpt2-smoke-worker-0-12-ddddd", "trainer"): ["rank 12 line"],
    }
    t = now - 60_000
    for name, lines in streams.items():
        cloudwatch.create_log_stream(logGroupName=group, logStreamName=name)
        cloudwatch.put_log_events(logGroupName=group, logStreamName=name,
                                  logEvents=[{"timestamp": (t := t + 1000), "message": m} for m in lines])
    code, out, err = cli("logs", "gpt2-smoke", "--rank", "1", "--kubeconfig", submitted)
    assert code == 0, err
    assert out.splitlines() == ["# rank 1 of job 'gpt2-smoke' has no pod now; its log from the platform's log store:",
                                "rank 1 first pod: step 10", "rank 1 first pod: died",
                                "rank 1 second pod: resumed at step 10"]
    code, out, _ = cli("logs", "gpt2-smoke", "--rank", "1", "--container", "tcpx-daemon", "--kubeconfig", submitted)
    assert code == 0 and out.splitlines()[1:] == ["a sidecar line"]
    # The contract was read only because the pod was gone.
    assert requests_of(api, "GET", "/configmaps/gpu-train-platform")


def test_cloudwatch_with_nothing_to_show_or_no_group(api, submitted, cli, cloudwatch):
    code, _, err = cli("logs", "gpt2-smoke", "--kubeconfig", submitted)
    assert code == 1 and only_error_lines(err)
    assert "log group /gpu-train/gpu-train-aws-dev/team-research does not exist" in err
    cloudwatch.create_log_group(logGroupName="/gpu-train/gpu-train-aws-dev/team-research")
    code, _, err = cli("logs", "gpt2-smoke", "--rank", "3", "--since", "2h", "--kubeconfig", submitted)
    assert code == 1 and "no log of rank 3 of job 'gpt2-smoke'" in err and "since 2:00:00" in err
    code, _, err = cli("logs", "gpt2-smoke", "--since", "yesterday", "--kubeconfig", submitted)
    assert code == 2 and "--since 'yesterday' is not a duration" in err


# ------------------------------------------------------------------------------------------ Cloud Logging


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


def test_a_gone_ranks_log_comes_from_cloud_logging_on_gke(api, submitted, cli, doc, recorded_logging):
    requests, made = recorded_logging
    doc.update(cloud="gcp", project="acme-ml-prod",
               logs={"kind": "cloud-logging", "project": "acme-ml-prod", "cluster": "gpu-train-gcp-prod-gke"})
    api.put_configmap("team-research", "gpu-train-platform", {"platform.json": json.dumps(doc)})
    code, out, err = cli("logs", "gpt2-smoke", "--rank", "1", "--kubeconfig", submitted)
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
                 'resource.labels.namespace_name="team-research"', 'resource.labels.container_name="trainer"',
                 r'resource.labels.pod_name=~"^gpt2\-smoke-worker-0-1-[a-z0-9]{5}$"', "timestamp>="):
        assert term in flt, flt


def test_the_cloud_logging_pod_pattern_selects_only_that_rank():
    import re

    flt = cli_logs.cloud_logging_filter("c", naming.team_namespace("r"), "trainer", "llm", 1, "2026-01-01T00:00:00Z")
    pattern = re.search(r'pod_name=~"([^"]+)"', flt).group(1)
    assert re.fullmatch(pattern, "llm-worker-0-1-q8z2c")
    assert not re.fullmatch(pattern, "llm-worker-0-12-q8z2c") and not re.fullmatch(pattern, "llm2-worker-0-1-q8z2c")
