"""Broker URLs and addresses, and the TLS context a client connects with."""

from __future__ import annotations

import os
import ssl
from urllib.parse import urlsplit

from keyfailover.core.errors import KeyFailoverError

Address = str
"""A broker's ``HOST:PORT``."""


def parse_url(url: str) -> tuple[list[Address], bool]:
    """``kf://h1:p1[,h2:p2...]`` -> (["h1:p1", ...], False); ``kf+ssl://...`` -> (..., True): TLS."""
    expected = f"server URL {url!r} is not of the form kf://HOST:PORT[,HOST:PORT...] or kf+ssl://HOST:PORT[,...]"
    scheme, separator, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    if not separator or scheme not in ("kf", "kf+ssl") or not rest:
        raise KeyFailoverError(expected)
    addresses = []
    for item in rest.rstrip("/").split(","):
        try:
            parts = urlsplit(f"kf://{item}")
            port = parts.port
        except ValueError as exc:
            raise KeyFailoverError(f"{expected} ({exc})") from None
        if not parts.hostname or port is None or parts.path or parts.query:
            raise KeyFailoverError(expected)
        addresses.append(_address(parts.hostname, port))
    return addresses, scheme == "kf+ssl"


def _address(host: str, port: int) -> Address:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_port(address: Address) -> tuple[str, int]:
    """The host and port of a broker ``address``; raises for one not of the form HOST:PORT."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise KeyFailoverError(f"broker address {address!r} is not of the form HOST:PORT")
    return host.strip("[]"), int(port)


def client_tls(ca_file: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """A TLS context that verifies the server: against ``ca_file`` when given, else the system's CAs."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise KeyFailoverError(f"cannot load the CA file {ca_file}: {exc}; expected PEM certificates") from None
