"""Connecting to whichever member of a replicated PostgreSQL accepts writes, and letting go of one that froze.

A store URL may name every member of a group, ``postgresql://kf@h1:p1,h2:p2/kf?target_session_attrs=read-write``,
as libpq and asyncpg spell it. asyncpg tries the hosts one after the other within one timeout: a member
that accepts the TCP connection but never answers, because its machine froze or its link drops every
packet, spends the whole timeout and the primary after it is never tried. Here every member is tried at
once, each with its own timeout, and the first one that accepts writes wins: a frozen member costs
nothing while another is the primary. When none does, the error names each member and why.

asyncpg cleans a connection up after a statement timed out: it asks the server to cancel the statement,
and the next use of the connection, its rollback or its return to the pool waits for that cancel to be
done. A frozen server answers none of it, so each waits until the server wakes. :class:`FailoverPool`
drops such a connection instead (its transaction ends with it, on the server's side) and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

__all__ = [
    "UNREACHABLE",
    "FailoverPool",
    "NoWritableMemberError",
    "connect_writable",
    "described",
    "member_urls",
]

_LOST = (
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)
"""What asyncpg raises when a connection died under a statement (ended by another broker, or a network fault):
a broker woken after its connection was ended may also find the connection's protocol in a state it cannot
leave (``InternalClientError``, seen at the commit after a COPY)."""

UNREACHABLE = (*_LOST, TimeoutError, asyncpg.exceptions.ReadOnlySQLTransactionError)
"""What a call raises when the store is out of reach: a lost connection, a statement unanswered within the
statement timeout, or a write on a member that a failover made a standby."""

_DROPPED = (*UNREACHABLE, asyncio.CancelledError)
"""What makes :class:`FailoverPool` drop a connection rather than clean it up: the store out of reach, or the
call cancelled in the middle of a statement, whose cleanup would wait for the server as a timeout's does."""

POOL_CLOSE_TIMEOUT = 10.0
"""Seconds closing the pool waits for its connections to close politely before it drops them."""


class FailoverPool:
    """An asyncpg pool, connections lent as by ``acquire``, that drops a connection whose server stopped
    answering or which died, instead of cleaning it up: its rollback and its return to the pool do not wait
    for a frozen server. A connection in a transaction that ended so is ended on the server's side too: its
    transaction is rolled back there, as when its client dies."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        """A connection of the pool for the ``async with`` block; dropped when the block fails with it gone."""
        connection = await self._pool.acquire()
        try:
            yield connection
        except _DROPPED:
            connection.terminate()
            raise
        finally:
            await self._pool.release(connection)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        """A connection in a transaction for the ``async with`` block: committed after it, rolled back when it
        fails, dropped when it fails with the connection gone or unanswered."""
        async with self.acquire() as connection:
            transaction = connection.transaction()
            await transaction.start()
            try:
                yield connection
            except _DROPPED:
                raise  # no rollback: the connection is dropped
            except BaseException:
                await transaction.rollback()
                raise
            await transaction.commit()

    async def fetch(self, query: str, *arguments: object) -> list[Any]:
        """The rows of ``query``."""
        async with self.acquire() as connection:
            return list(await connection.fetch(query, *arguments))

    async def fetchrow(self, query: str, *arguments: object) -> Any:
        """The first row of ``query``; None when it has none."""
        async with self.acquire() as connection:
            return await connection.fetchrow(query, *arguments)

    async def fetchval(self, query: str, *arguments: object) -> Any:
        """The first value of the first row of ``query``; None when it has none."""
        async with self.acquire() as connection:
            return await connection.fetchval(query, *arguments)

    async def execute(self, query: str, *arguments: object) -> str:
        """Run ``query``; its status."""
        async with self.acquire() as connection:
            return str(await connection.execute(query, *arguments))

    async def close(self) -> None:
        """Close every connection, politely within :data:`POOL_CLOSE_TIMEOUT`, then by dropping those left."""
        try:
            await asyncio.wait_for(self._pool.close(), POOL_CLOSE_TIMEOUT)
        except TimeoutError:
            self._pool.terminate()


class NoWritableMemberError(ConnectionError):
    """No member of the store's URL accepts writes; the message names each member and why."""


def member_urls(dsn: str) -> list[str]:
    """One URL per member that ``dsn`` names, each the same but for its host: ``[dsn]`` for one member."""
    parts = urllib.parse.urlsplit(dsn)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    members = hosts.split(",")
    if len(members) < 2:
        return [dsn]
    return [urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo}{at}{member}")) for member in members]


def member_name(url: str) -> str:
    """The ``host:port`` a member's URL names, for messages."""
    netloc = urllib.parse.urlsplit(url).netloc
    return netloc.rpartition("@")[2] or "the default host"


async def connect_writable(dsn: str, *, timeout: float, **options: Any) -> Any:
    """A connection to a member of ``dsn`` that accepts writes, every member tried at once.

    ``options`` go to :func:`asyncpg.connect` as they are: the connection pool passes its own. With several
    members a standby is refused (``target_session_attrs`` is ``read-write``, whatever the URL says); with
    one, the URL's ``target_session_attrs`` applies. Raises :class:`NoWritableMemberError` naming each member
    and why when none is taken within ``timeout``, or what :func:`asyncpg.connect` raises for one member."""
    urls = member_urls(dsn)
    if len(urls) == 1:
        try:
            return await asyncpg.connect(dsn, timeout=timeout, **options)
        except asyncpg.exceptions.TargetServerAttributeNotMatched as exc:
            raise NoWritableMemberError(f"the store's server does not accept writes ({member_name(dsn)}: "
                                        f"{_reason(exc)})") from None  # fmt: skip
    options["target_session_attrs"] = "read-write"  # several members: only the primary will do
    tries = {asyncio.ensure_future(asyncpg.connect(url, timeout=timeout, **options)): url for url in urls}
    why: dict[str, str] = {}
    chosen: Any = None
    waiting = set(tries)
    try:
        while waiting and chosen is None:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is None and chosen is None:
                    chosen = task.result()
                elif error is None:
                    task.result().terminate()  # a second writable member: a split the other brokers see too
                else:
                    why[tries[task]] = _reason(error)
    finally:
        for task in waiting:
            task.cancel()
        for task in waiting:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                late = await task
                late.terminate()
    if chosen is None:
        named = "; ".join(f"{member_name(url)}: {why.get(url, 'no answer')}" for url in urls)
        raise NoWritableMemberError(f"no member of the store accepts writes ({named})")
    return chosen


def _reason(error: BaseException) -> str:
    """Why a member was not taken, in a few words."""
    if isinstance(error, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return "a standby, read-only"
    if isinstance(error, TimeoutError):
        return "no answer within the connect timeout"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    return described(error)


def described(exc: BaseException) -> str:
    """``exc`` in a few words: its message, or its kind when it has none (a timeout)."""
    if isinstance(exc, TimeoutError):
        return "no answer within the timeout"
    return str(exc) or type(exc).__name__
