"""Error types of the data path.

Use: ``from trainer.data.errors import DataError`` and catch it around ``open_dataset`` / ``ds.window``;
``is_transient(exc)`` tells a storage outage (retry later) from bad data.
Every message names the culprit: the manifest key, the shard file and the full URI it came from.
"""

from __future__ import annotations

from gpu_train.storage import DataError  # the base of the object stores' errors as well

__all__ = ["DataError"]


class ManifestError(DataError):
    """The dataset manifest is missing, not JSON, or has a missing/ill-typed key."""


class ShardError(DataError):
    """A shard could not be used; ``shard`` is its file name, ``uri`` its full object URI."""

    def __init__(self, message: str, *, shard: str, uri: str) -> None:
        super().__init__(message)
        self.shard = shard
        self.uri = uri


class ShardMissingError(ShardError):
    """The manifest names a shard that the store does not have."""


class ShardIntegrityError(ShardError):
    """A downloaded shard has the wrong size or sha256; it is deleted, never cached."""

    @classmethod
    def mismatch(cls, shard: str, uri: str, found: str, manifest: object) -> ShardIntegrityError:
        """Shard `shard` at `uri` differs from the manifest: `found` ("size N bytes", "sha256 H") against the
        manifest's value."""
        return cls(f"shard {shard} at {uri}: {found}, manifest says {manifest}", shard=shard, uri=uri)


class DatasetTooShortError(DataError):
    """No window of ``context + 1`` tokens fits in the dataset (or split)."""


class SamplerStateError(DataError):
    """A sampler state_dict does not fit this dataset / batch / seed."""


def is_transient(exc: BaseException) -> bool:
    """A storage outage rather than bad data: the data layer wraps the storage error that outlasted its retries
    (gpu_train/storage.py, StorageError.transient) in a shard error, so look down the cause chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "transient", False):
            return True
        seen = seen.__cause__
    return False
