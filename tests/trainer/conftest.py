"""Fixtures of the trainer tests: a real local S3 server (moto) standing in for the checkpoint store, and a
proxy in front of it that refuses chosen uploads, standing in for one node that cannot write to the store.

Usage: a test takes `s3` (endpoint, bucket, env with credentials) or `failing_s3` (the same plus a proxy
endpoint whose `refuse` set holds path fragments: a PUT whose path contains one gets 403 AccessDenied; and
whose `unavailable` set makes a GET whose path contains one get 503 SlowDown, a transient error). Every test
session gets its own shared shard cache (TRAINER_CACHE_DIR), so runs never read or write ~/.cache.
"""

from __future__ import annotations

import http.client
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import boto3
import pytest

from trainer.distributed import free_port

CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class S3:
    endpoint: str
    bucket: str
    env: dict[str, str]

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="session", autouse=True)
def shared_shard_cache(tmp_path_factory) -> Iterator[str]:
    """The trainer's shared shard cache (data.cache_dir "") lives in the session's temporary directory, not in
    the user's ~/.cache; trainer processes inherit it through the environment (tests/trainer/launch.py)."""
    import os

    saved = os.environ.get("TRAINER_CACHE_DIR")
    path = str(tmp_path_factory.mktemp("shard-cache"))
    os.environ["TRAINER_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("TRAINER_CACHE_DIR", None)
        else:
            os.environ["TRAINER_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server) -> S3:
    """A fresh bucket on the shared local S3 server."""
    store = S3(s3_server, f"ckpt-{uuid.uuid4().hex[:10]}", dict(CREDS))
    store.client().create_bucket(Bucket=store.bucket)
    return store


@dataclass
class FailingProxy:
    upstream: str
    endpoint: str = ""
    refuse: set[str] = field(default_factory=set)
    unavailable: set[str] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(proxy: FailingProxy) -> type[BaseHTTPRequestHandler]:
    up = urlsplit(proxy.upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            return None

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            with proxy.lock:
                denied = self.command == "PUT" and any(f in self.path for f in proxy.refuse)
                down = self.command == "GET" and any(f in self.path for f in proxy.unavailable)
                if denied or down:
                    proxy.refused.append(self.path)
            if denied or down:
                code, status = ("AccessDenied", 403) if denied else ("SlowDown", 503)
                msg = f"<Error><Code>{code}</Code><Message>refused by the test proxy</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body, headers=headers)
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
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


@pytest.fixture
def failing_s3(s3) -> Iterator[tuple[S3, FailingProxy]]:
    proxy = FailingProxy(upstream=s3.endpoint)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    httpd.daemon_threads = True
    proxy.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield s3, proxy
    finally:
        httpd.shutdown()
        httpd.server_close()
