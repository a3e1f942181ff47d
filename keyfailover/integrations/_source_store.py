"""A cluster's PostgreSQL log read by position, as the Spark source reads a server: the source's ``store`` option.

:class:`StoreLog` answers ``log_ends`` and ``read`` as :class:`~keyfailover.client.Client` does, from the
tables the brokers write (:mod:`keyfailover.broker.storage.postgresql`), so the source plans and reads a
store exactly as it does a server. Each call is one read-only transaction: a partition's end,
``kf_partitions.last_position``, is written in the transaction that appends its messages, so what a read
sees up to that end is complete. The slot filter is applied here, after the rows are read, as the log
keeps no slot column.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, TypeVar

from keyfailover.client import LogEntries, LogEntry
from keyfailover.core.hashing import key_hash
from keyfailover.core.loops import new_loop
from keyfailover.integrations._store import StoreURL, close_store, connect_store, run_store_step
from keyfailover.wire.properties import decode_properties

__all__ = ["StoreLog"]

_T = TypeVar("_T")

_TIMEOUT = 10.0
"""Seconds to connect to the store."""


class StoreLog:
    """Reads of a topic's partitions from the PostgreSQL log at ``store``, on a connection and loop of its own."""

    def __init__(self, store: StoreURL) -> None:
        """Connect to ``store``; a :class:`~keyfailover.core.errors.LogError` when it cannot be read."""
        self._store = store
        self._runner = asyncio.Runner(loop_factory=new_loop)
        self._connection: Any = None
        try:
            self._connection = connect_store(self._runner, store, _TIMEOUT)
        except BaseException:
            self.close()
            raise

    def log_ends(self, topic: str, timeout: float | None = None) -> list[int]:
        """The last position of every partition of ``topic``, in partition order (0: empty, or not yet opened by
        a broker); ``[0]`` for a topic the log does not hold, as a server answers."""
        rows = self._run(
            self._connection.fetch(
                "SELECT partition, last_position FROM kf_partitions WHERE topic = $1 ORDER BY partition", topic
            )
        )
        ends = [0] * (max((int(row[0]) for row in rows), default=0) + 1)
        for partition, last in rows:
            ends[int(partition)] = int(last)
        return ends

    def read(
        self,
        topic: str,
        partition: int = 0,
        after: int = 0,
        limit: int = 1000,
        *,
        slots: tuple[int, int] | None = None,
        timeout: float | None = None,
    ) -> LogEntries:
        """The messages of ``partition`` above ``after``, at most ``limit``, only those whose key's slot lies in
        ``slots`` when it is given; ``through`` and ``last`` as :meth:`Client.read <keyfailover.client.Client.read>`
        gives them."""

        async def in_one_snapshot() -> tuple[list[Any], int]:
            async with self._connection.transaction(isolation="repeatable_read", readonly=True):
                last = await self._connection.fetchval(
                    "SELECT last_position FROM kf_partitions WHERE topic = $1 AND partition = $2", topic, partition
                )
                rows = await self._connection.fetch(
                    """SELECT position, key, key_is_text, payload, publish_time, properties FROM kf_messages
                       WHERE topic = $1 AND partition = $2 AND position > $3 AND position <= $4
                       ORDER BY position LIMIT $5""",
                    topic,
                    partition,
                    after,
                    last or 0,
                    limit,
                )
                return rows, int(last or 0)

        rows, last = self._run(in_one_snapshot())
        through = int(rows[-1][0]) if len(rows) == limit and rows else max(after, last)
        entries = []
        for position, raw, is_text, payload, publish_time, properties in rows:
            key = None if raw is None else bytes(raw).decode() if is_text else bytes(raw)
            slot = None if key is None else key_hash(key)
            if slots is not None and (slot is None or not slots[0] <= slot <= slots[1]):
                continue
            entries.append(
                LogEntry(
                    key, bytes(payload), int(position), partition, publish_time, decode_properties(properties), slot
                )
            )
        return LogEntries(partition, entries, through, last)

    def _run(self, step: Awaitable[_T]) -> _T:
        """Run one step on the loop; a failure of the store becomes a :class:`LogError` saying so."""
        return run_store_step(self._runner, self._store, step)

    def close(self) -> None:
        """Close the connection and the loop."""
        connection, self._connection = self._connection, None
        close_store(self._runner, connection)

    def __enter__(self) -> StoreLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
