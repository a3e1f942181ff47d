"""A server as one broker of a cluster: level 1 (ZooKeeper) decides which partitions it serves,
the shared log in PostgreSQL holds everything, and owner epochs fence a broker that lost one.

The cluster member's worker thread tells this broker when it holds a partition's barrier
(:meth:`BrokerRole._acquired`) and before it lets one go (:meth:`BrokerRole._released`); each
call waits until the server's event loop has taken the partition's lease, or stopped serving it.

Owner epochs fence a zombie's writes; the member's lease (:meth:`ClusterMember.lease_valid`) fences
what it would do without writing: while the lease is lapsed the broker's subscriptions deliver
nothing and settle no ack, and it says so on the ``keyfailover.ownership`` logger ("pauses every
partition: its lease lapsed at ...", "resumes its partitions"), with the time the lease lapsed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from keyfailover.broker.cluster import ClusterMember, parse_cluster_url
from keyfailover.broker.storage._store import StoreUnavailableError
from keyfailover.broker.storage.postgresql import PostgresStore
from keyfailover.core.errors import ConfigError
from keyfailover.core.histogram import Histogram
from keyfailover.core.partitions import PartitionId, partition_topic

__all__ = ["BrokerRole"]

_log = logging.getLogger("keyfailover.cluster")
_ownership = logging.getLogger("keyfailover.ownership")
_HANDOVER_TIMEOUT = 60.0  # seconds the member's thread waits for the loop to open or close a partition
_STORE_RETRY = (0.1, 1.0)  # seconds between tries to open a partition while the store fails over: first, most


class _Served(Protocol):
    """What the broker role needs of its server."""

    def partition_of(self, served: str) -> tuple[str, int, int]: ...

    def learn_partitions(self, topic: str, partitions: int) -> None: ...

    async def open_served(self, served: str) -> None: ...

    async def close_served(self, served: str, reason: str) -> None: ...

    def wake_all(self) -> None: ...


class BrokerRole:
    """This server's membership in the cluster at ``cluster_url``, with its PostgreSQL store."""

    def __init__(
        self,
        server: _Served,
        cluster_url: str,
        store_dsn: str,
        *,
        entry_cache_bytes: int,
        broker_id: str | None = None,
        session_timeout: float = 10.0,
        min_rebalance_interval: float = 0.0,
    ) -> None:
        self._server = server
        self._hosts, self._root = parse_cluster_url(cluster_url)
        self._broker_id = broker_id
        self.store = PostgresStore(store_dsn, self._locate, entry_cache_bytes)
        self.store.on_fenced = self._fenced_out
        self._session_timeout = session_timeout
        self._min_rebalance_interval = min_rebalance_interval
        self._member: ClusterMember | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.acquired = 0  # partitions taken over (a failover or a rebalance each)
        self.released = 0
        self.acquire_seconds = Histogram()
        """Seconds from the assignment that gave this broker a partition to serving it: the wait for the
        previous owner's barrier, the lease and the open."""

    @property
    def joined(self) -> bool:
        """Whether the broker is in its cluster now: joined and not stopped (``member`` is there)."""
        return self._member is not None

    @property
    def member(self) -> ClusterMember:
        """This broker's cluster member; raises :class:`ConfigError` before the broker has joined."""
        if self._member is None:
            raise ConfigError("the broker has not joined its cluster yet")
        return self._member

    async def join(self, advertise: str, admin: str | None = None, pulsar: str | None = None) -> None:
        """Join the cluster as the broker clients reach at ``advertise`` (``HOST:PORT``), its admin
        endpoint at ``admin`` (a URL, for ``cluster status``) and its Pulsar protocol endpoint at
        ``pulsar`` (``HOST:PORT``, for Pulsar clients' lookups); its store is open."""
        self._loop = asyncio.get_running_loop()
        self.store.owner = self._broker_id or advertise
        member = ClusterMember(
            self._hosts,
            self._root,
            self.store.owner,
            advertise,
            session_timeout=self._session_timeout,
            min_rebalance_interval=self._min_rebalance_interval,
            on_acquired=self._acquired,
            on_released=self._released,
            admin=admin,
            on_lease=self._lease_changed,
            pulsar=pulsar,
        )
        self._member = member  # before it starts: its worker may hand partitions over at once
        try:
            await self._loop.run_in_executor(None, member.start)
        except BaseException:
            self._member = None
            raise

    async def stop(self) -> None:
        """Stop serving every partition, leave the cluster (the store is closed by the server after)."""
        member = self._member
        if member is not None and self._loop is not None:
            await self._loop.run_in_executor(None, member.stop)  # hands every partition back first
        self._member = None

    def lease_valid(self) -> bool:
        """Whether this broker may act on its partitions now (the member's lease; True before it joined)."""
        member = self._member
        return member is None or member.lease_valid()

    def _lease_changed(self, valid: bool, at: float) -> None:
        """The member's lease lapsed at ``at`` (monotonic), or was renewed: say so; on renewal wake the pumps."""
        if valid:
            _ownership.info(
                "broker %s resumes its partitions: ZooKeeper answered, its lease is renewed", self.store.owner
            )
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._server.wake_all)
            return
        lapsed = datetime.datetime.fromtimestamp(time.time() - (time.monotonic() - at))
        _ownership.info(
            "broker %s pauses every partition: its lease lapsed at %s,%03d (no answer from ZooKeeper)",
            self.store.owner,
            lapsed.strftime("%Y-%m-%d %H:%M:%S"),
            lapsed.microsecond // 1000,
        )

    # -- level 1 -> this broker --------------------------------------------------------

    def _partition_count(self, topic: str) -> int:
        """``topic``'s partition count, as of the assignment applied last (else read from ZooKeeper)."""
        count = self.member.state.topics.get(topic)
        return count if count is not None else self.member.topics()[topic]

    def _acquired(self, partition: PartitionId) -> None:
        """The member holds the barrier: take the lease and serve (on the member's thread)."""
        assigned = self.member.assigned_at(partition)
        started = time.monotonic() if assigned is None else assigned
        topic, index = partition
        count = self._partition_count(topic)
        served = partition_topic(topic, index, count)
        if self._handover(self._open(topic, count, served), f"open {served!r}"):
            self.acquired += 1
            self.acquire_seconds.observe(time.monotonic() - started)

    async def _open(self, topic: str, count: int, served: str) -> None:
        """Serve partition ``served`` of ``topic``, one of ``count``: take it in the store, bumping its owner epoch,
        then open it. While the store fails over, each step is tried again, with backoff, within the handover's
        time: a partition assigned then is served once a primary writes, not left unserved."""
        self._server.learn_partitions(topic, count)
        leased = False
        delay, most = _STORE_RETRY
        while True:
            try:
                if not leased:
                    await self.store.acquire(served)
                    leased = True
                await self._server.open_served(served)
                return
            except StoreUnavailableError as exc:
                _ownership.warning("broker %s waits for the store to open %r: %s", self.store.owner, served, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, most)

    def _released(self, partition: PartitionId) -> None:
        """Stop serving before the member lets the barrier go (on the member's thread)."""
        topic, index = partition
        served = partition_topic(topic, index, self._partition_count(topic))
        if self._handover(self._close(served), f"close {served!r}"):
            self.released += 1

    def _fenced_out(self, served: str) -> None:
        """Another broker took ``served`` (a write here was refused on its epoch): stop serving it now,
        before ZooKeeper tells this broker (on the loop; the release is counted when it does)."""
        asyncio.get_running_loop().create_task(self._server.close_served(served, "moved"))

    async def _close(self, served: str) -> None:
        """Stop serving ``served``: close its subscriptions, then release it in the store, even when closing them
        failed: a broker that lets a partition go writes nothing more for it."""
        try:
            await self._server.close_served(served, "moved")
        finally:
            self.store.release(served)

    def _handover(self, work: Coroutine[Any, Any, None], what: str) -> bool:
        """Run ``work`` on the server's loop and wait for it; whether it succeeded (a failure is logged)."""
        if self._loop is None or self._loop.is_closed():
            work.close()
            return False
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        try:
            future.result(timeout=_HANDOVER_TIMEOUT)
        except Exception:
            future.cancel()  # given up: an open must not go on (and serve) after the member moved on
            _log.exception("broker %s could not %s", self.store.owner, what)
            return False
        return True

    # -- what the server asks ------------------------------------------------------------

    def _locate(self, served: str) -> tuple[str, int]:
        """The topic and index of the partition served as ``served``."""
        topic, index, _ = self._server.partition_of(served)
        return topic, index

    async def partition_counts(self) -> dict[str, int]:
        """Each topic of the cluster and its partition count, as ZooKeeper holds them."""
        counts: dict[str, int] = await self._in_executor(self.member.topics)
        return counts

    async def create_partitioned_topic(self, topic: str, partitions: int) -> bool:
        """Create ``topic`` with ``partitions`` partitions in the cluster; False when it exists with as many already."""
        created: bool = await self._in_executor(lambda: self.member.create_topic(topic, partitions))
        self._server.learn_partitions(topic, partitions)
        return created

    async def route(self, topic: str, pulsar: bool = False) -> list[str | None]:
        """The address of the broker serving each partition of ``topic`` (created with one if new): its
        native one, or with ``pulsar`` its Pulsar protocol endpoint's (None: no broker, or none there)."""
        state = self.member.state
        count = state.topics.get(topic)
        if count is None:
            count = (await self.partition_counts()).get(topic)
        if count is None:
            await self.create_partitioned_topic(topic, 1)
            count = 1
        self._server.learn_partitions(topic, count)
        owners = state.assignment.owners
        addresses = state.pulsar_addresses if pulsar else state.addresses
        return [addresses.get(owners.get((topic, index), "")) for index in range(count)]

    async def _in_executor(self, call: Callable[[], Any]) -> Any:
        """Run the blocking ZooKeeper ``call`` on a worker thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, call)
