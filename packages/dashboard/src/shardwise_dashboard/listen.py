"""The dashboard's listening socket, bound before it says where it is: `serve` announces its URL
only once the port is its own, so a port another program holds is never announced."""

from __future__ import annotations

import errno
import socket

FALLBACK_PORTS = 20
"""With the default port taken, the ports after it that are tried in turn."""


class PortBusy(OSError):
    """No port could be bound; the message names the ports and the way out."""


def bind(host: str, port: int, *, fallback: bool) -> socket.socket:
    """A socket listening on `host`:`port`, or, when `fallback` and that port is taken, on the
    first free one of the FALLBACK_PORTS after it. The socket is what uvicorn serves.

    Raises:
        PortBusy: the port (and with `fallback`, every one tried) is taken.
        OSError: the address cannot be bound for another reason (not this host's address).
    """
    tries = range(port, min(port + 1 + FALLBACK_PORTS, 65536) if fallback else port + 1)
    for candidate in tries:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        # As uvicorn binds: a port left in TIME_WAIT by a dashboard that just stopped is
        # free; one another process listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
            sock.listen(2048)
        except OSError as error:
            sock.close()
            if error.errno != errno.EADDRINUSE:
                raise
            continue
        return sock
    if fallback:
        raise PortBusy(
            f"ports {port}-{tries[-1]} on {host} are all in use: pass a free one with --port"
        )
    raise PortBusy(
        f"port {port} on {host} is in use (another dashboard, or another program): stop it, "
        f"or pass another port with --port"
    )
