"""The client's tests use the command's fixture: the platform contract."""

from tests.gpu_train.cli.conftest import doc

__all__ = ["doc"]
