"""The `gpu-train` command's fixtures (the fake API server, the platform contract); the in-process command, `cli`, is
tests/conftest.py's."""

from tests.gpu_train.cli.conftest import api, doc  # noqa: F401
