"""Fixtures for the data path tests: a real local S3 server (moto) behind a fault-injecting HTTP proxy.

Run: ``.venv/bin/pytest tests/trainer/data -q``. The proxy forwards every request to moto over real HTTP,
records (method, path, query, headers) for request counting, and on demand answers 503 or stalls past the
client's read timeout, so retries are exercised on the wire rather than by patching botocore. A second
instance (``cache_proxy``) serves the API under ``/api/v1/s3``, the path of the Alluxio S3 proxy.
"""

from __future__ import annotations

import http.client
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import boto3
import pytest
from moto.server import ThreadedMotoServer

from trainer.distributed import free_port

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class Fault:
    kind: str  # "status" or "stall"
    remaining: int
    match: str  # substring of the path that the fault applies to
    status: int = 503
    stall_s: float = 0.0


@dataclass
class Record:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    status: int


@dataclass
class FaultProxy:
    upstream: str
    endpoint: str = ""
    prefix: str = ""  # served under this path (the Alluxio proxy's /api/v1/s3), stripped when forwarding
    # Sent upstream in place of the client's (absent) Authorization: the proxy reads the object store
    # with its own identity, as the Alluxio proxy does. The local S3 server does not check signatures.
    upstream_auth: str = ""
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_next(self, n: int, status: int = 503, match: str = "") -> None:
        with self.lock:
            self.faults.append(Fault("status", n, match, status=status))

    def stall_next(self, n: int, seconds: float, match: str = "") -> None:
        with self.lock:
            self.faults.append(Fault("stall", n, match, stall_s=seconds))

    def reset(self) -> None:
        with self.lock:
            self.records.clear()
            self.faults.clear()

    def gets(self, match: str = "") -> list[Record]:
        with self.lock:
            return [r for r in self.records if r.method == "GET" and match in r.path and r.status < 300]

    def _take_fault(self, path: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.remaining > 0 and f.match in path:
                    f.remaining -= 1
                    return f
        return None


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    up = urlsplit(proxy.upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            return None

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if proxy.prefix:
                if not self.path.startswith(proxy.prefix + "/"):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.path = self.path[len(proxy.prefix) :]
            path, _, query = self.path.partition("?")
            headers = {k: v for k, v in self.headers.items()}
            fault = proxy._take_fault(path)
            if fault is not None and fault.kind == "stall":
                time.sleep(fault.stall_s)  # the client gives up first; its retry is a new connection
                self.close_connection = True
                return
            if fault is not None:
                msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                self.send_response(fault.status)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                with proxy.lock:
                    proxy.records.append(Record(self.command, path, query, headers, fault.status))
                return
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
            try:
                fwd = {k: v for k, v in headers.items() if k.lower() not in ("connection", "keep-alive")}
                if proxy.upstream_auth and "Authorization" not in fwd:
                    fwd["Authorization"] = proxy.upstream_auth
                conn.request(self.command, self.path, body=body, headers=fwd)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                with proxy.lock:
                    proxy.records.append(Record(self.command, path, query, headers, resp.status))
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _proxy_server(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream=moto_endpoint)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    httpd.daemon_threads = True
    proxy.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session")
def _cache_proxy_server(moto_endpoint: str) -> Iterator[FaultProxy]:
    """The same forwarding proxy, serving the S3 API under /api/v1/s3 as the Alluxio proxy does."""
    proxy = FaultProxy(
        upstream=moto_endpoint,
        prefix="/api/v1/s3",
        upstream_auth="AWS4-HMAC-SHA256 Credential=cache-proxy/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=" + "0" * 64,
    )
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    httpd.daemon_threads = True
    proxy.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}{proxy.prefix}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def cache_proxy(_cache_proxy_server: FaultProxy, aws_env: None) -> Iterator[FaultProxy]:
    _cache_proxy_server.reset()
    yield _cache_proxy_server
    _cache_proxy_server.reset()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in _AWS_ENV.items():
        monkeypatch.setenv(k, v)
    for k in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "TRAINER_S3_ENDPOINT_URL",
        "AWS_RETRY_MODE",
        "AWS_MAX_ATTEMPTS",
        "TRAINER_S3_AUTH",
        "TRAINER_CACHE_DIR",
        "TRAINER_MEMORY_DIR",
    ):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def proxy(_proxy_server: FaultProxy, aws_env: None) -> Iterator[FaultProxy]:
    _proxy_server.reset()
    yield _proxy_server
    _proxy_server.reset()


@pytest.fixture
def bucket(moto_endpoint: str, aws_env: None) -> str:
    name = f"data-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name
