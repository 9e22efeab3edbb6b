"""Object storage behind one small interface: file://, s3:// and gs:// (plus any S3-compatible endpoint). The
trainer's data path and checkpoints and the sweep controller read and write through it; it needs boto3 and nothing
of torch.

Use::

    from gpu_train.storage import open_store
    store = open_store("s3://bucket/datasets/web", endpoint_url=None)
    raw = store.get_bytes("manifest.json")
    store.download("shard-000000.bin", "/nvme/cache/x.part")      # atomic: tmp file + rename
    store.upload("/tmp/ckpt/model.pt", "ckpt/step-100/model.pt")   # multipart above 64 MiB

Endpoints: ``endpoint_url`` (e.g. the in-cluster Alluxio S3 proxy, http://alluxio-proxy.alluxio:39999/api/v1/s3)
or, when it is None, env ``TRAINER_S3_ENDPOINT_URL``; a custom endpoint gets path-style addressing.
``gs://`` goes through GCS's S3-compatible XML API at https://storage.googleapis.com with the same boto3
code (see docs/data.md for why). Credentials come only from the SDKs' default chains (env, web identity,
instance metadata); for gs:// without HMAC keys in the env, an OAuth2 token from the GKE metadata server
(workload identity) is sent as ``Authorization: Bearer``.

Request signing (``StoreOptions.auth``, env ``TRAINER_S3_AUTH``): ``auto`` (default) sends unsigned
requests to an Alluxio S3 proxy (an endpoint whose path ends in ``/api/v1/s3``) and signs everything else;
``unsigned`` and ``sigv4`` force one or the other. The Alluxio S3 API has no access keys: it reads the
``Authorization`` header only for a user name and otherwise acts as the proxy's own user
(https://docs.alluxio.io/os/user/2.9.5/en/api/S3-API.html), so an unsigned request is what it expects,
and it needs no AWS credentials, which a GKE pod does not have.

Retries: botocore's own retry handler (``standard`` mode by default, or ``adaptive``; env AWS_RETRY_MODE
and AWS_MAX_ATTEMPTS are honoured) with connect/read timeouts. ``retry_transient`` adds a bounded,
jittered retry around whole operations for errors that outlive botocore's attempts.

Over 400 lines because it is the one object-store layer the trainer, the CLI and the sweep controller share: the
interface, the retries and three stores whose behaviour must agree key for key (the S3 store also serves gs:// and
its token).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

from gpu_train.spec.values import as_uri


class DataError(Exception):
    """Base class for every error of the data path: the object stores' here, the dataset's in trainer.data."""

ENDPOINT_ENV = "TRAINER_S3_ENDPOINT_URL"
AUTH_ENV = "TRAINER_S3_AUTH"
AUTH_MODES = ("auto", "sigv4", "unsigned")
ALLUXIO_S3_PATH = "/api/v1/s3"  # where the Alluxio proxy serves its S3 REST API
GCS_XML_ENDPOINT = "https://storage.googleapis.com"
MiB = 1 << 20

T = TypeVar("T")


class StorageError(DataError):
    """An object-store operation failed; the message names the full URI. ``transient``: worth retrying."""

    def __init__(self, message: str, *, uri: str, transient: bool = False) -> None:
        super().__init__(message)
        self.uri = uri
        self.transient = transient


class ObjectNotFoundError(StorageError):
    """The object (or bucket) does not exist."""


class ObjectExistsError(StorageError):
    """A create-only write found an object already at the key (HTTP 412 to ``If-None-Match: *``)."""


@dataclass(frozen=True)
class StoreOptions:
    """Client tuning; the defaults suit large sequential shard reads."""

    retry_mode: str = field(default_factory=lambda: os.environ.get("AWS_RETRY_MODE", "standard"))
    max_attempts: int = field(default_factory=lambda: int(os.environ.get("AWS_MAX_ATTEMPTS", "8")))
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    region: str | None = None
    addressing_style: str | None = None  # "path" | "virtual" | "auto"; custom endpoints default to "path"
    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 16 * MiB
    max_concurrency: int = 8
    max_pool_connections: int = 32
    # "auto": unsigned to an Alluxio S3 proxy, signed elsewhere; "sigv4"; "unsigned" (no credentials needed)
    auth: str = field(default_factory=lambda: os.environ.get(AUTH_ENV, "auto"))


@dataclass(frozen=True)
class RetryPolicy:
    """Outer retry around a whole operation: full-jitter exponential backoff, bounded attempts."""

    attempts: int = 5
    base_s: float = 1.0
    cap_s: float = 30.0

    def delay(self, attempt: int) -> float:
        # "Full jitter": https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/
        return random.uniform(0, min(self.cap_s, self.base_s * 2**attempt))


def retry_transient(
    fn: Callable[[], T], policy: RetryPolicy, on_retry: Callable[[Exception], None] | None = None
) -> T:
    """Run ``fn``; on a transient StorageError sleep and try again, at most ``policy.attempts`` times."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except StorageError as exc:
            if not exc.transient or attempt == policy.attempts - 1:
                raise
            if on_retry is not None:
                on_retry(exc)
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable: the loop returns or raises")


class Store(Protocol):
    uri: str

    def url_of(self, key: str) -> str: ...
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...
    def download(self, key: str, dest_path: str | os.PathLike[str]) -> None: ...
    def upload(self, src_path: str | os.PathLike[str], key: str) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def put_if_absent(self, key: str, data: bytes | os.PathLike[str]) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def delete_prefix(self, prefix: str) -> None: ...


def is_cache_proxy(endpoint: str | None) -> bool:
    """True for an Alluxio S3 proxy endpoint (its path ends in /api/v1/s3)."""
    return bool(endpoint) and urlparse(endpoint).path.rstrip("/").endswith(ALLUXIO_S3_PATH)


def signs_requests(auth: str, endpoint: str | None) -> bool:
    """Whether requests to ``endpoint`` are SigV4-signed under ``auth`` (see the module docstring)."""
    if auth not in AUTH_MODES:
        raise StorageError(
            f"S3 auth mode must be one of {', '.join(AUTH_MODES)} (got {auth!r}; env {AUTH_ENV})",
            uri=endpoint or "",
        )
    return auth == "sigv4" or (auth == "auto" and not is_cache_proxy(endpoint))


def open_store(uri: str, endpoint_url: str | None = None, options: StoreOptions | None = None) -> Store:
    """A store rooted at ``uri`` (file:///abs/dir, s3://bucket/prefix, gs://bucket/prefix, or a plain path)."""
    uri = as_uri(uri)
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise StorageError(f"{uri}: file URIs must be absolute, file:///abs/dir", uri=uri)
        return FileStore(Path(parsed.path))
    if parsed.scheme in ("s3", "gs"):
        if not parsed.netloc:
            raise StorageError(f"{uri}: missing bucket name", uri=uri)
        endpoint = endpoint_url or os.environ.get(ENDPOINT_ENV) or None
        opts = options or StoreOptions()
        signs_requests(opts.auth, endpoint)  # reject a bad mode here, naming it, not at the first request
        return S3Store(parsed.scheme, parsed.netloc, parsed.path.strip("/"), endpoint, opts)
    raise StorageError(
        f"{uri}: unsupported URI scheme {parsed.scheme!r} (use file://, s3:// or gs://)", uri=uri
    )


def _tmp_name(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part")


class FileStore:
    """A local (or network-mounted) directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = f"file://{root}"

    def url_of(self, key: str) -> str:
        return f"file://{self._path(key)}"

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in Path(key).parts:
            raise StorageError(f"{self.uri}: key {key!r} escapes the store root", uri=self.uri)
        return self.root / key if key else self.root

    def _missing(self, key: str, exc: OSError) -> StorageError:
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"{self.url_of(key)}: not found", uri=self.url_of(key))
        return StorageError(f"{self.url_of(key)}: {exc}", uri=self.url_of(key))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start or 0)
                return f.read() if end is None else f.read(max(0, end - (start or 0)))
        except OSError as exc:
            raise self._missing(key, exc) from exc

    def download(self, key: str, dest_path: str | os.PathLike[str]) -> None:
        dest = Path(dest_path)
        tmp = _tmp_name(dest)
        try:
            shutil.copyfile(self._path(key), tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._missing(key, exc) from exc

    def upload(self, src_path: str | os.PathLike[str], key: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_name(dest)
        try:
            shutil.copyfile(src_path, tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(
                f"{self.url_of(key)}: upload of {src_path} failed: {exc}", uri=self.url_of(key)
            ) from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_name(dest)
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    def put_if_absent(self, key: str, data: bytes | os.PathLike[str]) -> bool:
        """Create ``key`` from bytes or a file only if nothing is there (False if something is). The whole object is
        written to a temporary file first and hard-linked into place, which fails if the name exists: a reader sees
        all of it or nothing, and of two writers exactly one succeeds."""
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_name(dest)
        try:
            if isinstance(data, bytes):
                tmp.write_bytes(data)
            else:
                shutil.copyfile(data, tmp)
            os.link(tmp, dest)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            raise StorageError(f"{self.url_of(key)}: create failed: {exc}", uri=self.url_of(key)) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix) and not Path(k).name.endswith(".part"))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self.delete(key)


# Error codes that S3 (and GCS's XML API) use for throttling or a transient server fault.
# https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests",
}  # fmt: skip


class S3Store:
    """s3:// (AWS or any S3-compatible endpoint) and gs:// (GCS XML API) through boto3."""

    def __init__(
        self, scheme: str, bucket: str, prefix: str, endpoint: str | None, options: StoreOptions
    ) -> None:
        self.scheme = scheme
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint or (GCS_XML_ENDPOINT if scheme == "gs" else None)
        self.options = options
        self.signed = signs_requests(options.auth, endpoint)
        self.uri = f"{scheme}://{bucket}/{prefix}".rstrip("/")
        self._lock = threading.Lock()
        self._client_pid = -1
        self._client: Any = None

    # -- client --------------------------------------------------------------------------------------
    def _new_client(self) -> Any:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        o = self.options
        custom = self.endpoint is not None
        addressing = o.addressing_style or ("path" if custom and self.scheme == "s3" else "auto")
        kwargs: dict[str, Any] = {
            "retries": {"mode": o.retry_mode, "max_attempts": o.max_attempts},
            "connect_timeout": o.connect_timeout,
            "read_timeout": o.read_timeout,
            "max_pool_connections": o.max_pool_connections,
            "s3": {"addressing_style": addressing},
        }
        if custom:
            # botocore >= 1.36 adds CRC checksums and aws-chunked uploads by default; GCS, Alluxio and older
            # S3 clones reject those, so only send checksums when an operation requires them.
            # https://github.com/boto/boto3/issues/4400
            kwargs["request_checksum_calculation"] = "when_required"
            kwargs["response_checksum_validation"] = "when_required"
        bearer = None
        if not self.signed:
            # No credential lookup at all: botocore skips the default chain for UNSIGNED clients.
            kwargs["signature_version"] = UNSIGNED
        elif self.scheme == "gs" and not os.environ.get("AWS_ACCESS_KEY_ID"):
            bearer = _GcsBearerToken()
            kwargs["signature_version"] = UNSIGNED
        region = o.region or ("auto" if self.scheme == "gs" else None)
        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=region, config=Config(**kwargs)
        )
        if bearer is not None:
            client.meta.events.register("before-send.s3", bearer.sign)
        if self.scheme == "gs":
            client.meta.events.register("before-sign.s3.PutObject", gcs_create_only)
        return client

    @property
    def client(self) -> Any:
        # boto3 clients are thread-safe but must not cross a fork: build one per process.
        if self._client is None or self._client_pid != os.getpid():
            with self._lock:
                if self._client is None or self._client_pid != os.getpid():
                    self._client = self._new_client()
                    self._client_pid = os.getpid()
        return self._client

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        o = self.options
        return TransferConfig(
            multipart_threshold=o.multipart_threshold,
            multipart_chunksize=o.multipart_chunksize,
            max_concurrency=o.max_concurrency,
        )

    # -- naming / errors -------------------------------------------------------------------------------
    def key_of(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url_of(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key_of(key)}"

    def _error(self, key: str, exc: Exception, action: str) -> StorageError:
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            HTTPClientError,
            NoCredentialsError,
        )

        url = self.url_of(key)
        where = f" via {self.endpoint}" if self.endpoint else ""
        # boto3's transfer manager wraps the botocore error (S3UploadFailedError, RetriesExceededError);
        # classify by the innermost cause we recognise.
        cause: BaseException | None = exc
        seen = exc
        while cause is not None:
            if isinstance(cause, ClientError | NoCredentialsError | ConnectionError | HTTPClientError):
                seen = cause
                break
            cause = cause.__cause__ or cause.__context__
        if isinstance(seen, ClientError):
            err = seen.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            msg = f"{url}{where}: {action} failed: {code or status} {err.get('Message', '')}".rstrip()
            if status == 404 or code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                return ObjectNotFoundError(msg, uri=url)
            if status == 412 or code == "PreconditionFailed":
                return ObjectExistsError(msg, uri=url)
            if code == "ConditionalRequestConflict":  # 409: a concurrent create of the same key is in flight
                return StorageError(msg, uri=url, transient=True)
            return StorageError(
                msg, uri=url, transient=status >= 500 or status == 429 or code in _TRANSIENT_CODES
            )
        if isinstance(seen, NoCredentialsError):
            return StorageError(
                f"{url}{where}: no credentials found in the environment or workload identity ({seen})",
                uri=url,
            )
        transient = (
            isinstance(seen, ConnectionError | HTTPClientError) or "RetriesExceeded" in type(exc).__name__
        )
        return StorageError(
            f"{url}{where}: {action} failed: {type(exc).__name__}: {exc}", uri=url, transient=transient
        )

    def _call(self, key: str, action: str, fn: Callable[[], T]) -> T:
        import boto3.exceptions
        import s3transfer.exceptions
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (
            ClientError,
            BotoCoreError,
            boto3.exceptions.Boto3Error,
            s3transfer.exceptions.RetriesExceededError,
            s3transfer.exceptions.S3DownloadFailedError,
            s3transfer.exceptions.S3UploadFailedError,
        ) as exc:
            raise self._error(key, exc, action) from exc

    # -- operations ------------------------------------------------------------------------------------
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Whole object, or bytes [start, end) through an HTTP Range request."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key_of(key)}
        if start is not None or end is not None:
            lo = start or 0
            if end is not None and end <= lo:
                return b""
            kwargs["Range"] = f"bytes={lo}-" + ("" if end is None else str(end - 1))

        def get() -> bytes:
            return self.client.get_object(**kwargs)["Body"].read()

        return self._call(key, "GET", get)

    def download(self, key: str, dest_path: str | os.PathLike[str]) -> None:
        dest = Path(dest_path)
        tmp = _tmp_name(dest)
        try:
            # Large objects come down as parallel ranged GETs (s3transfer), small ones as one GET.
            self._call(
                key,
                "download",
                lambda: self.client.download_file(
                    self.bucket, self.key_of(key), str(tmp), Config=self._transfer_config()
                ),
            )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def upload(self, src_path: str | os.PathLike[str], key: str) -> None:
        self._call(
            key,
            "upload",
            lambda: self.client.upload_file(
                str(src_path), self.bucket, self.key_of(key), Config=self._transfer_config()
            ),
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(
            key, "PUT", lambda: self.client.put_object(Bucket=self.bucket, Key=self.key_of(key), Body=data)
        )

    def put_if_absent(self, key: str, data: bytes | os.PathLike[str]) -> bool:
        """Create ``key`` only if no object has it: one PUT with ``If-None-Match: *`` (S3 conditional writes; on
        gs:// the same request carries ``x-goog-if-generation-match: 0``), False on 412. A single PUT, never a
        multipart upload, so the object appears whole or not at all (S3 takes up to 5 GB in one PUT)."""

        def put() -> None:
            with contextlib.nullcontext(data) if isinstance(data, bytes) else open(data, "rb") as body:
                self.client.put_object(Bucket=self.bucket, Key=self.key_of(key), Body=body, IfNoneMatch="*")

        try:
            self._call(key, "create", put)
        except ObjectExistsError:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        return [key for key, _, _ in self.list_objects(prefix)]

    def list_objects(self, prefix: str = "") -> list[tuple[str, int, str]]:
        """(key, size, etag) of the objects under ``prefix``, sorted by key (one LIST, no HEADs)."""
        base = f"{self.prefix}/" if self.prefix else ""
        # GCS's XML API speaks ListObjects (v1); S3 and its clones prefer v2.
        op = "list_objects" if self.scheme == "gs" else "list_objects_v2"

        def run() -> list[tuple[str, int, str]]:
            pages = self.client.get_paginator(op).paginate(Bucket=self.bucket, Prefix=base + prefix)
            return sorted((o["Key"][len(base) :], int(o["Size"]), str(o["ETag"]).strip('"'))
                          for page in pages for o in page.get("Contents", []))  # fmt: skip

        return self._call(prefix, "LIST", run)

    def etag(self, key: str) -> str:
        """The object's ETag (its content's identity: a changed object gets another one)."""
        head = self._call(key, "HEAD", lambda: self.client.head_object(Bucket=self.bucket, Key=self.key_of(key)))
        return str(head["ETag"]).strip('"')

    def exists(self, key: str) -> bool:
        try:
            self._call(key, "HEAD", lambda: self.client.head_object(Bucket=self.bucket, Key=self.key_of(key)))
        except ObjectNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        self._call(key, "DELETE", lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key_of(key)))

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)
        if self.scheme == "gs":  # the XML API has no multi-object delete
            for key in keys:
                self.delete(key)
            return
        for lo in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self.key_of(k)} for k in keys[lo : lo + 1000]]
            self._call(
                prefix,
                "DELETE",
                lambda b=batch: self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}
                ),
            )


def gcs_create_only(request: Any, **_: Any) -> None:
    """GCS's XML API spells S3's create-only condition ``If-None-Match: *`` as ``x-goog-if-generation-match: 0``
    (https://cloud.google.com/storage/docs/xml-api/reference-headers#xgoogifgenerationmatch); rewritten before the
    request is signed, so an HMAC signature covers the header GCS reads."""
    if request.headers.get("If-None-Match") == "*":
        del request.headers["If-None-Match"]
        request.headers["x-goog-if-generation-match"] = "0"


class _GcsBearerToken:
    """OAuth2 access token for GCS's XML API from the metadata server (GKE workload identity).

    Env ``GOOGLE_OAUTH_ACCESS_TOKEN`` short-circuits it; ``GCE_METADATA_HOST`` moves the server, as in
    Google's own client libraries. Token endpoint documented at
    https://cloud.google.com/compute/docs/access/authenticate-workloads#applications
    """

    _REFRESH_MARGIN_S = 300

    def __init__(self) -> None:
        self._token = ""
        self._expires = 0.0
        self._lock = threading.Lock()

    def token(self) -> str:
        static = os.environ.get("GOOGLE_OAUTH_ACCESS_TOKEN")
        if static:
            return static
        with self._lock:
            if time.time() > self._expires - self._REFRESH_MARGIN_S:
                host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
                req = urllib.request.Request(
                    f"http://{host}/computeMetadata/v1/instance/service-accounts/default/token",
                    headers={"Metadata-Flavor": "Google"},
                )
                with urllib.request.urlopen(req, timeout=10) as resp:
                    doc = json.load(resp)
                self._token = doc["access_token"]
                self._expires = time.time() + float(doc.get("expires_in", 3600))
            return self._token

    def sign(self, request: Any, **_: Any) -> None:
        from botocore.exceptions import NoCredentialsError

        try:
            token = self.token()
        except (OSError, KeyError, ValueError) as exc:  # no metadata server, or a malformed answer
            raise NoCredentialsError() from exc
        request.headers["Authorization"] = f"Bearer {token}"
