"""The asyncio server around the dispatcher core: its life cycle, and its registry of subscriptions and partitions.

The native protocol's connection is :mod:`keyfailover.broker.server._native`, the Pulsar protocol's
:mod:`keyfailover.broker.server._pulsar`; the admin endpoint's handlers are :mod:`keyfailover.broker.server._admin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from keyfailover.broker.cursor import Cursor
from keyfailover.broker.server._admin import AdminApi
from keyfailover.broker.server._connection import ClientConnection, TailWatcher
from keyfailover.broker.server._http import AdminServer, Handler
from keyfailover.broker.server._native import NativeConnection
from keyfailover.broker.server._subscription import OwnSettings, Subscription, SubscriptionConfig
from keyfailover.broker.storage._cache import DEFAULT_ENTRY_CACHE_BYTES
from keyfailover.broker.storage._executor import SQLiteStore
from keyfailover.broker.storage._store import Store, TopicDirectory
from keyfailover.broker.storage.records import dead_letter_topic
from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, Log
from keyfailover.core.dispatcher import check_consume_mode
from keyfailover.core.errors import ConfigError, KeyFailoverError
from keyfailover.core.hashing import key_hash
from keyfailover.core.partitions import partition_slots, partition_topic, split_partition_topic
from keyfailover.wire.protocol import DEFAULT_MAX_FRAME, MAX_NAME_LENGTH, ErrorCode, Key, ProtocolError

if TYPE_CHECKING:
    from keyfailover.broker.server._cluster import BrokerRole
    from keyfailover.broker.server._pulsar_access import ProducerHandle, TopicProducers

__all__ = ["Server", "ServerConfig"]

_log = logging.getLogger("keyfailover.server")
_T = TypeVar("_T")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``keyfailover serve`` can set."""

    data_dir: Path | None = None
    """The embedded log's folder (a single server); None for a broker of a cluster."""
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    session_timeout: float = 10.0
    max_frame: int = DEFAULT_MAX_FRAME
    synchronous: str = "full"
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    login_frame: int = 64 * 1024
    """Largest frame read before a connection has logged in (sent ``connect``)."""
    login_timeout: float = 10.0
    """Seconds a new connection has to log in before it is closed."""
    frame_timeout: float = 30.0
    """Seconds one frame may take to arrive whole; a connection trickling bytes slower is closed."""
    max_output: int = 64 * 1024 * 1024
    """Bytes of replies a connection may have waiting to be written; past it, it is closed."""
    max_connections: int = 1024
    """Open connections; one more is told ``too_many_connections`` and closed."""
    entry_cache_bytes: int = DEFAULT_ENTRY_CACHE_BYTES
    """Bytes of the messages stored last kept in memory, so that reading them spares the log (0: none)."""
    tls_cert: Path | None = None
    """PEM certificate (chain) to serve the broker and admin ports over TLS; with ``tls_key``."""
    tls_key: Path | None = None
    subscription: SubscriptionConfig = field(default_factory=SubscriptionConfig)
    cluster: str | None = None
    """``zk://HOST:PORT[,...]/PATH``: serve as a broker of this cluster (with ``store`` and ``advertise``)."""
    store: str | None = None
    """``postgresql://...``: the cluster's shared log."""
    advertise: str | None = None
    """``HOST:PORT`` clients reach this broker at (what lookups answer)."""
    broker_id: str | None = None
    """This broker's id in the cluster (default: its advertised address)."""
    min_rebalance_interval: float = 0.0
    """Seconds the coordinator waits between two partition assignments."""
    cluster_session_timeout: float = 10.0
    """Seconds of silence after which ZooKeeper ends this broker's session (its partitions go to others)."""
    pulsar_port: int | None = None
    """Serve Apache Pulsar's binary protocol on this port too (0 picks a free one); None: off."""


class Server:
    """A Key_Failover server: durable topics, subscriptions and consumer sessions."""

    def __init__(self, config: ServerConfig) -> None:
        if not config.session_timeout > 0:
            raise KeyFailoverError(f"session_timeout must be > 0 seconds, not {config.session_timeout!r}")
        self.config = config
        self._storage: Store | None = None
        self._directory: TopicDirectory | None = None
        self._broker: BrokerRole | None = None
        self._server: asyncio.base_events.Server | None = None
        self._pulsar: asyncio.base_events.Server | None = None
        self.pulsar_advertised: str | None = None
        self.pulsar_tls = False
        """Whether the Pulsar endpoint speaks TLS (``pulsar+ssl://``): the server has a certificate."""
        """``HOST:PORT`` of the Pulsar endpoint a cluster's other brokers send Pulsar clients to."""
        self._subscriptions: dict[tuple[str, str], Subscription] = {}
        self._partitions: dict[str, int] = {}  # topics created with partitions, and how many
        # The subscriptions being opened or reset (a seek) now: anyone else wants them after that ends.
        self._busy: dict[tuple[str, str], asyncio.Event] = {}
        # Topics (partitions) whose serving is ending: nothing new opens on them until served again,
        # or a consumer told "moved" that subscribes here again at once would stay on a subscription
        # no new message reaches once the broker has let the partition go.
        self._closing: set[str] = set()
        self._connections: set[ClientConnection] = set()
        self._watchers: dict[str, set[TailWatcher]] = {}  # served topic -> what follows its log (Pulsar readers)
        self.pulsar_producers: dict[str, TopicProducers[ProducerHandle]] = {}
        """Each served topic's (partition's) Pulsar producers, by their access modes; kept while a topic has one
        or an exclusive producer raised its epoch."""
        # Session ids are never reused, across restarts too (they start at the wall clock in µs):
        # an ack of a session from before a restart must not land on a new one.
        self._session_ids = itertools.count(time.time_ns() // 1000)
        self._reaper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._admin: AdminServer | None = None
        self._lock_file: TextIO | None = None
        self.protocol_errors: Counter[str] = Counter()  # error frames sent, by code
        self._admin_address: tuple[str, int] | None = None
        self.settings_lock = asyncio.Lock()
        """Orders saving a subscription's settings with opening it."""
        self.closing = False
        api = AdminApi(self)
        self._routes = api.routes
        self._post_routes = api.post_routes
        self._open_paths: set[str] = set()
        self._admin_tasks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._running_admin_tasks: list[asyncio.Task[None]] = []

    def add_admin_route(self, path: str, handler: Handler, *, post: bool = False, without_token: bool = False) -> None:
        """Serve ``GET path`` (``POST path`` with ``post``) on the admin endpoint (``--metrics-port``) too; call
        before :meth:`start`. ``without_token``: a GET route answered without the server's token, for static
        files that hold no data (a page that asks for the token itself)."""
        if self._server is not None:
            raise KeyFailoverError(f"admin route {path!r} added after the server started; add routes before start()")
        table = self._post_routes if post else self._routes
        if not path.startswith("/") or path in table:
            raise KeyFailoverError(f"admin route {path!r} must start with '/' and not be one of {sorted(table)}")
        if post and without_token:
            raise KeyFailoverError(f"admin route POST {path!r} changes state: it cannot be served without the token")
        table[path] = handler
        if without_token:
            self._open_paths.add(path)

    def add_admin_task(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``run()`` as a task on the server's loop while the admin endpoint serves (it starts with the
        endpoint and is cancelled, then awaited, at :meth:`close`); call before :meth:`start`."""
        if self._server is not None:
            raise KeyFailoverError("an admin task was added after the server started; add tasks before start()")
        self._admin_tasks.append(run)

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the log and start listening."""
        try:
            await self._open()
        except BaseException:
            await self.close()  # whatever was opened is released: the lock, the log, a bound port
            raise

    async def _open(self) -> None:
        """The body of :meth:`start`: open the log or the cluster's store, listen for native and Pulsar
        clients, start the reaper and the admin endpoint, and join the cluster once listening."""
        if self.config.cluster is None:
            await self._open_log()
            # Every subscription with a saved cursor is live from the start, with no consumers, so
            # its backlog and its lack of consumers show in /metrics before anyone subscribes.
            for topic in self.storage.topics():
                await self.open_served(topic)
        else:
            await self._open_store()
        loop = asyncio.get_running_loop()
        host, port = self.config.host, self.config.port
        tls = self._tls()
        self._server = await self._listen(lambda: NativeConnection(self), host, port, tls, "listen on")
        if self.config.pulsar_port is not None:
            from keyfailover.broker.server._pulsar import PulsarConnection

            self.pulsar_tls = tls is not None
            self._pulsar = await self._listen(
                lambda: PulsarConnection(self), host, self.config.pulsar_port, tls, "serve the Pulsar protocol on"
            )
        self._reaper = loop.create_task(self._reap_loop(), name="keyfailover-reaper")
        if self.config.metrics_port is not None:
            self._admin = AdminServer(self._routes, self.config.token, self._post_routes, frozenset(self._open_paths))
            admin_host, admin_port = self.config.metrics_host, self.config.metrics_port
            try:
                self._admin_address = await self._admin.start(admin_host, admin_port, tls)
            except OSError as exc:
                self._admin = None
                raise KeyFailoverError(
                    f"cannot serve the admin endpoint on {admin_host}:{admin_port} ({_reason(exc)})"
                ) from None
            self._running_admin_tasks = [loop.create_task(run(), name="keyfailover-admin") for run in self._admin_tasks]
        if self._broker is not None:  # listening first: brokers that route clients here find it up
            address = self.config.advertise or "{}:{}".format(*self.address)
            admin = None
            if self._admin_address is not None:
                scheme = "https" if self.config.tls_cert is not None else "http"
                admin = "{}://{}:{}".format(scheme, *self._admin_address)
            pulsar = None
            if self.pulsar_address is not None:
                self.pulsar_advertised = "{}:{}".format(address.rsplit(":", 1)[0], self.pulsar_address[1])
                pulsar = self.pulsar_advertised
            await self._broker.join(address, admin, pulsar)
            self._directory = self._broker
            self._partitions.update(await self._broker.partition_counts())

    async def _listen(
        self, protocol: Callable[[], asyncio.Protocol], host: str, port: int, tls: ssl.SSLContext | None, what: str
    ) -> asyncio.base_events.Server:
        """Accept connections of ``protocol`` on ``host:port`` (over TLS with ``tls``); ``what`` names it in
        the error when the address cannot be had."""
        try:
            return await asyncio.get_running_loop().create_server(
                protocol,
                host,
                port,
                reuse_address=True,
                ssl=tls,
                ssl_handshake_timeout=self.config.login_timeout if tls is not None else None,
            )
        except OSError as exc:
            raise KeyFailoverError(f"cannot {what} {host}:{port} ({_reason(exc)})") from None

    async def _open_log(self) -> None:
        """Open the embedded log in the data dir, which this server locks for itself."""
        data_dir = self.config.data_dir
        if data_dir is None:
            raise KeyFailoverError("a single server needs a data dir (or a cluster and store to join)")
        if data_dir.exists() and not data_dir.is_dir():
            raise KeyFailoverError(f"data dir {data_dir} is not a directory; expected a directory (created if missing)")
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = (data_dir / "LOCK").open("a")
        except OSError as exc:
            raise KeyFailoverError(
                f"cannot use data dir {data_dir} ({exc.strerror}); expected a directory this process can write"
            ) from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise KeyFailoverError(
                f"{data_dir} is in use by another keyfailover server; expected a free data dir"
            ) from None
        log = Log(data_dir / LOG_FILE_NAME, synchronous=self.config.synchronous)  # type: ignore[arg-type]
        store = SQLiteStore(log, self.config.entry_cache_bytes)
        self._storage = self._directory = store
        await store.start()
        store.on_commit(self._committed)
        self._partitions = await store.partition_counts()

    async def _open_store(self) -> None:
        """Open the cluster's shared store; the broker joins the cluster once it listens."""
        from keyfailover.broker.server._cluster import BrokerRole

        config = self.config
        if config.store is None or config.cluster is None:
            raise ConfigError("a broker of a cluster needs its cluster (--cluster) and its store (--store)")
        broker = BrokerRole(
            self,
            config.cluster,
            config.store,
            broker_id=config.broker_id,
            session_timeout=config.cluster_session_timeout,
            min_rebalance_interval=config.min_rebalance_interval,
            entry_cache_bytes=config.entry_cache_bytes,
        )
        self._broker = broker
        self._storage = broker.store
        broker.store.on_commit(self._committed)
        await broker.store.start()

    def _tls(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None without a certificate."""
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise KeyFailoverError("TLS needs both a certificate and its key; expected tls_cert and tls_key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise KeyFailoverError(
                f"cannot load the TLS certificate {cert} and key {key} ({exc}); expected PEM files that match"
            ) from None
        return context

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        if self._server is None:
            raise KeyFailoverError("the server is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def pulsar_address(self) -> tuple[str, int] | None:
        """The (host, port) of the Pulsar protocol endpoint, or None when it is off."""
        if self._pulsar is None:
            return None
        host, port = self._pulsar.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def admin_address(self) -> tuple[str, int] | None:
        """The (host, port) of the admin HTTP endpoint, or None when it is off."""
        return self._admin_address

    @property
    def storage(self) -> Store:
        """The store of messages and cursors: the embedded log, or a cluster's shared store."""
        if self._storage is None:
            raise KeyFailoverError("the server is not started")
        return self._storage

    def subscriptions(self) -> dict[tuple[str, str], Subscription]:
        """The live subscriptions by topic and name, a copy."""
        return dict(self._subscriptions)

    def opening(self, topic: str, name: str) -> bool:
        """Whether subscription ``name`` of ``topic`` is being opened or reset by a seek right now."""
        return (topic, name) in self._busy

    async def own_settings(self, topic: str, name: str) -> OwnSettings:
        """The delivery settings saved for the subscription (the log checked them as it saved them)."""
        return await self.storage.load_delivery_settings(topic, name)

    def live(self, topic: str, name: str) -> list[Subscription]:
        """The live subscriptions of the partitions of ``topic`` named ``name`` on this broker."""
        found = (self._subscriptions.get((served, name)) for served in self.partition_names(topic))
        return [subscription for subscription in found if subscription is not None]

    @property
    def broker(self) -> BrokerRole | None:
        """This server's part in its cluster (``--cluster``); None for a single server."""
        return self._broker

    @property
    def connection_count(self) -> int:
        """Open client connections."""
        return len(self._connections)

    async def wait_closed(self) -> None:
        """Wait until :meth:`close` has finished."""
        await self._stopped.wait()

    async def close(self) -> None:
        """Stop accepting, tell consumers, persist cursors, commit what is queued, close the log."""
        if self.closing:
            await self._stopped.wait()
            return
        self.closing = True
        if self._server is not None:
            self._server.close()
        if self._pulsar is not None:
            self._pulsar.close()
        if self._admin is not None:
            await self._admin.close()
        for task in self._running_admin_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        while self._busy:  # a subscription being opened or reset by a seek: its store calls end first
            await next(iter(self._busy.values())).wait()
        if self._broker is not None:  # its partitions are closed (cursors saved) before it leaves
            await self._broker.stop()
        for subscription in list(self._subscriptions.values()):
            await subscription.close()
        if self._storage is not None:
            await self._storage.close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
        if self._pulsar is not None:
            await self._pulsar.wait_closed()
        self._stopped.set()

    # -- subscriptions ---------------------------------------------------------------

    async def subscription(self, topic: str, name: str, at_end: bool = False) -> Subscription:
        """The live subscription, loading its cursor on first use (created if new: with ``at_end`` after the
        topic's last message, its cursor saved at once, else at the start)."""
        key = (topic, name)
        while (found := self._subscriptions.get(key)) is None:
            busy = self._busy.get(key)
            if busy is None:
                return await self._exclusively(key, self._load(topic, name, at_end))
            await busy.wait()  # opened or reset meanwhile: looked up again
        return found

    async def _exclusively(self, key: tuple[str, str], work: Coroutine[Any, Any, _T]) -> _T:
        """Run ``work``, the one opening or reset of subscription ``key`` now; others wait till it ends."""
        done = self._busy[key] = asyncio.Event()
        try:
            return await work
        finally:
            del self._busy[key]
            done.set()

    async def _load(self, topic: str, name: str, at_end: bool = False) -> Subscription:
        """Open the subscription from the store and make it live."""
        base, index, count = self.partition_of(topic)
        if at_end and not await self.storage.has_cursor(topic, name):
            # Saved now: the subscription exists from here on, and what comes after is kept for it.
            cursor = Cursor(self.storage.last_position(topic))
            await self.storage.save_cursors([(topic, name, cursor)])
        else:
            cursor = await self.storage.load_cursor(topic, name)
        saved = await self.storage.load_consume_mode(base, name)
        mode = self.config.subscription.consume_mode if saved is None else check_consume_mode(saved)
        async with self.settings_lock:  # a change of its settings is saved before or applied after
            own = await self.own_settings(base, name)
            subscription = Subscription(
                topic,
                name,
                cursor,
                self.storage,
                self.config.subscription,
                consume_mode=mode,
                own_settings=own,
                slots=partition_slots(index, count),
                partition=index if count > 1 else -1,
                settings_topic=base,
                may_act=None if self._broker is None else self._broker.lease_valid,
            )
            if not self.storage.serves(topic) or topic in self._closing:  # it moved away while loading
                raise ProtocolError(
                    ErrorCode.NOT_OWNER, f"this broker stopped serving {topic!r}; look the topic up again"
                )
            subscription.start()
            self._subscriptions[(topic, name)] = subscription
        return subscription

    # -- partitions ------------------------------------------------------------------

    def partitions(self) -> dict[str, int]:
        """Every topic created with partitions, and how many it has."""
        return dict(self._partitions)

    def partition_of(self, served: str) -> tuple[str, int, int]:
        """``(topic, partition, partitions)`` of a served topic name: ``(name, 0, 1)`` unless it is
        ``T-partition-p`` of a topic T created with more than p partitions."""
        split = split_partition_topic(served)
        if split is not None:
            topic, index = split
            count = self._partitions.get(topic, 1)
            if index < count:
                return topic, index, count
        return served, 0, 1

    def partition_names(self, topic: str) -> list[str]:
        """The names ``topic``'s partitions are served under (itself when it has one)."""
        count = self._partitions.get(topic, 1)
        return [partition_topic(topic, index, count) for index in range(count)]

    def learn_partitions(self, topic: str, partitions: int) -> None:
        """Record ``topic``'s partition count (fixed at creation), as the cluster tells it."""
        self._partitions[topic] = partitions

    async def create_topic(self, topic: str, partitions: int) -> bool:
        """Create ``topic`` with ``partitions``; False when it exists with as many (refused with another count)."""
        if self._directory is None:
            raise KeyFailoverError("the server is not started")
        created = await self._directory.create_partitioned_topic(topic, partitions)
        self._partitions[topic] = partitions
        return created

    async def partition_count(self, topic: str) -> int | None:
        """How many partitions ``topic`` was created with (None: not created with partitions, or unknown)."""
        if self._broker is not None:
            return (await self._broker.partition_counts()).get(topic)
        return self._partitions.get(topic)

    async def topic_names(self) -> list[str]:
        """Every topic of the server or cluster, each partition of a topic created with several under its own
        name: a cluster's topics are those ZooKeeper knows, a single server's those of the log and those
        created with partitions."""
        counts = await self._broker.partition_counts() if self._broker is not None else self._partitions
        names = set() if self._broker is not None else set(self.storage.topics())
        for topic, count in counts.items():
            names.update(partition_topic(topic, index, count) for index in range(count))
        return sorted(names)

    async def route(self, topic: str, pulsar: bool = False) -> list[str | None]:
        """The broker serving each partition of ``topic`` (``""``: this one, a single server): its
        address, or with ``pulsar`` its Pulsar protocol endpoint's (None: none now)."""
        if self._broker is not None:
            return await self._broker.route(topic, pulsar)
        return [""] * self._partitions.get(topic, 1)

    async def open_served(self, served: str) -> None:
        """Serve ``served`` (a topic or partition): its subscriptions with saved cursors go live."""
        self._closing.discard(served)
        for name in await self.storage.subscriptions(served):
            await self.subscription(served, name)

    def wake_all(self) -> None:
        """Wake every subscription's pump (a broker's lease was renewed: what waited may go out)."""
        for subscription in self._subscriptions.values():
            subscription.wake()

    async def close_served(self, served: str, reason: str) -> None:
        """Stop serving ``served``: its subscriptions save their cursors and tell their consumers ``reason``.

        From the start no subscription opens on it and no produce or subscribe is taken
        (``not_owner``) until :meth:`open_served` serves it again.
        """
        self._closing.add(served)
        for watcher in self._watchers.pop(served, set()):
            watcher.topic_closed()
        closing = [self._subscriptions.pop(key) for key in [key for key in self._subscriptions if key[0] == served]]
        for subscription in closing:  # none delivers on from here, however long saving the cursors takes
            subscription.stop(reason)
        for subscription in closing:
            await subscription.close(reason)

    def check_served(self, served: str, action: str) -> tuple[int, int] | None:
        """The block of slots of the partition ``served`` names (None: the whole space), or the
        :class:`ProtocolError` to answer a request to ``action`` it: a partitioned topic itself
        (``wrong_partition``) or a topic this broker does not serve (``not_owner``)."""
        count = self._partitions.get(served, 1)
        if count > 1:
            raise ProtocolError(
                ErrorCode.WRONG_PARTITION,
                f"topic {served!r} has {count} partitions; {action} its partitions {served}-partition-0 to "
                f"{served}-partition-{count - 1} (a keyfailover client routes each key to its partition)",
            )
        split = split_partition_topic(served)
        if split is not None and split[1] >= self._partitions.get(split[0], split[1] + 1) > 1:
            raise ProtocolError(
                ErrorCode.WRONG_PARTITION,
                f"topic {split[0]!r} has {self._partitions[split[0]]} partitions, numbered from 0; "
                f"it has no partition {split[1]}",
            )
        if not self.storage.serves(served) or served in self._closing:
            raise ProtocolError(
                ErrorCode.NOT_OWNER,
                f"this broker does not serve {served!r} now; look the topic up again to find the broker that does",
            )
        _, index, partitions = self.partition_of(served)
        return partition_slots(index, partitions) if partitions > 1 else None

    def check_produce(self, topic: str, messages: list[tuple[int | None, Key, bytes]]) -> None:
        """Raise the :class:`ProtocolError` to answer a produce of ``messages`` to ``topic`` with, if any: a
        topic not served here, a partitioned topic itself, or a key outside the partition's slots."""
        block = self.check_served(topic, "produce to")
        if block is not None:
            _check_keys(topic, messages, *block)

    async def open_subscription(self, topic: str, name: str, at_end: bool = False) -> Subscription:
        """The live subscription a consumer subscribes to, or the :class:`ProtocolError` that refuses it; a new
        one starts after the topic's last message with ``at_end``, else at its first."""
        if self.closing:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        self.check_served(topic, "subscribe to")
        dlq = dead_letter_topic(topic, name)
        if self.config.subscription.delivery.max_redeliveries is not None and len(dlq) > MAX_NAME_LENGTH:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"the dead-letter topic name {dlq[:40]!r}... would be {len(dlq)} characters; expected topic "
                f"and subscription names short enough for <topic>-<subscription>-DLQ to fit {MAX_NAME_LENGTH}",
            )
        return await self.subscription(topic, name, at_end)

    async def unsubscribe(self, subscription: Subscription) -> None:
        """End ``subscription`` for good (its last consumer asked): it stops, leaves service and its saved
        cursor is forgotten, so a subscribe with its name starts a new one. A :class:`ProtocolError`
        (``consumer_busy``), changing nothing, while it has consumers."""
        if subscription.sessions:
            raise ProtocolError(
                ErrorCode.CONSUMER_BUSY,
                f"subscription {subscription.name!r} of {subscription.topic!r} has {len(subscription.sessions)} "
                "consumer(s); expected none but the one unsubscribing",
            )
        key = (subscription.topic, subscription.name)
        if self._subscriptions.get(key) is subscription:
            del self._subscriptions[key]
        await subscription.close("unsubscribed")
        await self.storage.delete_cursor(subscription.topic, subscription.name)

    async def seek(self, topic: str, name: str, position: int) -> int:
        """Reset subscription ``name`` of ``topic`` (a topic or partition this broker serves) so that its next
        deliveries start at ``position``: everything before it counts as acked, everything from it on as not.

        A position before the topic's first message is its first, one past its last message is its end
        (what comes later). Every consumer session ends (``consumer_closed`` with reason ``"seek"``; a
        Pulsar consumer is sent CLOSE_CONSUMER) and the subscription opens again from the store with the new
        cursor: nothing held or in flight in the old dispatcher carries over. Returns the position the
        subscription starts at. A :class:`ProtocolError`, changing nothing, for a subscription that does not
        exist (``unknown_subscription``) or a topic this broker does not serve (``not_owner``); a seek that
        fails to save its cursor leaves the one the subscription had (its consumers subscribe again).
        """
        if self.closing:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down; nothing was changed")
        self.check_served(topic, "seek")
        key = (topic, name)
        while (busy := self._busy.get(key)) is not None:
            await busy.wait()  # an opening or another seek of it: this one comes after
        return await self._exclusively(key, self._reset(topic, name, position))

    async def _reset(self, topic: str, name: str, position: int) -> int:
        """The body of :meth:`seek`, while the subscription is busy (no subscribe opens it meanwhile)."""
        old = self._subscriptions.get((topic, name))
        if old is None and not await self.storage.has_cursor(topic, name):
            raise ProtocolError(
                ErrorCode.UNKNOWN_SUBSCRIPTION,
                f"subscription {name!r} of {topic!r} does not exist; expected one with consumers or a saved cursor",
            )
        start = min(max(position, 1), self.storage.last_position(topic) + 1)
        if old is not None:
            del self._subscriptions[(topic, name)]
            await old.close("seek")  # its sessions end, its pump stops, its cursor is saved
        try:
            await self.storage.save_cursors([(topic, name, Cursor(start - 1))])
        finally:  # live again: with the new cursor, or with the one it had when the save failed
            if not self.closing and self.storage.serves(topic) and topic not in self._closing:
                await self._load(topic, name)
        _log.info("subscription %s/%s reset: its next deliveries start at position %d", topic, name, start)
        return start

    def next_session_id(self) -> int:
        """A new consumer session id, never used before on this server."""
        return next(self._session_ids)

    def _committed(self, topic: str) -> None:
        """Messages were committed to ``topic``: wake its subscriptions' pumps and tell its watchers."""
        for (sub_topic, _), subscription in self._subscriptions.items():
            if sub_topic == topic:
                subscription.committed()
        for watcher in list(self._watchers.get(topic, ())):
            watcher.committed()

    def watch(self, served: str, watcher: TailWatcher) -> None:
        """Tell ``watcher`` of each commit to ``served`` and when this server stops serving it."""
        self._watchers.setdefault(served, set()).add(watcher)

    def unwatch(self, served: str, watcher: TailWatcher) -> None:
        """Stop telling ``watcher`` of ``served``."""
        watchers = self._watchers.get(served)
        if watchers is not None:
            watchers.discard(watcher)
            if not watchers:
                del self._watchers[served]

    # -- liveness --------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        """Close connections that did not log in in time or trickle a frame too slowly; end the sessions of
        connections silent for a session timeout, and close those silent for three."""
        config = self.config
        timeout = config.session_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, config.login_timeout / 4, config.frame_timeout / 4, 1.0))
            now = time.monotonic()
            for connection in list(self._connections):
                silent = now - connection.last_seen
                if not connection.authenticated and now - connection.opened > config.login_timeout:
                    connection.refuse(ErrorCode.NOT_CONNECTED, f"no connect within {config.login_timeout} s")
                elif connection.partial_since is not None and now - connection.partial_since > config.frame_timeout:
                    connection.refuse(ErrorCode.SLOW_CONNECTION, f"a frame took over {config.frame_timeout} s")
                else:
                    if silent > timeout and connection.sessions_open():
                        _log.warning(
                            "nothing from %s for %.1f s: its consumer sessions time out", connection.peer, silent
                        )
                        connection.expire_sessions("timeout")
                    if silent > 3 * timeout and not connection.closed:
                        _log.warning("nothing from %s for %.1f s: closing the connection", connection.peer, silent)
                        connection.close()

    def connected(self, connection: ClientConnection) -> bool:
        """Count ``connection`` in; False (not counted) when the server has its maximum already."""
        if len(self._connections) >= self.config.max_connections:
            return False
        self._connections.add(connection)
        return True

    def disconnected(self, connection: ClientConnection) -> None:
        """Count ``connection`` out."""
        self._connections.discard(connection)


def _reason(exc: OSError) -> str:
    """An OSError's reason without the errno and address asyncio wraps around it."""
    if exc.errno is not None and exc.errno > 0:
        return os.strerror(exc.errno).lower()
    return exc.strerror or str(exc)


def _check_keys(topic: str, messages: list[tuple[int | None, Key, bytes]], first: int, last: int) -> None:
    """Refuse a produce to a partition (slots ``first`` to ``last``) that holds a key of another."""
    for index, (_, key, _) in enumerate(messages):
        if key is not None and not first <= key_hash(key) <= last:
            raise ProtocolError(
                ErrorCode.WRONG_PARTITION,
                f"message {index}'s key {key!r:.60} hashes to slot {key_hash(key)}, outside {topic!r}'s "
                f"slots {first} to {last}; nothing was stored (route each key to the partition of its slot)",
            )
