"""The `gpu-train` command's fixtures (the fake API server, the platform contract, the in-process command)."""

from tests.gpu_train.cli.conftest import api, cli, doc  # noqa: F401
