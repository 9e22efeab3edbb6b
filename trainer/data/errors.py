"""Error types of the data path.

Use: ``from trainer.data.errors import DataError`` and catch it around ``open_dataset`` / ``ds.window``.
Every message names the culprit: the manifest key, the shard file and the full URI it came from.
"""

from __future__ import annotations


class DataError(Exception):
    """Base class for every error raised by trainer.data."""


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


class DatasetTooShortError(DataError):
    """No window of ``context + 1`` tokens fits in the dataset (or split)."""


class SamplerStateError(DataError):
    """A sampler state_dict does not fit this dataset / batch / seed."""
