"""The client's tests use the command's fixtures: the platform contract and the fake API server that serves it."""

from tests.gpu_train.cli.conftest import api, doc

__all__ = ["api", "doc"]
