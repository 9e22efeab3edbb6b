"""The client's errors and the quieting of the `kubernetes` client's log records, apart from the modules that reach
the cluster: `gpu-train` sets them up and catches them without importing the `kubernetes` client (half a second), so
`gpu-train --help` and the commands that never reach a cluster start at once."""

from __future__ import annotations

import logging


class ClientError(Exception):
    """One line per problem for the user; `code` is the exit status `gpu-train` gives it (2: fix the input, 1: the
    operation failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class NoCluster(ClientError):
    """No kubeconfig to reach a cluster with: the commands that can work from a platform file say how to get one."""


class _PluginErrors(logging.Handler):
    """The kubernetes client logs a failing exec credential plugin (`aws eks get-token`, gke-gcloud-auth-plugin)
    and goes on without a token; keep the reason for the error line instead of printing a log record."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().strip().splitlines()[-1] if record.getMessage().strip() else "")


PLUGIN_ERRORS = _PluginErrors()


def quiet_client_logs() -> None:
    """No log records on the terminal: urllib3's retry warnings, and the exec plugin's errors (kept for the
    error line by PLUGIN_ERRORS)."""
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    PLUGIN_ERRORS.messages.clear()
    root = logging.getLogger()
    if PLUGIN_ERRORS not in root.handlers:
        root.addHandler(PLUGIN_ERRORS)
