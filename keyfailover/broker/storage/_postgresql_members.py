"""Connecting to whichever member of a replicated PostgreSQL accepts writes.

A store URL may name every member of a group, ``postgresql://kf@h1:p1,h2:p2/kf?target_session_attrs=read-write``,
as libpq and asyncpg spell it. asyncpg tries the hosts one after the other within one timeout: a member
that accepts the TCP connection but never answers, because its machine froze or its link drops every
packet, spends the whole timeout and the primary after it is never tried. Here every member is tried at
once, each with its own timeout, and the first one that accepts writes wins: a frozen member costs
nothing while another is the primary. When none does, the error names each member and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from typing import Any

import asyncpg

__all__ = ["NoWritableMemberError", "connect_writable", "member_urls"]


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

    ``options`` go to :func:`asyncpg.connect` as they are: the connection pool passes its own. The URL's
    ``target_session_attrs`` applies to each member: with ``read-write`` a standby is refused. Raises
    :class:`NoWritableMemberError` naming each member and why when none is taken within ``timeout``."""
    urls = member_urls(dsn)
    if len(urls) == 1:
        try:
            return await asyncpg.connect(dsn, timeout=timeout, **options)
        except asyncpg.exceptions.TargetServerAttributeNotMatched as exc:
            raise NoWritableMemberError(f"the store's server does not accept writes ({member_name(dsn)}: "
                                        f"{_reason(exc)})") from None  # fmt: skip
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
    return str(error) or type(error).__name__
