"""The one address the head binds for a host the topology names (head.api, head.listen)."""
from __future__ import annotations

import socket


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The family and literal address a listener binds for `host`: for a name, the first IPv4 address it resolves
    to, else its first address (a plain socket bound such a name IPv4, and workers and clients are told to join
    127.0.0.1 or a LAN address); for a literal, itself. A name of several addresses (`localhost` as ::1 and
    127.0.0.1 on macOS and several Linux distributions, a name with A and AAAA records) is bound on that one
    alone: Waitress would otherwise serve several sockets. Raises ValueError where the host does not resolve."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"{host}: {exc.strerror or exc}") from exc
    family, _, _, _, sockaddr = next((a for a in found if a[0] == socket.AF_INET), found[0])
    return family, sockaddr[0]
