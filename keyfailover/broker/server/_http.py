"""The admin HTTP endpoint of ``keyfailover serve --metrics-port``: JSON for operators.

A deliberately small HTTP/1.1 server on the event loop (one request per connection, no
request bodies), so every handler reads the dispatchers from the loop thread that owns
them. GET reads; the few POST routes change something (a dead-letter replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from keyfailover.broker.storage._store import StoreUnavailableError

__all__ = ["AdminServer", "Handler", "Response", "json_response"]

_log = logging.getLogger("keyfailover.server")

Response = tuple[int, str, bytes]
"""HTTP status, content type, body."""
Handler = Callable[[dict[str, str]], Awaitable[Response]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}
_OPEN_PATHS = frozenset({"/healthz"})  # answered without the token, for load balancers
_MAX_REQUEST = 16 * 1024


def json_response(value: Any, status: int = 200) -> Response:
    """A JSON response (sorted keys, one trailing newline)."""
    return status, "application/json", (json.dumps(value, sort_keys=True) + "\n").encode()


class AdminServer:
    """Serves ``GET <path>`` and ``POST <path>`` from tables of handlers; query parameters go to the handler."""

    def __init__(
        self,
        routes: dict[str, Handler],
        token: str | None = None,
        post_routes: dict[str, Handler] | None = None,
        open_paths: frozenset[str] = frozenset(),
    ) -> None:
        """``open_paths``: GET paths answered without the token besides ``/healthz`` (static pages that
        ask for the token themselves); every other path keeps the token rule."""
        self._routes = routes
        self._post_routes = post_routes or {}
        self._open_paths = _OPEN_PATHS | open_paths
        self._token = None if token is None else token.encode()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True, ssl=tls)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        return str(bound_host), int(bound_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10.0):
                head = await reader.readuntil(b"\r\n\r\n")
            response = await self._respond(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            response = (400, "text/plain", b"malformed or incomplete request\n")
        status, content_type, body = response
        reason = _REASONS.get(status, "Error")
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def _authorized(self, head: bytes) -> bool:
        """Whether the request carries ``Authorization: Bearer <the token>`` (compared in constant time)."""
        assert self._token is not None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                scheme, _, credentials = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self._token)
        return False

    async def _respond(self, head: bytes) -> Response:
        if len(head) > _MAX_REQUEST:
            return 400, "text/plain", b"request head too large\n"
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", f"malformed request line {request_line!r}\n".encode()
        method, target, _ = parts
        if method not in ("GET", "POST"):
            return 405, "text/plain", f"method {method} is not allowed; expected GET or POST\n".encode()
        url = urlsplit(target)
        is_open = method == "GET" and url.path in self._open_paths
        if self._token is not None and not is_open and not self._authorized(head):
            return 401, "text/plain", b"this server requires its token: send the header Authorization: Bearer TOKEN\n"
        table, other = (self._routes, self._post_routes) if method == "GET" else (self._post_routes, self._routes)
        handler = table.get(url.path)
        if handler is None:
            if url.path in other:
                expected = "POST" if method == "GET" else "GET"
                return 405, "text/plain", f"{url.path} takes {expected}, not {method}\n".encode()
            known = ", ".join(sorted([*self._routes, *(f"POST {path}" for path in self._post_routes)]))
            return 404, "text/plain", f"no such path {url.path!r}; expected one of {known}\n".encode()
        query = {name: values[-1] for name, values in parse_qs(url.query).items()}
        try:
            return await handler(query)
        except StoreUnavailableError as exc:  # the store fails over: the caller tries again
            return 503, "text/plain", f"{exc}\n".encode()
        except Exception:
            _log.exception("admin handler for %s failed", url.path)
            return 500, "text/plain", b"internal error\n"
