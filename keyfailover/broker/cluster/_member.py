"""One broker's part in level 1 (the Rebalanser ZooKeeper design).

ZooKeeper layout under ``root``:

- ``brokers/b-NNNNNNNNNN``: one ephemeral sequential znode per live broker (its id and address,
  and its admin and Pulsar endpoints when it has them). The lowest is the coordinator; every
  other broker watches the next lower one, so a departure wakes one broker, not all.
- ``epoch``: the coordinator epoch. A new coordinator bumps it with a versioned write, so
  two brokers can never both believe they won the same epoch.
- ``assignment``: partitions -> brokers, with the coordinator's epoch and a generation (+1 at
  every change). The coordinator writes it in a ZooKeeper transaction that also checks the
  ``epoch`` znode is still at the version its own bump left: once another broker has become
  coordinator, a zombie's write fails, and it steps down.
- ``topics/T``: a topic's partition count, fixed at creation.
- ``barriers/T-p``: an ephemeral znode held by the broker serving partition p of T. A broker
  that is assigned a partition serves it only once it created the barrier: after the previous
  owner released it or its session expired (Resource Barrier).

Every ZooKeeper event (a watch, a session change) only queues work; one thread per member
does the work in order, and calls ``on_acquired`` / ``on_released`` from that thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import quote, unquote

from keyfailover.core.errors import ConfigError
from keyfailover.core.partitions import Assignment, PartitionId, check_partition_count

__all__ = ["ClusterMember", "ClusterState", "cluster_status", "connect", "create_topic", "parse_cluster_url"]

_IN_SESSION = frozenset({"elect", "rebalance", "assignment", "barrier"})
"""The worker's events that act in ZooKeeper for the member: only while it is registered in kazoo's session."""

_log = logging.getLogger("keyfailover.cluster")
_ownership = logging.getLogger("keyfailover.ownership")  # what a new owner waits for, printed by every broker

LEASE_SHARE = 0.8
"""A member acts on its partitions only within this share of the session timeout after ZooKeeper last
answered it (see :meth:`ClusterMember.lease_valid`)."""

PAUSE_SHARE = 0.5
"""A member whose lease stays lapsed this share of a session timeout longer gives its partitions up: it ends its
session and joins again with a new one (see :meth:`ClusterMember.lease_valid`)."""

UNSAFE_NO_LEASE = "KEYFAILOVER_UNSAFE_NO_LEASE"
"""An environment variable for ``keyfailover chaos``'s own tests only: set to 1, a member's lease never
lapses (as before brokers had one), so the tests can show the harness catching two owners at once."""


def parse_cluster_url(url: str) -> tuple[str, str]:
    """``zk://HOST:PORT[,HOST:PORT...]/PATH`` -> ``(kazoo hosts, root path)``; :class:`ConfigError` otherwise."""
    prefix = "zk://"
    rest = url[len(prefix) :] if isinstance(url, str) and url.startswith(prefix) else ""
    hosts, slash, path = rest.partition("/")
    root = "/" + path.rstrip("/")
    servers = hosts.split(",") if hosts else []
    valid = all(host.rpartition(":")[0] and host.rpartition(":")[2].isdigit() for host in servers)
    if not slash or not servers or not valid or root == "/":
        raise ConfigError(f"cluster URL {url!r} is not of the form zk://HOST:PORT[,HOST:PORT...]/PATH")
    return hosts, root


def connect(hosts: str, timeout: float = 10.0) -> Any:
    """A started kazoo client; :class:`ConfigError` naming ``hosts`` when ZooKeeper cannot be reached.

    After a dropped connection it tries again at most a tenth of ``timeout`` apart (kazoo's own
    backoff doubles up to an hour), so that a link that comes back finds the session still alive.
    """
    from kazoo.client import KazooClient
    from kazoo.handlers.threading import KazooTimeoutError
    from kazoo.retry import KazooRetry

    reconnect = KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=timeout / 10)
    zk = KazooClient(hosts=hosts, timeout=timeout, connection_retry=reconnect)
    try:
        zk.start(timeout=timeout)
    except KazooTimeoutError:
        zk.close()
        raise ConfigError(f"cannot reach ZooKeeper at {hosts} within {timeout:g} s") from None
    return zk


def cluster_status(zk: Any, root: str) -> dict[str, Any]:
    """The cluster at ``root`` as ZooKeeper holds it (JSON-safe): brokers (the first is the
    coordinator), coordinator epoch, topics and their partition counts, and the assignment."""
    if zk.exists(root) is None:
        raise ConfigError(f"there is no keyfailover cluster at {root} (no broker or topic was ever registered there)")
    brokers = _brokers(zk, root)
    written_epoch, assignment = _parse_assignment(_data(zk, f"{root}/assignment"))
    return {
        "root": root,
        "coordinator": brokers[0]["id"] if brokers else None,
        "epoch": int(_data(zk, f"{root}/epoch") or b"0"),
        "brokers": brokers,
        "topics": _topics(zk, root),
        "assignment": {
            "epoch": written_epoch,
            "generation": assignment.generation,
            "partitions": [
                {"topic": topic, "partition": index, "broker": broker}
                for (topic, index), broker in sorted(assignment.owners.items())
            ],
        },
    }


def _data(zk: Any, path: str) -> bytes:
    """The data of the znode at ``path``; empty when there is none."""
    from kazoo.exceptions import NoNodeError

    try:
        return bytes(zk.get(path)[0])
    except NoNodeError:
        return b""


def _children(zk: Any, path: str, watch: Callable[[Any], None] | None) -> list[str]:
    """The sorted children of ``path`` (none when it does not exist), setting ``watch`` on it."""
    from kazoo.exceptions import NoNodeError

    try:
        return sorted(zk.get_children(path, watch=watch))
    except NoNodeError:
        return []


def _brokers(zk: Any, root: str, watch: Callable[[Any], None] | None = None) -> list[dict[str, Any]]:
    """Every registered broker (its znode's ``node`` name, ``id``, ``address``), lowest znode first;
    one whose znode went while they were read is left out."""
    found = []
    for child in _children(zk, f"{root}/brokers", watch):
        data = _data(zk, f"{root}/brokers/{child}")
        if data:
            found.append({"node": child, **json.loads(data)})
    return found


def _topics(zk: Any, root: str, watch: Callable[[Any], None] | None = None) -> dict[str, int]:
    """Every topic and its partition count."""
    return {
        unquote(child): int(_data(zk, f"{root}/topics/{child}")) for child in _children(zk, f"{root}/topics", watch)
    }


def _topic_node(root: str, topic: str) -> str:
    """The znode of ``topic`` under the cluster ``root``: its partition count, the name quoted."""
    return f"{root}/topics/{quote(topic, safe='')}"


def create_topic(zk: Any, root: str, topic: str, partitions: int) -> bool:
    """Create ``topic`` with ``partitions`` in the cluster at ``root``; False if it exists with as many.

    A topic that exists with another partition count is refused (:class:`ConfigError`):
    the count is fixed at creation.
    """
    from kazoo.exceptions import NodeExistsError

    check_partition_count(partitions)
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"a topic name must be a non-empty str, not {topic!r}")
    node = _topic_node(root, topic)
    zk.ensure_path(f"{root}/topics")
    try:
        zk.create(node, str(partitions).encode())
    except NodeExistsError:
        existing = int(zk.get(node)[0])
        if existing != partitions:
            raise ConfigError(
                f"topic {topic!r} exists with {existing} partitions; a topic's partition count is fixed at "
                f"creation, so it cannot be created again with {partitions}"
            ) from None
        return False
    return True


@dataclass(frozen=True)
class ClusterState:
    """What one member knows, for status pages and tests."""

    broker_id: str
    coordinator: bool
    epoch: int
    """The coordinator epoch this member won (0 if it never coordinated)."""
    applied: tuple[int, int]
    """``(epoch, generation)`` of the assignment it applied last."""
    assignment: Assignment
    owned: frozenset[PartitionId]
    """The partitions whose barrier it holds: those it serves."""
    topics: dict[str, int]
    """Every topic and its partition count, as of the assignment it applied last."""
    addresses: dict[str, str]
    """Every broker's address by id, as of the assignment it applied last."""
    pulsar_addresses: dict[str, str]
    """The ``HOST:PORT`` of each broker's Pulsar protocol endpoint by id, for those that have one."""
    coordinator_id: str | None = None
    """The coordinator's id (the broker with the lowest znode), as of the assignment it applied last."""
    admin_addresses: dict[str, str] = field(default_factory=dict)
    """Each broker's admin endpoint URL by id, for those that have one."""


class ClusterMember:
    """A broker's membership in the cluster at ``root`` of the ZooKeeper ensemble ``hosts``.

    ``on_acquired(partition)`` is called once the broker holds the partition's barrier (it may
    serve it now); ``on_released(partition)`` before it lets the barrier go (it must stop
    serving it first). Both run on the member's worker thread.

    The lease: ZooKeeper ends the member's session (and another broker may take its partitions)
    no sooner than a session timeout after it last heard from the member. A request that ZooKeeper
    answered proves the session was alive when it was sent, so the member may act on its
    partitions until :data:`LEASE_SHARE` of a session timeout after sending it (:meth:`lease_valid`);
    a thread sends such a request every eighth of a session timeout, without waiting for the last
    one's answer (on a slow link each answer still renews from when its request left). A connection
    that dropped and came back in the same session renews it too, from when the drop was noticed:
    ZooKeeper took the reconnection, sent after that, as hearing from the session. A process that
    was stopped (SIGSTOP, a long pause) finds its lease lapsed when it wakes, before it has heard of
    any new owner.
    A pause is bounded: ZooKeeper may go on hearing a member whose answers do not get back (a link
    that loses what comes from ZooKeeper, or delays it past the lease), so its session, and its hold
    on its partitions, would outlive the fault. A lease lapsed for :data:`PAUSE_SHARE` of a session
    timeout more makes the member give its partitions up (``on_released`` for each) and end its
    session: ZooKeeper removes its barriers as soon as the close arrives, or a session timeout after
    it last heard from the member, and the coordinator gives the partitions to the others. The
    member joins again with a new session once ZooKeeper answers.
    ``on_lease(valid, at)`` is called when the lease lapses (``at``: the monotonic time it did) and
    when it is renewed after a lapse, in that order, under the member's lock (it must not call the
    member back). The lease assumes ZooKeeper grants the session timeout asked for: its
    ``maxSessionTimeout`` must be at least that (ZooKeeper's default is 20 ticks).
    """

    def __init__(
        self,
        hosts: str,
        root: str,
        broker_id: str,
        address: str,
        *,
        session_timeout: float = 10.0,
        min_rebalance_interval: float = 0.0,
        on_acquired: Callable[[PartitionId], None] | None = None,
        on_released: Callable[[PartitionId], None] | None = None,
        admin: str | None = None,
        on_lease: Callable[[bool, float], None] | None = None,
        pulsar: str | None = None,
    ) -> None:
        if not root.startswith("/") or root.endswith("/"):
            raise ConfigError(f"the cluster root must be a ZooKeeper path like /keyfailover, not {root!r}")
        if not isinstance(broker_id, str) or not broker_id:
            raise ConfigError(f"a broker id must be a non-empty str, not {broker_id!r}")
        self.hosts, self.root, self.broker_id, self.address = hosts, root, broker_id, address
        self.admin = admin  # the broker's admin endpoint URL, for cluster status
        self.pulsar = pulsar  # HOST:PORT of the broker's Pulsar protocol endpoint, for Pulsar clients' lookups
        self.session_timeout = session_timeout
        self.min_rebalance_interval = min_rebalance_interval
        self._on_acquired = on_acquired or (lambda partition: None)
        self._on_released = on_released or (lambda partition: None)
        self._events: queue.Queue[str] = queue.Queue()
        self._lock = threading.Lock()
        self._zk: Any = None
        self._node = ""  # our znode's name under brokers/
        self._coordinating = False
        self._epoch = 0
        self._epoch_version = -1  # the epoch znode's version after our bump
        self._last_rebalance = 0.0
        self._applied = (0, 0)
        self._assignment = Assignment(0)
        self._owned: set[PartitionId] = set()
        self._topics: dict[str, int] = {}
        self._addresses: dict[str, str] = {}
        self._pulsar_addresses: dict[str, str] = {}
        self._admin_addresses: dict[str, str] = {}
        self._coordinator_id: str | None = None
        self._waiting: set[PartitionId] = set()  # assigned to us, barrier still held by another
        self._said_held: dict[PartitionId, str] = {}  # partitions whose held barrier we logged, and by whom
        self._assigned_at: dict[PartitionId, float] = {}  # time.monotonic() an assignment gave us one we wait for
        self._worker: threading.Thread | None = None
        self._wake = {kind: self._waker(kind) for kind in ("elect", "rebalance", "assignment", "barrier")}
        self._on_lease = on_lease or (lambda valid, at: None)
        self._lease = math.inf if os.environ.get(UNSAFE_NO_LEASE) == "1" else LEASE_SHARE * session_timeout
        self._confirmed = 0.0  # time.monotonic() a request was sent that ZooKeeper answered in our session
        self._lapsed = False
        self._pause = PAUSE_SHARE * session_timeout
        self._stepping_out = False  # a lapse outlasted the pause: the session is ended (until a renewal or a new one)
        self._ended = False  # the session is being ended (a pause outlasted): no renewal in it; "lost" starts anew
        self._registered_at = 0.0  # time.monotonic() our broker znode was created
        self._session: Any = None  # kazoo's client_id of the session our znodes live in
        self._losses: deque[Any] = deque()  # per queued "lost": the session our znodes were in when it was lost
        self._registered = False  # our broker znode lives in kazoo's session (False from a LOST to the next one)
        self._dropped_at: float | None = None  # time.monotonic() kazoo said the connection dropped (SUSPENDED)
        self._renewer: threading.Thread | None = None
        self._stopping = threading.Event()
        self._leaving = threading.Event()  # stop() was called: the worker's waits end

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> ClusterMember:
        """Connect, register and take part; raises :class:`ConfigError` when ZooKeeper cannot be reached."""
        self._zk = connect(self.hosts, self.session_timeout)
        self._zk.add_listener(self._session_changed)
        for path in ("brokers", "topics", "barriers", "epoch", "assignment"):  # empty epoch: 0
            self._zk.ensure_path(f"{self.root}/{path}")
        self._register()
        self._stopping.clear()
        self._leaving.clear()
        self._renewer = threading.Thread(target=self._renew, name=f"lease {self.broker_id}", daemon=True)
        self._renewer.start()
        self._worker = threading.Thread(target=self._work, name=f"cluster {self.broker_id}", daemon=True)
        self._worker.start()
        self._events.put("elect")
        self._events.put("assignment")
        return self

    def stop(self) -> None:
        """Stop serving every partition, release the barriers and leave (idempotent)."""
        self._leaving.set()
        if self._worker is not None:
            self._events.put("stop")
            self._worker.join(timeout=30)
            self._worker = None
        self._stopping.set()
        if self._renewer is not None:
            self._renewer.join(timeout=30)
            self._renewer = None
        if self._zk is not None:
            self._zk.stop()
            self._zk.close()
            self._zk = None

    def __enter__(self) -> ClusterMember:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def state(self) -> ClusterState:
        """A snapshot of this member's part in the cluster, taken under its lock."""
        with self._lock:
            return ClusterState(
                self.broker_id,
                self._coordinating,
                self._epoch,
                self._applied,
                self._assignment,
                frozenset(self._owned),
                dict(self._topics),
                dict(self._addresses),
                dict(self._pulsar_addresses),
                self._coordinator_id,
                dict(self._admin_addresses),
            )

    def assigned_at(self, partition: PartitionId) -> float | None:
        """``time.monotonic()`` when this member applied the assignment that gave it ``partition``, while it
        waits for the partition's barrier and during ``on_acquired``; None otherwise."""
        return self._assigned_at.get(partition)

    def topics(self) -> dict[str, int]:
        """Every topic of the cluster and its partition count, read from ZooKeeper now."""
        return _topics(self._zk, self.root)

    def create_topic(self, topic: str, partitions: int) -> bool:
        """:func:`create_topic` in this member's cluster."""
        return create_topic(self._zk, self.root, topic, partitions)

    # -- the lease -------------------------------------------------------------------

    @property
    def lease_end(self) -> float:
        """``time.monotonic()`` until which the member may act on its partitions (see :meth:`lease_valid`)."""
        with self._lock:
            return self._confirmed + self._lease

    def lease_valid(self) -> bool:
        """Whether the member may act on its partitions now: ZooKeeper answered a request of its session
        sent less than the lease ago (a lapse is reported through ``on_lease`` once)."""
        now = time.monotonic()
        with self._lock:  # the report too, so a renewal cannot be said before the lapse it ends
            end = self._confirmed + self._lease
            if now < end:
                return True
            if not self._lapsed:
                self._lapsed = True
                self._on_lease(False, end)
            return False

    def _renew(self) -> None:
        """Ask ZooKeeper for an answer every eighth of a session timeout; each answer renews the lease.

        While the lease is lapsed, ask only every half session timeout: kazoo sends its own pings only
        after a third of a session timeout without a request, and only an unanswered ping makes it drop a
        dead connection (and try the ensemble's other servers), so asking more often would keep it on a
        dead link for good. While the member ends its session, ask nothing."""
        sent = -math.inf
        while not self._stopping.wait(self.session_timeout / 8):
            zk = self._zk
            if zk is None:
                return
            valid = self.lease_valid()  # no answer for a while: report a lapse as soon as there is one
            if self._pause_outlasted():
                self._end_session(zk)
            if self._stepping_out or (not valid and time.monotonic() - sent < self.session_timeout / 2):
                continue
            session, began = zk.client_id, time.monotonic()
            sent = began
            try:
                zk.exists_async(self.root).rawlink(partial(self._answered, session, began))
            except Exception:  # kazoo closing: the next turn sees it stopped or stopping
                _log.debug("cluster member %s: a lease renewal could not be sent", self.broker_id, exc_info=True)

    def _pause_outlasted(self) -> bool:
        """Whether the lease stayed lapsed the pause past its end (or past our registration), first noticed now."""
        with self._lock:
            since = max(self._confirmed + self._lease, self._registered_at)
            if not self._lapsed or self._stepping_out or time.monotonic() < since + self._pause:
                return False
            # Decided under the lock, with the lease lapsed: from here on nothing renews it in this session, as
            # our close lets ZooKeeper end the session at once, sooner than the lease assumes (see _confirm).
            self._stepping_out = True
            self._ended = True
            return True

    def _end_session(self, zk: Any) -> None:
        """The lease stayed lapsed past the pause: end the session (on the renewer's thread, as the worker may
        be waiting in a call that only a reconnection, or this, ends), so that the coordinator gives our
        partitions to the others. The worker stops serving them and comes back in a new session ("lost";
        once more if kazoo says LOST too, the second of a session left already). A close ZooKeeper gets
        ends the session at once, else it expires a session timeout after ZooKeeper last heard from us;
        kazoo's connection thread ends when the close is answered or, no renewals sent meanwhile, when its
        own ping goes unanswered."""
        from kazoo.exceptions import WriterNotClosedException

        with self._lock:
            lapsed = self._confirmed + self._lease
            self._coordinating = False
        _ownership.info(
            "broker %s gives up its partitions: its lease lapsed %.2f s ago and ZooKeeper has not answered since; "
            "it ends its ZooKeeper session so that the others take them, and joins again with a new one",
            self.broker_id,
            time.monotonic() - lapsed,
        )
        try:
            zk.stop()
        except WriterNotClosedException:  # its thread was not done within max(10 s, session): start_async waits
            _log.warning("cluster member %s: kazoo's connection did not close in time", self.broker_id)
        with self._lock:  # kazoo says LOST only if it was not LOST already (an expiry found on reconnecting)
            self._losses.append(self._session)
            self._registered = False
        self._events.put("lost")

    def _answered(self, session: Any, began: float, answer: Any) -> None:
        """The answer to a renewal sent at ``began`` in ``session`` (kazoo's callback thread)."""
        if not answer.successful():
            return
        zk = self._zk
        with self._lock:
            if zk is None or session != self._session or zk.client_id != session:
                return  # an answer in another session than our znodes': not ours (released on LOST)
            self._confirm(began)

    def _confirm(self, heard: float) -> None:
        """ZooKeeper heard from our session at ``heard`` or later: the lease runs from there (under the lock).

        Not in a session we are ending (:meth:`_end_session`): ZooKeeper ends it as soon as our close
        arrives, not a session timeout after it last heard from us, so an answer or a reconnection in it
        proves nothing about the time left; a new session's registration starts the lease again."""
        if self._ended:
            return
        self._confirmed = max(self._confirmed, heard)
        if self._lapsed and time.monotonic() < self._confirmed + self._lease:
            self._lapsed = False
            self._stepping_out = False  # a later lapse may outlast the pause again
            self._on_lease(True, heard)

    # -- the worker ------------------------------------------------------------------

    def _work(self) -> None:
        """The worker thread: carry out each queued event in order (elect, rebalance, assignment, barrier, lost)
        until stopped."""
        from kazoo.exceptions import KazooException

        handlers: dict[str, Callable[[], None]] = {
            "elect": self._elect,
            "rebalance": self._rebalance,
            "assignment": self._apply,
            "barrier": self._acquire_waiting,
            "lost": self._session_lost,
        }
        while True:
            kind = self._events.get()
            if kind == "stop":
                try:
                    self._release(set(self._owned))
                except KazooException:  # not connected: the barriers go with the session, which stop() closes
                    _log.info("broker %s left its barriers to the end of its session", self.broker_id)
                return
            if kind in _IN_SESSION and not self._in_session():
                continue  # between a session's end and our registration in the next: "lost" queues them again
            try:
                handlers[kind]()
            except Exception:
                if self._zk is None or not self._zk.connected:
                    continue  # the session is gone: the listener queues what follows
                _log.exception("cluster member %s: %s failed", self.broker_id, kind)

    def _in_session(self) -> bool:
        """Whether our broker znode lives in kazoo's session (through a drop and a reconnection into it too)."""
        with self._lock:
            return self._registered

    def _waker(self, kind: str) -> Callable[[Any], None]:
        """A watch callback that queues ``kind``: one object per kind, so that kazoo, which keeps a
        set of watchers per path, keeps it once however often the watch is set."""
        return lambda _event: self._events.put(kind)

    def _session_changed(self, state: str) -> None:
        """Kazoo's session listener, on its connection thread: note a drop and a reconnection, queue a loss.

        Kazoo calls it with SUSPENDED before it sends the reconnection's handshake, so a
        reconnection into the same session proves ZooKeeper heard from it after the drop was noted.
        """
        from kazoo.protocol.states import KazooState

        now = time.monotonic()
        with self._lock:
            if state == KazooState.SUSPENDED:
                self._dropped_at = now
            elif state == KazooState.CONNECTED:
                dropped, self._dropped_at = self._dropped_at, None
                zk = self._zk
                if dropped is not None and zk is not None and zk.client_id == self._session:
                    self._confirm(dropped)
            else:
                self._dropped_at = None
        if state == KazooState.LOST:
            with self._lock:
                self._losses.append(self._session)
                self._registered = False
            self._events.put("lost")

    def _session_lost(self) -> None:
        """Our ephemeral znodes are gone with the session: stop serving, and come back as a new member.

        A loss reported twice (a member that ended its session while ZooKeeper expired it) is acted on
        once: a loss of a session other than the one our znode is in now was handled already."""
        with self._lock:
            lost = self._losses.popleft() if self._losses else self._session
        if self._leaving.is_set():
            return  # stopping: nothing to come back to
        if lost != self._session:
            _log.info("broker %s: a loss of an earlier ZooKeeper session, handled already", self.broker_id)
            return
        _ownership.info("broker %s lost its ZooKeeper session: it stops serving and joins again", self.broker_id)
        with self._lock:
            self._coordinating = False
            # What it applied went with the session: the assignment as it stands is applied afresh, even
            # when the coordinator never rewrote it (it still names this broker, which came back before a
            # rebalance could move its partitions, so no newer generation would ever come).
            self._applied = (0, 0)
        self._on_release_all()
        self._waiting.clear()
        self._said_held.clear()
        self._assigned_at.clear()
        with self._lock:
            ended, self._ended = self._ended, False
        if ended:  # we stopped kazoo to end the session: a new one, as soon as ZooKeeper can be reached
            zk = self._zk
            zk.start_async()
            while not zk.connected:
                if self._leaving.wait(0.05):
                    return
        self._zk.retry(self._register)
        self._events.put("elect")
        self._events.put("assignment")

    def _on_release_all(self) -> None:
        """Stop serving every partition this broker holds, as when it leaves or loses its session."""
        for partition in sorted(self._owned):
            self._on_released(partition)
        with self._lock:
            self._owned.clear()

    def _register(self) -> None:
        """Create our broker znode; ZooKeeper's answer, to a request of this session sent now, starts the lease."""
        began = time.monotonic()
        record = {"id": self.broker_id, "address": self.address}
        if self.admin is not None:
            record["admin"] = self.admin
        if self.pulsar is not None:
            record["pulsar"] = self.pulsar
        data = json.dumps(record).encode()
        path = self._zk.create(f"{self.root}/brokers/b-", data, ephemeral=True, sequence=True)
        self._node = path.rsplit("/", 1)[1]
        with self._lock:
            self._session = self._zk.client_id
            self._registered = True
            self._registered_at = time.monotonic()
            self._stepping_out = False  # a new session: its own pause may be outlasted again
            self._confirm(began)

    # -- election --------------------------------------------------------------------

    def _elect(self) -> None:
        """Become the coordinator when this broker's node is the oldest; else watch the node just before it."""
        members = sorted(self._zk.get_children(f"{self.root}/brokers", watch=self._wake["rebalance"]))
        if self._node not in members:
            return  # our session was lost: the listener re-registers us
        index = members.index(self._node)
        if index == 0:
            if not self._coordinating:
                self._become_coordinator()
            return
        before = f"{self.root}/brokers/{members[index - 1]}"
        if self._zk.exists(before, watch=self._wake["elect"]) is None:
            self._events.put("elect")

    def _become_coordinator(self) -> None:
        """Take the next coordinator epoch with a conditional write, then rebalance under it; look again if beaten to
        it."""
        from kazoo.exceptions import BadVersionError

        data, stat = self._zk.get(f"{self.root}/epoch")
        epoch = int(data or b"0") + 1
        try:
            written = self._zk.set(f"{self.root}/epoch", str(epoch).encode(), version=stat.version)
        except BadVersionError:
            self._events.put("elect")  # another bump came first: look again
            return
        with self._lock:
            self._coordinating = True
            self._epoch = epoch
        self._epoch_version = written.version
        _log.info("broker %s is the coordinator, epoch %d", self.broker_id, epoch)
        self._zk.get_children(f"{self.root}/topics", watch=self._wake["rebalance"])
        self._events.put("rebalance")

    # -- the coordinator's assignment ------------------------------------------------

    def _rebalance(self) -> None:
        """As coordinator, write a new assignment of every partition to the live brokers, at most once a rebalance
        interval."""
        if not self._coordinating:
            return
        wait = self._last_rebalance + self.min_rebalance_interval - time.monotonic()
        if wait > 0:
            timer = threading.Timer(wait, self._events.put, args=("rebalance",))
            timer.daemon = True  # a pending rebalance never keeps a stopping process alive
            timer.start()
            return
        zk, root, wake = self._zk, self.root, self._wake["rebalance"]
        brokers = {broker["id"] for broker in _brokers(zk, root, wake)}
        partitions = [(topic, p) for topic, count in _topics(zk, root, wake).items() for p in range(count)]
        data, stat = zk.get(f"{root}/assignment")
        epoch, current = _parse_assignment(data)
        if epoch > self._epoch:
            self._step_down(epoch)
            return
        planned = current.rebalanced(partitions, brokers)
        if planned is current and epoch == self._epoch:
            return
        # Every write is newer than anything a member applied, a zombie's stray write included.
        generation = max(current.generation, self._applied[1]) + 1
        self.write_assignment(Assignment(generation, planned.owners), stat.version)

    def write_assignment(self, assignment: Assignment, version: int) -> bool:
        """Write ``assignment`` over the znode version ``version``, fenced by our epoch; False if refused.

        Refused when another broker became coordinator since our epoch began (we step down) or
        the assignment changed since ``version`` was read (we rebalance again).
        """
        from kazoo.exceptions import BadVersionError, NoNodeError, RolledBackError

        transaction = self._zk.transaction()
        transaction.check(f"{self.root}/epoch", self._epoch_version)
        transaction.set_data(f"{self.root}/assignment", _assignment_bytes(self._epoch, assignment), version)
        results = transaction.commit()
        failed = [r for r in results if isinstance(r, (BadVersionError, NoNodeError, RolledBackError))]
        if not failed:
            self._last_rebalance = time.monotonic()
            return True
        if isinstance(results[0], BadVersionError):  # the epoch moved on: a newer coordinator
            data = self._zk.get(f"{self.root}/epoch")[0]
            self._step_down(int(data))
        else:
            self._events.put("rebalance")
        return False

    def _step_down(self, epoch: int) -> None:
        """A newer coordinator epoch was seen: stop coordinating and elect again."""
        _log.warning("broker %s steps down: epoch %d is newer than its %d", self.broker_id, epoch, self._epoch)
        with self._lock:
            self._coordinating = False
        self._events.put("elect")

    # -- every broker: apply the assignment ------------------------------------------

    def _apply(self) -> None:
        """Apply the newest assignment: release the partitions no longer ours, then wait for the barriers of the new
        ones."""
        data, _ = self._zk.get(f"{self.root}/assignment", watch=self._wake["assignment"])
        epoch, assignment = _parse_assignment(data)
        if self._coordinating and epoch < self._epoch:
            self._events.put("rebalance")  # not written under our epoch: write it again
        if (epoch, assignment.generation) <= self._applied:
            return  # stale or the same: never go back to an older assignment
        mine = set(assignment.partitions_of(self.broker_id))
        self._release(self._owned - mine)
        topics = _topics(self._zk, self.root)
        brokers = _brokers(self._zk, self.root)
        with self._lock:
            self._applied = (epoch, assignment.generation)
            self._assignment = assignment
            self._topics = topics
            self._addresses = {broker["id"]: broker["address"] for broker in brokers}
            self._pulsar_addresses = {broker["id"]: broker["pulsar"] for broker in brokers if "pulsar" in broker}
            self._admin_addresses = {broker["id"]: broker["admin"] for broker in brokers if "admin" in broker}
            self._coordinator_id = brokers[0]["id"] if brokers else None
        self._waiting = mine - self._owned
        self._said_held = {p: holder for p, holder in self._said_held.items() if p in self._waiting}
        now = time.monotonic()
        self._assigned_at = {partition: self._assigned_at.get(partition, now) for partition in self._waiting}
        self._acquire_waiting()

    def _release(self, partitions: set[PartitionId]) -> None:
        """Stop serving ``partitions`` and delete their barrier znodes, so their new owners may open them."""
        from kazoo.exceptions import NoNodeError

        for partition in sorted(partitions):
            self._on_released(partition)
            with self._lock:
                self._owned.discard(partition)
            with contextlib.suppress(NoNodeError):  # gone with an earlier session
                self._zk.delete(self._barrier(partition))

    def _acquire_waiting(self) -> None:
        """Take the barrier of each partition assigned here whose previous owner released it; open it once taken."""
        from kazoo.exceptions import NodeExistsError, NoNodeError

        for partition in sorted(self._waiting):
            if self._assignment.owners.get(partition) != self.broker_id:
                self._waiting.discard(partition)
                self._said_held.pop(partition, None)
                continue
            path = self._barrier(partition)
            try:
                self._zk.create(path, self.broker_id.encode(), ephemeral=True)
            except NodeExistsError:
                try:
                    holder = bytes(self._zk.get(path, watch=self._wake["barrier"])[0]).decode(errors="replace")
                except NoNodeError:
                    self._events.put("barrier")  # released meanwhile: try again
                    continue
                if self._said_held.get(partition) != holder:
                    self._said_held[partition] = holder
                    _ownership.info(
                        "broker %s waits for the barrier of partition %d of %r, held by broker %s: until it lets "
                        "the partition go or ZooKeeper ends its session",
                        self.broker_id,
                        partition[1],
                        partition[0],
                        holder,
                    )
                continue
            self._waiting.discard(partition)
            if self._said_held.pop(partition, None) is not None:
                assigned = self._assigned_at.get(partition)
                waited = "" if assigned is None else f" {time.monotonic() - assigned:.2f} s after its assignment"
                _ownership.info(
                    "broker %s holds the barrier of partition %d of %r%s",
                    self.broker_id,
                    partition[1],
                    partition[0],
                    waited,
                )
            with self._lock:
                self._owned.add(partition)
            self._on_acquired(partition)
            self._assigned_at.pop(partition, None)

    def _barrier(self, partition: PartitionId) -> str:
        """The barrier znode of ``partition``: held by the broker that serves it, ephemeral in its session."""
        topic, index = partition
        return f"{self.root}/barriers/{quote(topic, safe='')}-{index}"


def _assignment_bytes(epoch: int, assignment: Assignment) -> bytes:
    """The assignment znode's content: JSON of the coordinator ``epoch``, the generation and each partition's owner."""
    owners = [[topic, index, broker] for (topic, index), broker in sorted(assignment.owners.items())]
    return json.dumps({"epoch": epoch, "generation": assignment.generation, "owners": owners}).encode()


def _parse_assignment(data: bytes) -> tuple[int, Assignment]:
    """The epoch and assignment of an assignment znode's content; epoch 0 and an empty generation 0 when empty."""
    if not data:
        return 0, Assignment(0)
    found = json.loads(data)
    owners = {(topic, index): broker for topic, index, broker in found["owners"]}
    return int(found["epoch"]), Assignment(int(found["generation"]), owners)
