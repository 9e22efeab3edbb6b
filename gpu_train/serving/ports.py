"""The ports serving listens on, bound before anything is announced or started: a port in use or out of range is
one error naming it, never a server thread that dies later or requests that reach another server.

Usage:
    sock = bind("127.0.0.1", 8000, "--port")     # a listening socket, or PortError naming the port
    web.SockSite(runner, sock) / uvicorn.Server(config).run(sockets=[sock])

`gpu-train serve --local` binds its route's port with this, and its model servers' ports (port 0: any free one)
before it starts them, handing each its socket (python -m trainer.model_server --fd N), so no other
process can take a port between its check and its use. A model server started by hand binds its --port the same
way before it loads its model.
"""

from __future__ import annotations

import errno
import socket

MAX_PORT = 65535


class PortError(ValueError):
    """A port that cannot be listened on; the message names it and the flag that gave it."""


def bind(host: str, port: int, flag: str = "--port", *, any_port: bool = False) -> socket.socket:
    """A socket listening on host:port (port 0 with any_port: one the kernel picks)."""
    low = 0 if any_port else 1
    if not low <= port <= MAX_PORT:
        raise PortError(f"{flag} {port} is out of range ({low}..{MAX_PORT})")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    # As uvicorn and aiohttp do: a port whose last connections are in TIME_WAIT can be bound again at once; one
    # that another socket listens on still cannot.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        why = "in use: another process listens on it" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise PortError(f"{flag} {port}: cannot listen on {host}:{port} ({why})") from None
    return sock
