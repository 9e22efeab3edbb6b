"""The lasting copy of a sweep's state in the object store: its journal and Optuna's, under
<checkpoints bucket>/<team>/<sweep>/controller/, written after every journal record, before the action it records.

Usage:
    mirror = StateMirror(store, "<team>/<sweep>/controller", sweep_dir)   # store: gpu_train.storage, the bucket
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
    """The store's copy and this one disagree (two controllers wrote the same sweep)."""


class StateMirror:
    def __init__(self, store: Any, prefix: str, directory: Path) -> None:
        """`store`: the checkpoints bucket (gpu_train.storage); `prefix`: <team>/<sweep>/controller."""
        self.store, self.prefix, self.dir = store, prefix.strip("/"), Path(directory)
        self._pushed: dict[str, int] = {}

    @property
    def uri(self) -> str:
        return f"{self.store.url_of(self.prefix)}/"

    def _get(self, name: str) -> bytes | None:
        from gpu_train.storage import ObjectNotFoundError

        try:
            return self.store.get_bytes(f"{self.prefix}/{name}")
        except ObjectNotFoundError:
            return None

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
            if not path.exists() or self._pushed.get(name) == path.stat().st_size:
                continue  # unchanged since the last push: not read again
            body = path.read_bytes()
            self.store.put_bytes(f"{self.prefix}/{name}", body)
            self._pushed[name] = len(body)
