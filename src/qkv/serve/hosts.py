"""The host names a server answers: its defence against DNS rebinding.

A web page can point a name its owner controls at 127.0.0.1 after the browser has loaded it
("DNS rebinding"); the browser then sends the page's requests to the local server and lets the
page read the answers. Such a request still names the page's host in its ``Host`` header, so a
server that answers only the names it is known by (``localhost``, ``127.x.x.x``, ``[::1]``, and
those of ``--allowed-hosts``) is out of the page's reach.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

from qkv.errors import ConfigError

ANY = "*"
LOOPBACK = "localhost, 127.x.x.x, [::1]"


def host_name(value: str) -> str:
    """The name of a ``Host`` header (or an ``--allowed-hosts`` entry) without its port, in lower
    case: ``"[::1]:8000"`` -> ``"::1"``, ``"LocalHost:80"`` -> ``"localhost"``."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_loopback_name(name: str) -> bool:
    """``localhost``, ``127.x.x.x`` or ``::1``: a name that reaches this machine only."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    """Whether every address that ``--host`` stands for is a loopback one (only this machine can connect)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return all(ipaddress.ip_address(info[4][0].partition("%")[0]).is_loopback for info in infos)


def allowed_hosts(host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The ``Host`` names a server listening on ``host`` answers besides the loopback ones: those of
    ``--allowed-hosts`` (each entry a name or a comma-separated list; ``*``: any); without them, none
    on a loopback address and any on another."""
    names = []
    for value in extra:
        for part in value.split(","):
            name = host_name(part)
            if not (re.fullmatch(r"\*|[a-z0-9._:\[\]-]+", part.strip().lower()) and name):
                raise ConfigError(f"--allowed-hosts: {part.strip()!r} is not a host name (give names such as "
                                  f"example.org or 192.168.1.5, comma-separated, or * for any)")
            names.append(name)
    if names:
        return tuple(names)
    return () if is_loopback_host(host) else (ANY,)


def answered(allowed: tuple[str, ...]) -> str:
    """The names a server answers, to tell its user: ``"localhost, 127.x.x.x, [::1], box.lan"``."""
    return ", ".join((LOOPBACK, *allowed))


def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this ``Host`` header (None: none) may be answered."""
    if ANY in allowed:
        return True
    if not header:
        return False
    name = host_name(header)
    return is_loopback_name(name) or name in allowed


__all__ = ["allowed_hosts", "answered", "host_allowed", "host_name", "is_loopback_host", "is_loopback_name", "ANY",
           "LOOPBACK"]
