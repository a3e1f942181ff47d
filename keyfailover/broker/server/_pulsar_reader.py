"""A Pulsar Reader: a non-durable subscription of one consumer, served straight from the log.

A Pulsar client's Reader subscribes Exclusive and non-durable with a start message id; it wants
the topic's messages from there on, in order, as its permits allow, and keeps no cursor on the
broker (its acks change nothing; after a reconnection it subscribes again from the last message
it took). Key ranges, the dispatcher and a saved cursor have nothing to do here: the reader reads
the log from its position and follows its tail, woken by the server at each commit of its topic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from keyfailover.broker.pulsar import encode_delivery
from keyfailover.broker.storage._store import Store

__all__ = ["PulsarReader"]

_log = logging.getLogger("keyfailover.server")

_READ_BATCH = 1000
"""The most messages one read of the log hands a reader (its permits bound it too)."""


class PulsarReader:
    """The messages of ``topic`` after position ``after``, to the client consumer ``consumer_id``.

    ``write`` queues bytes on the connection; ``ended`` is called when the reader can go on no more
    here (its topic stopped being served, the log failed), so the connection tells the client,
    which subscribes again (elsewhere, after a lookup) from the last message it took.
    """

    def __init__(
        self,
        storage: Store,
        topic: str,
        after: int,
        consumer_id: int,
        *,
        partition: int,
        write: Callable[[bytes], None],
        ended: Callable[[PulsarReader], None],
    ) -> None:
        self.topic = topic
        self.position = after
        """The position of the last message sent (everything up to it went out)."""
        self.consumed = after
        """The position of the last message the client acked cumulatively, as a Pulsar Reader acks each message
        the application takes: its mark-delete position, which ``has_message_available()`` compares with the last
        message id. Never past :attr:`position`."""
        self.consumer_id = consumer_id
        self._storage = storage
        self._partition = partition
        self._write = write
        self._ended = ended
        self._permits = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"pulsar reader {self.topic} {self.consumer_id}"
        )

    def flow(self, permits: int) -> None:
        """The client may take ``permits`` more messages."""
        self._permits += permits
        self._wake.set()

    def acked(self, position: int) -> None:
        """The client acked everything up to ``position`` cumulatively: the application took it."""
        self.consumed = max(self.consumed, min(position, self.position))

    def committed(self) -> None:
        """Messages were committed to the topic: read on if permits are left."""
        self._wake.set()

    def topic_closed(self) -> None:
        """This broker stopped serving the topic (a partition moved): the reader ends here."""
        self.close()
        self._ended(self)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        storage, topic = self._storage, self.topic
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._permits > 0 and self.position < storage.last_position(topic):
                    batch = await storage.read(topic, self.position, min(self._permits, _READ_BATCH))
                    if not batch:
                        break
                    consumer_id, partition = self.consumer_id, self._partition
                    self._write(
                        b"".join(
                            encode_delivery(
                                consumer_id,
                                partition,
                                m.position,
                                m.key,
                                m.payload,
                                published=m.publish_time,
                                properties=m.properties,
                                producer=m.producer,
                            )
                            for m in batch
                        )
                    )
                    self.position = batch[-1].position
                    self._permits -= len(batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.exception(
                "Pulsar reader of %s failed at position %d; the client is told to subscribe again", topic, self.position
            )
            self._task = None
            self._ended(self)
