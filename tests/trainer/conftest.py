"""Fixtures of the trainer tests: a real local S3 server (moto) standing in for the checkpoint store, and a
proxy in front of it that refuses chosen uploads, standing in for one node that cannot write to the store.

Usage: a test takes `s3` (endpoint, bucket, env with credentials) or `failing_s3` (the same plus a proxy
endpoint whose `refuse` set holds path fragments: a PUT whose path contains one gets 403 AccessDenied; and
whose `unavailable` set makes a GET whose path contains one get 503 SlowDown, a transient error). Every test
session gets its own shared shard cache (TRAINER_CACHE_DIR), so runs never read or write ~/.cache.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest

from tests.trainer.s3proxy import FaultProxy, serving
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


@pytest.fixture
def failing_s3(s3) -> Iterator[tuple[S3, FaultProxy]]:
    with serving(FaultProxy(upstream=s3.endpoint)) as proxy:
        yield s3, proxy
