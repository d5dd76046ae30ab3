"""The one address the head binds for a host the topology names (head.api, head.listen)."""
from __future__ import annotations

import socket


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The family and literal address a listener binds for `host`: the first that getaddrinfo gives for a passive
    stream socket, as check_can_listen probes it. A name that resolves to several addresses (`localhost` as ::1 and
    127.0.0.1 on macOS and several Linux distributions, a name with A and AAAA records) is bound on that one alone:
    Waitress would otherwise serve several sockets, and a plain socket binds IPv4 whatever the name. Raises
    ValueError where the host does not resolve."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"{host}: {exc.strerror or exc}") from exc
    return family, sockaddr[0]
