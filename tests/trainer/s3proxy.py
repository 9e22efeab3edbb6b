"""An HTTP proxy in front of the local S3 server (moto) that injects storage faults on the wire, so botocore's
retries and the trainer's handling of refused or failing requests run against real HTTP.

Usage:
    proxy = FaultProxy(upstream=moto_endpoint)            # prefix="/api/v1/s3" serves it as the Alluxio proxy does
    with serving(proxy):                                  # sets proxy.endpoint
        proxy.fail_next(2, status=503, match="/shard_")   # the next 2 requests whose path matches get 503
        proxy.stall_next(1, seconds=3)                    # the next request stalls past the client's timeout
        proxy.stalling.wait(30)                           # ... which has begun (an event, set by the proxy)
        proxy.refuse = {"/step_000000004/"}               # every PUT whose path matches gets 403 AccessDenied
        proxy.unavailable = {"/manifest"}                 # every GET whose path matches gets 503 SlowDown
        proxy.refused, proxy.gets("/shard_")              # what was refused; successful GETs (counting)
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


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
    refuse: set[str] = field(default_factory=set)  # PUT paths containing one: 403 AccessDenied, every time
    unavailable: set[str] = field(default_factory=set)  # GET paths containing one: 503 SlowDown, every time
    refused: list[str] = field(default_factory=list)  # paths answered from `refuse` / `unavailable`
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stalling: threading.Event = field(default_factory=threading.Event)  # set when a stall begins

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
            self.refused.clear()
            self.refuse = set()
            self.unavailable = set()
            self.stalling.clear()

    def gets(self, match: str = "") -> list[Record]:
        with self.lock:
            return [r for r in self.records if r.method == "GET" and match in r.path and r.status < 300]

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            if method == "PUT" and any(f in path for f in self.refuse):
                self.refused.append(path)
                return Fault("denied", 1, path, status=403)
            if method == "GET" and any(f in path for f in self.unavailable):
                self.refused.append(path)
                return Fault("status", 1, path, status=503)
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
            fault = proxy._take_fault(self.command, path)
            if fault is not None and fault.kind == "stall":
                proxy.stalling.set()
                time.sleep(fault.stall_s)  # the client gives up first; its retry is a new connection
                self.close_connection = True
                return
            if fault is not None:
                code = "AccessDenied" if fault.kind == "denied" else "SlowDown"
                msg = f"<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>".encode()
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


@contextmanager
def serving(proxy: FaultProxy) -> Iterator[FaultProxy]:
    """Run the proxy on a free localhost port (proxy.endpoint, with its prefix) until the block ends."""
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
