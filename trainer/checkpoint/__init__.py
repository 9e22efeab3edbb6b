"""Verified, asynchronous, resumable checkpoints: the collective protocol (CheckpointManager) and the pure
manifest code beside it.

Usage:
    from trainer.checkpoint import CheckpointManager, verify, list_step_dirs
    ckpt = CheckpointManager(local_dir, remote_uri, keep=3)           # collective, see manager.py
    manifest = verify(list_step_dirs(local_dir)[0])                   # pure, see manifest.py
"""

from trainer.checkpoint.manager import CheckpointManager, SaveRecord
from trainer.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointInvalid,
    check_files,
    list_step_dirs,
    parse_manifest,
    read_manifest,
    sha256_file,
    step_dir_name,
    verify,
    write_atomic,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointInvalid",
    "CheckpointManager",
    "SaveRecord",
    "check_files",
    "list_step_dirs",
    "parse_manifest",
    "read_manifest",
    "sha256_file",
    "step_dir_name",
    "verify",
    "write_atomic",
]
