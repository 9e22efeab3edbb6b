"""The lasting copy of a sweep's state in the object store: its journal and Optuna's, under
<checkpoints bucket>/<team>/<sweep>/controller/, written after every journal record, before the action it records.

Usage:
    mirror = StateMirror.open(contract, sweep, sweep_dir)   # the S3 API, at the contract's object store endpoint
    mirror.pull()          # before the controller starts: the store's copy, when it is further on than this one
    mirror.push()          # after each record (Controller(on_record=mirror.push))

A controller that lost its disk (an in-cluster pod rescheduled, a laptop swapped for the cluster) starts from the
store's copy and goes on with the same sweep. A local copy the store's does not continue (two controllers wrote
the same sweep) is refused, naming both, rather than merged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpu_train.sweeps.algorithms import OPTUNA_JOURNAL
from gpu_train.sweeps.journal import JOURNAL

log = logging.getLogger("gpu_train.sweeps")
FILES = (JOURNAL, OPTUNA_JOURNAL)


class MirrorError(RuntimeError):
    """The store's copy and this one disagree, or the store cannot be used."""


class StateMirror:
    def __init__(self, s3: Any, bucket: str, prefix: str, directory: Path) -> None:
        self.s3, self.bucket, self.prefix, self.dir = s3, bucket, prefix.strip("/"), Path(directory)
        self._pushed: dict[str, int] = {}

    @classmethod
    def open(cls, contract: Any, team: str, sweep: str, directory: Path) -> StateMirror:
        import boto3

        root = contract.bucket("checkpoints").rstrip("/")
        if not root.startswith("s3://"):
            raise MirrorError(f"a sweep on the cluster keeps its journal in the checkpoints bucket through the S3 API; "
                              f"this platform's is {root or 'not set'} ({contract.source})")
        bucket, _, base = root[len("s3://"):].partition("/")
        s3 = boto3.client("s3", endpoint_url=contract.endpoints.object_store or None,
                          region_name=contract.region or None)
        return cls(s3, bucket, "/".join(p for p in (base, team, sweep, "controller") if p), directory)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/"

    def _get(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def pull(self) -> int:
        """Take the store's copy when it continues this one; the number of journal records taken from it."""
        remote = self._get(JOURNAL)
        path = self.dir / JOURNAL
        local = path.read_bytes() if path.exists() else b""
        if remote is None or remote == local or local.startswith(remote):
            self._pushed = {} if remote is None else {JOURNAL: len(remote)}
            return 0
        if not remote.startswith(local):
            raise MirrorError(f"sweep journal {path} and {self.uri}{JOURNAL} differ: two controllers wrote this sweep; "
                              "remove the one to drop and run again")
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            body = remote if name == JOURNAL else self._get(name)
            if body is not None:
                tmp = self.dir / f".{name}.part"
                tmp.write_bytes(body)
                tmp.replace(self.dir / name)
                self._pushed[name] = len(body)
        taken = remote[len(local):].count(b"\n")
        log.info("sweep state: %d journal records taken from %s", taken, self.uri)
        return taken

    def push(self) -> None:
        """Every file that grew since the last push (both are append-only)."""
        for name in FILES:
            path = self.dir / name
            if not path.exists():
                continue
            body = path.read_bytes()
            if self._pushed.get(name) == len(body):
                continue
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}", Body=body)
            self._pushed[name] = len(body)
