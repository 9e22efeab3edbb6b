"""Fixtures for the data path tests: the session's local S3 server (moto) behind a fault-injecting HTTP proxy
(tests/trainer/s3proxy.py).

Run: ``.venv/bin/pytest tests/trainer/data -q``. The proxy forwards every request to moto over real HTTP,
records (method, path, query, headers) for request counting, and on demand answers 503 or stalls past the
client's read timeout, so retries are exercised on the wire rather than by patching botocore. A second
instance (``cache_proxy``) serves the API under ``/api/v1/s3``, the path of the Alluxio S3 proxy. ``corpus`` and
``reference`` are prepare's task-test corpus and its dataset from one local worker, once per module.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from tests.trainer.s3proxy import FaultProxy, serving

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def moto_endpoint(s3_server: str) -> str:
    """The session's local S3 server (tests/trainer/conftest.py)."""
    return s3_server


@pytest.fixture(scope="session")
def _proxy_server(moto_endpoint: str) -> Iterator[FaultProxy]:
    with serving(FaultProxy(upstream=moto_endpoint)) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def _cache_proxy_server(moto_endpoint: str) -> Iterator[FaultProxy]:
    """The same forwarding proxy, serving the S3 API under /api/v1/s3 as the Alluxio proxy does."""
    with serving(FaultProxy(
        upstream=moto_endpoint,
        prefix="/api/v1/s3",
        upstream_auth="AWS4-HMAC-SHA256 Credential=cache-proxy/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=" + "0" * 64,
    )) as proxy:
        yield proxy


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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """prepare's task tests' corpus (tests/trainer/data/prepare_corpus.py), once per test module."""
    from tests.trainer.data.prepare_corpus import make_corpus

    return make_corpus(tmp_path_factory.mktemp("prepare-corpus") / "in")


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory) -> dict[str, str]:
    """The dataset made in this process, one task after the other: what every other run must equal."""
    from tests.trainer.data.prepare_corpus import SHARD_TOKENS, TASKS, tree_sha
    from trainer.data.prepare import prepare

    out = tmp_path_factory.mktemp("reference") / "ds"
    prepare([corpus], f"file://{out}", shard_tokens=SHARD_TOKENS, tasks=TASKS, val_fraction=0.1, workers=1)
    return tree_sha(out)
