"""The `gpu-train` command's platform contract fixture, `doc`; the in-process command, `cli`, is tests/conftest.py's."""

from tests.gpu_train.cli.conftest import doc  # noqa: F401
