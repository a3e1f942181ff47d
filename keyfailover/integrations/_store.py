"""Where a cluster's log is, and what it means when it cannot be read, for its two readers.

:func:`keyfailover.spark.read_log` (through Spark's JDBC source) and ``keyfailover export
--store`` (through asyncpg) read the PostgreSQL log of :mod:`keyfailover.broker.storage.postgresql`
from the same store URL, ``postgresql://user[:password]@host[:port]/database``, and report the
same failures in the same words. A topic's partitions are its rows in ``kf_partitions``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from keyfailover.core.errors import LogError

__all__ = [
    "StoreURL",
    "check_topic",
    "connect_store",
    "no_log_error",
    "run_store_step",
    "unknown_topic_error",
    "unreadable_error",
]

_T = TypeVar("_T")

STORE_URL_FORM = "postgresql://user[:password]@host[:port]/database"
DEFAULT_PORT = 5432


@dataclass(frozen=True)
class StoreURL:
    """The parts of a store URL; ``str()`` gives it without its password, for messages."""

    user: str
    password: str | None
    host: str
    port: int
    database: str

    @classmethod
    def parse(cls, text: object) -> StoreURL:
        """The parts of ``text``; :class:`LogError` says what is wrong with a URL not of the form above."""
        if not isinstance(text, str):
            raise LogError(f"the store URL must be a str of the form {STORE_URL_FORM}, not {type(text).__name__}")
        shown = _without_password(text)
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError:
            raise LogError(
                f"the store URL {shown!r} is malformed or has a port that is not a number from 1 to 65535; "
                f"expected {STORE_URL_FORM}"
            ) from None
        database = parts.path.removeprefix("/")
        problem = None
        if parts.scheme not in ("postgresql", "postgres"):
            problem = "is not a PostgreSQL URL"
        elif parts.query or parts.fragment:
            problem = "has ?options or a #fragment, which are not read"
        elif not parts.username:
            problem = "names no user"
        elif not parts.hostname:
            problem = "names no host"
        elif port == 0:
            problem = "has port 0"
        elif not database or "/" in database:
            problem = "does not name one database"
        if problem is not None:
            raise LogError(f"the store URL {shown!r} {problem}; expected {STORE_URL_FORM}")
        password = None if parts.password is None else unquote(parts.password)
        return cls(unquote(str(parts.username)), password, str(parts.hostname), port or DEFAULT_PORT, unquote(database))

    @property
    def address(self) -> str:
        """``host:port``, an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"postgresql://{self.user}@{self.address}/{self.database}"


def check_topic(topic: object) -> str:
    """``topic`` if it is a name a log can hold: a non-empty str without NUL characters."""
    if not isinstance(topic, str) or not topic or "\0" in topic:
        raise LogError(f"topic must be a non-empty str without NUL characters, not {topic!r}")
    return topic


def unreadable_error(store: StoreURL, reason: str) -> LogError:
    """The store did not answer, or refused to: not running, unreachable, a wrong user or database."""
    return LogError(
        f"cannot read the log at {store}: {reason}; expected the cluster's PostgreSQL running there, "
        f"letting user {store.user!r} read database {store.database!r}"
    )


def no_log_error(store: StoreURL) -> LogError:
    """The store answered, but its database is not a cluster's log."""
    return LogError(
        f"the database at {store} holds no keyfailover log (no kf_partitions table); "
        "expected the database the cluster's brokers write to"
    )


def unknown_topic_error(store: StoreURL, topic: str, topics: list[str]) -> LogError:
    """The error for ``topic`` missing from the log at ``store``, naming the topics it has."""
    return LogError(f"topic {topic!r} is not in the log at {store}; expected one of {topics}")


def _without_password(text: str) -> str:
    """``text`` with the password of its ``user:password@`` part, if any, replaced by ``***``."""
    try:
        netloc = urlsplit(text).netloc
    except ValueError:
        netloc = text.partition("://")[2].partition("/")[0]
    credentials, at, host = netloc.rpartition("@")
    user, colon, _ = credentials.partition(":")
    return text.replace(netloc, f"{user}:***@{host}", 1) if at and colon else text


def run_store_step(runner: asyncio.Runner, store: StoreURL, step: Awaitable[_T]) -> _T:
    """Run one asyncpg ``step`` of a conversation with ``store`` on ``runner``: a store without the log's tables
    is :func:`no_log_error`, any other failure of the store :func:`unreadable_error`."""
    import asyncpg

    async def awaited() -> _T:
        return await step

    try:
        return runner.run(awaited())
    except asyncpg.UndefinedTableError:
        raise no_log_error(store) from None
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise unreadable_error(store, str(exc) or type(exc).__name__) from None


def connect_store(runner: asyncio.Runner, store: StoreURL, timeout: float) -> Any:
    """An asyncpg connection to ``store`` on ``runner``, made within ``timeout`` seconds; failures as
    :func:`run_store_step` reports them."""
    import asyncpg

    return run_store_step(
        runner,
        store,
        asyncpg.connect(
            host=store.host,
            port=store.port,
            user=store.user,
            password=store.password,
            database=store.database,
            timeout=timeout,
        ),
    )


def close_store(runner: asyncio.Runner, connection: Any) -> None:
    """Close ``connection``, if any, terminating it when the store does not answer the close, then ``runner``."""
    import asyncpg

    try:
        if connection is not None:
            runner.run(connection.close(timeout=10))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        connection.terminate()
    finally:
        runner.close()
