"""A fault-injecting TCP proxy: the chaos harness's "random-loss" on a kernel without ``netem``.

A :class:`FaultProxy` listens on loopback and forwards every connection it accepts to one
upstream address, byte for byte and in order. Put one between each process and what it talks
to, and its link can be degraded at runtime, per direction (``"up"``: from the connecting
client to the upstream; ``"down"``: back; ``"both"``):

- :meth:`~FaultProxy.delay`: each chunk is held ``seconds`` (± ``jitter``) after it arrived;
  order is kept, so a chunk never overtakes the one before it.
- :meth:`~FaultProxy.slow`: at most ``bytes_per_second`` forwarded, paced in small pieces.
- :meth:`~FaultProxy.drop`: packet loss as a TCP application feels it (below).
- :meth:`~FaultProxy.blackhole`: a network partition. Connections stay open and the proxy
  keeps reading (up to a bound, then the sender blocks as on a full socket buffer), but
  nothing is forwarded, not even a close; new connections are accepted and held. When it
  is cleared, what was held goes through, as TCP delivers it once a partition heals.
- :meth:`~FaultProxy.reset`: every connection is closed with a TCP reset on both sides, and
  new ones are reset at once (the kernel completes the handshake before the proxy sees it,
  so a client's connect succeeds and its first read fails) until the reset is cleared.

Faults combine (a delay and a loss together are a slow, lossy link) and stay on until
:meth:`~FaultProxy.clear`. Every switch is a :class:`FaultEvent`, kept in
:attr:`~FaultProxy.events` and passed to ``on_event``, in the shape of the chaos records'
``fault`` lines; :meth:`~FaultProxy.stats` counts connections, bytes and held chunks.

The loss model. TCP never loses bytes: a lost segment is sent again after a retransmission
timeout (RTO, at least 200 ms on Linux), the RTO doubles with every loss of the same segment
(up to 120 s), and the receiving application gets nothing behind the hole until it is filled.
So a chunk (what one read returned, up to 64 KiB) stands for a segment: on its turn to be
forwarded it is lost with the probability in force then, waits one RTO, and is tried again,
the RTO doubling each time; everything behind it in that direction waits too. After 15
losses of one chunk (Linux's ``tcp_retries2``) TCP gives up, and so does the proxy: it resets
the connection. What this does not model: a chunk is bigger than a segment, so at the same
probability bulk transfers stall less often than on a real lossy link; the sender's
congestion window does not shrink; the RTO does not follow the measured round trip.

Randomness is seeded: each connection (numbered in accept order) and direction draws from
its own ``random.Random`` derived from the proxy's seed, so the same seed, fault schedule and
traffic give the same jitter and loss decisions whatever the other connections do.

The proxy runs on an asyncio loop: its own, in a thread, after :meth:`~FaultProxy.start` or
``with FaultProxy(...)``, so a synchronous harness can drive it; or the caller's, after
:meth:`~FaultProxy.astart` or ``async with FaultProxy(...)``. The fault methods are
thread-safe either way and may be called before the proxy starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, replace
from types import TracebackType
from typing import Any, Literal

from keyfailover.core.errors import ConfigError
from keyfailover.core.loops import new_loop

__all__ = ["Direction", "FaultEvent", "FaultProxy", "LinkFaults", "ProxyStats", "Stall"]

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, Direction] = ("up", "down")
KINDS = ("delay", "slow", "drop", "blackhole", "reset")

_CHUNK = 65536  # the most one read takes: a "chunk" of the loss model
_QUEUED_CHUNKS = 16  # read ahead per direction (1 MiB at most) before the sender is made to wait
_PACE = 0.02  # a slowed link forwards pieces of this many seconds' worth of bytes
_RTO_MAX = 120.0  # Linux TCP_RTO_MAX
_MAX_LOSSES = 15  # Linux tcp_retries2: then TCP gives the connection up
_STALLS_KEPT = 10000
_CONTROL_TIMEOUT = 30.0  # a thread waiting on the proxy's loop (start, reset, close)


@dataclass(frozen=True)
class LinkFaults:
    """The faults in force on one direction of a proxy's connections (None / False: off)."""

    delay: tuple[float, float] | None = None
    """``(seconds, jitter)``."""
    rate: float | None = None
    """Bytes per second."""
    loss: tuple[float, float] | None = None
    """``(probability, first retransmission timeout in seconds)``."""
    blackhole: bool = False


@dataclass(frozen=True)
class FaultEvent:
    """A fault switched on (``start``) or off (``end``) on the proxy named ``target``.

    The fields are those of the chaos records' ``fault`` lines; ``t`` is ``time.monotonic()``.
    """

    t: float
    kind: str
    target: str
    action: Literal["start", "end"]
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        """The event as a JSON object."""
        return asdict(self)


@dataclass(frozen=True)
class ProxyStats:
    """What a proxy did so far; a snapshot."""

    connections: int
    """Accepted and forwarded (refused ones not counted)."""
    active: int
    refused: int
    """Accepted and reset at once while :meth:`FaultProxy.reset` was on."""
    upstream_failures: int
    """Accepted but the upstream refused to connect: the client was reset."""
    resets: int
    """Connections the proxy reset: by :meth:`FaultProxy.reset`, or after too many losses."""
    bytes_up: int
    bytes_down: int
    chunks_delayed: int
    chunks_stalled: int
    """Chunks lost at least once (each then waited one or more retransmission timeouts)."""
    retransmissions: int
    """Losses in all: one chunk lost three times counts three."""

    def to_json(self) -> dict[str, int]:
        """The counts as a JSON object."""
        return asdict(self)


@dataclass(frozen=True)
class Stall:
    """Chunk number ``chunk`` (from 0, per connection and direction) was lost ``losses`` times."""

    connection: int
    direction: Direction
    chunk: int
    losses: int


def _sides(direction: str) -> tuple[Direction, ...]:
    if direction == "both":
        return DIRECTIONS
    if direction == "up":
        return ("up",)
    if direction == "down":
        return ("down",)
    raise ConfigError(f"direction must be 'up', 'down' or 'both', got {direction!r}")


def _check_number(name: str, value: object, *, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` as a float, if it is a finite real number in ``[low, high]``; in ``(low, high]`` if ``low_open``."""
    bounds = f"{'above' if low_open else 'at least'} {low}" + ("" if high == math.inf else f" and at most {high}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number {bounds}, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        raise ConfigError(f"{name} must be {bounds}, got {value!r}")
    return float(value)


def _check_port(name: str, port: object, *, low: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ConfigError(f"{name} must be an int from {low} to 65535, got {port!r}")


def _open_socket(writer: asyncio.StreamWriter) -> Any:
    """``writer``'s socket while it is open; None once closed (uvloop keeps handing it out after it
    closed, with descriptor -1)."""
    sock = writer.get_extra_info("socket")
    return sock if sock is not None and sock.fileno() >= 0 else None


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with a TCP reset (SO_LINGER 0), not a FIN; once closed, nothing to do
    (a connection may be reset twice: by a fault, then by :meth:`FaultProxy.close` before its task ended)."""
    sock = _open_socket(writer)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class _Item:
    """A chunk of bytes on its way (empty: the end of the stream; None: a reset to pass on)."""

    data: bytes | None
    release: float  # time.monotonic() before which it is not forwarded (the delay)


class _Pipe:
    """One direction of one connection: its queue, random streams and pacing."""

    def __init__(self, seed: int, connection: int, direction: Direction) -> None:
        self.direction = direction
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(_QUEUED_CHUNKS)
        self.jitter = random.Random(f"{seed}/{connection}/{direction}/jitter")
        self.loss = random.Random(f"{seed}/{connection}/{direction}/loss")
        self.last_release = 0.0
        self.free_at = 0.0  # when a slowed link may send its next piece
        self.chunks = 0


class _Connection:
    """A client connection and, once made, its upstream connection."""

    def __init__(self, number: int, seed: int, client: asyncio.StreamWriter) -> None:
        self.number = number
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.pipes = {direction: _Pipe(seed, number, direction) for direction in DIRECTIONS}
        self.task: asyncio.Task[None] | None = None
        self.was_reset = False

    def reset(self) -> None:
        """Reset both sides and stop forwarding (cancelling the connection's task once, so that
        its cleanup runs to the end)."""
        _reset(self.client)
        if self.upstream is not None:
            _reset(self.upstream)
        if not self.was_reset and self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        self.was_reset = True


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``upstream`` whose link faults switch at runtime.

    ``port`` 0 takes a free port (:attr:`port` tells which once started). ``seed`` seeds the
    jitter and loss decisions. ``name`` is the ``target`` of its events (by default the
    upstream address). ``on_event`` is called with each :class:`FaultEvent`, in order, on the
    thread that switched the fault, under the proxy's lock: it must not switch faults itself.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        port: int = 0,
        seed: int = 0,
        name: str | None = None,
        on_event: Callable[[FaultEvent], None] | None = None,
    ) -> None:
        host, upstream_port = upstream
        _check_port("upstream port", upstream_port, low=1)
        _check_port("port", port, low=0)
        self.upstream = (host, upstream_port)
        self.name = name if name is not None else f"{host}:{upstream_port}"
        self._port = port
        self._seed = seed
        self._on_event = on_event
        self._lock = threading.RLock()
        self._faults: dict[Direction, LinkFaults] = dict.fromkeys(DIRECTIONS, LinkFaults())
        self._refusing = False
        self._events: list[FaultEvent] = []
        self._stalls: deque[Stall] = deque(maxlen=_STALLS_KEPT)
        self._counts = dict.fromkeys(ProxyStats.__dataclass_fields__, 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # every task of the proxy still running
        self._changed: asyncio.Event | None = None
        self._loop_thread = 0  # threading.get_ident() of the loop's thread
        self._closed = False

    # -- life cycle ------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port it listens on (the one given, or the free one it took at start)."""
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect: ``("127.0.0.1", port)``."""
        return ("127.0.0.1", self._port)

    def start(self) -> FaultProxy:
        """Listen, on an event loop of its own in a new thread."""
        self._check_startable()
        loop = new_loop()
        thread = threading.Thread(target=loop.run_forever, name=f"fault proxy {self.name}", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._open(loop), loop).result(_CONTROL_TIMEOUT)
        except BaseException:
            self._stop_thread(loop, thread)
            raise
        self._thread = thread
        return self

    async def astart(self) -> FaultProxy:
        """Listen, on the running event loop (close with :meth:`aclose`)."""
        self._check_startable()
        await self._open(asyncio.get_running_loop())
        return self

    def close(self) -> None:
        """Reset every connection, stop listening and end the thread; idempotent."""
        if self._loop is None or self._closed:
            self._closed = True
            return
        if self._thread is None:
            raise RuntimeError("this proxy runs on the caller's event loop (astart): close it with aclose()")
        try:
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(_CONTROL_TIMEOUT)
        finally:
            self._stop_thread(self._loop, self._thread)

    async def aclose(self) -> None:
        """Reset every connection and stop listening (a proxy started with :meth:`astart`); idempotent."""
        if self._loop is None or self._closed:
            self._closed = True
            return
        if self._thread is not None:
            raise RuntimeError("this proxy runs in a thread of its own (start): close it with close()")
        await self._shut()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> FaultProxy:
        return await self.astart()

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _check_startable(self) -> None:
        if self._closed:
            raise RuntimeError(f"proxy {self.name} is closed")
        if self._loop is not None:
            raise RuntimeError(f"proxy {self.name} is already started")

    async def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop_thread = threading.get_ident()
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        self._loop = loop

    async def _shut(self) -> None:
        self._closed = True
        assert self._server is not None
        self._server.close()
        await self._reset_all(counted=False)
        while self._tasks:  # cancelled by the resets: let them finish
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @staticmethod
    def _stop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CONTROL_TIMEOUT)
        loop.close()

    # -- faults ----------------------------------------------------------------------

    def delay(self, seconds: float, jitter: float = 0.0, *, direction: str = "both") -> None:
        """Hold each chunk ``seconds`` plus a uniform draw from ``[-jitter, jitter]`` (at least 0)."""
        sides = _sides(direction)
        delay = (_check_number("delay seconds", seconds, low=0), _check_number("delay jitter", jitter, low=0))
        self._switch_on(sides, "delay", lambda on: replace(on, delay=delay), f"seconds={delay[0]} jitter={delay[1]}")

    def slow(self, bytes_per_second: float, *, direction: str = "both") -> None:
        """Forward at most ``bytes_per_second`` on each connection, in each direction given."""
        sides = _sides(direction)
        rate = _check_number("slow bytes_per_second", bytes_per_second, low=0, low_open=True)
        self._switch_on(sides, "slow", lambda on: replace(on, rate=rate), f"bytes_per_second={rate}")

    def drop(self, probability: float, *, rto: float = 0.2, direction: str = "both") -> None:
        """Lose each chunk with ``probability``; a lost one waits ``rto`` seconds, doubling (see the module)."""
        sides = _sides(direction)
        loss = (
            _check_number("drop probability", probability, low=0, high=1),
            _check_number("drop rto", rto, low=0, low_open=True),
        )
        self._switch_on(sides, "drop", lambda on: replace(on, loss=loss), f"probability={loss[0]} rto={loss[1]}")

    def blackhole(self, *, direction: str = "both") -> None:
        """Forward nothing (connections stay open, new ones are held) until cleared."""
        self._switch_on(_sides(direction), "blackhole", lambda on: replace(on, blackhole=True), "")

    def reset(self) -> None:
        """Reset every connection now and every new one until cleared.

        From another thread, it returns once the connections are closed.
        """
        with self._lock:
            if not self._refusing:
                self._refusing = True
                self._event("reset", "start", "")
        self._apply(reset=True)

    def clear(self, kind: str | None = None, *, direction: str = "both") -> None:
        """Switch off fault ``kind`` (None: every fault) in ``direction``; a reset has none."""
        sides = _sides(direction)
        if kind is not None and kind not in KINDS:
            raise ConfigError(f"fault kind must be one of {', '.join(KINDS)} (or None for all), got {kind!r}")
        kinds = KINDS if kind is None else (kind,)
        with self._lock:
            if "reset" in kinds and self._refusing:
                self._refusing = False
                self._event("reset", "end", "")
            for name, off in _OFF.items():
                on = [side for side in sides if off(self._faults[side]) != self._faults[side]]
                if name in kinds and on:
                    for side in on:
                        self._faults[side] = off(self._faults[side])
                    self._event(name, "end", f"direction={_named(on)}")
        self._apply(reset=False)

    def faults(self, direction: Direction) -> LinkFaults:
        """The faults in force on ``direction`` (``"up"`` or ``"down"``)."""
        if direction not in DIRECTIONS:
            raise ConfigError(f"direction must be 'up' or 'down', got {direction!r}")
        return self._faults[direction]

    @property
    def refusing(self) -> bool:
        """Whether :meth:`reset` is on."""
        return self._refusing

    @property
    def events(self) -> list[FaultEvent]:
        """Every fault switched so far, in order (a copy)."""
        with self._lock:
            return list(self._events)

    def stats(self) -> ProxyStats:
        """What the proxy did so far, with the connections open now."""
        with self._lock:
            counts = dict(self._counts)
            counts["active"] = len(self._connections)
        return ProxyStats(**counts)

    def stalls(self) -> list[Stall]:
        """The chunks lost at least once, in the order they got through (the last 10000)."""
        with self._lock:
            return list(self._stalls)

    def _switch_on(
        self, sides: tuple[Direction, ...], kind: str, change: Callable[[LinkFaults], LinkFaults], detail: str
    ) -> None:
        with self._lock:
            for side in sides:
                self._faults[side] = change(self._faults[side])
            self._event(kind, "start", f"direction={_named(sides)}" + (f" {detail}" if detail else ""))
        self._apply(reset=False)

    def _event(self, kind: str, action: Literal["start", "end"], detail: str) -> None:
        event = FaultEvent(time.monotonic(), kind, self.name, action, detail)
        self._events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def _apply(self, *, reset: bool) -> None:
        """Make the proxy's loop act on a change: wake what waits on a blackhole, reset connections."""
        loop = self._loop
        if loop is None or self._closed:
            return
        if threading.get_ident() == self._loop_thread:
            self._wake()
            if reset:
                self._reset_connections(counted=True)
            return
        if reset:
            asyncio.run_coroutine_threadsafe(self._reset_all(counted=True), loop).result(_CONTROL_TIMEOUT)
        else:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """Wake every coroutine waiting for a change of faults (they look again)."""
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    def _reset_connections(self, *, counted: bool) -> list[_Connection]:
        """Reset every connection now (``counted``: in :attr:`ProxyStats.resets`)."""
        with self._lock:
            connections = list(self._connections)
            if counted:
                self._counts["resets"] += len(connections)
        for connection in connections:
            connection.reset()
        return connections

    async def _reset_all(self, *, counted: bool) -> None:
        """Reset every connection and wait until each is closed."""
        self._wake()
        connections = self._reset_connections(counted=counted)
        await asyncio.gather(*(c.task for c in connections if c.task is not None), return_exceptions=True)

    # -- forwarding ------------------------------------------------------------------

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing or self._closed:
            self._count("refused")
            _reset(writer)
            return
        with self._lock:
            number = self._counts["connections"]
            self._counts["connections"] += 1
            connection = _Connection(number, self._seed, writer)
            self._connections.add(connection)
        connection.task = self._spawn(self._serve(connection, reader))

    async def _serve(self, connection: _Connection, client: asyncio.StreamReader) -> None:
        """Forward both ways until both ends closed, or reset both on an error."""
        up, down = connection.pipes["up"], connection.pipes["down"]
        tasks = [self._spawn(self._read(up, client))]
        try:
            await self._flowing("up")  # a partition holds the connection's opening too
            if connection.client.transport.is_closing():
                return  # the client gave up (reset) before its connection got through
            try:
                reader, connection.upstream = await asyncio.open_connection(*self.upstream)
            except OSError:
                self._count("upstream_failures")
                connection.reset()
                return
            tasks.append(self._spawn(self._read(down, reader)))
            forwards = [
                self._spawn(self._forward(connection, up, connection.upstream)),
                self._spawn(self._forward(connection, down, connection.client)),
            ]
            tasks.extend(forwards)
            await asyncio.gather(*forwards)
        finally:
            try:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for writer in (connection.client, connection.upstream):
                    if writer is not None:
                        writer.close()  # after both ends were passed on: waits to flush what is written
                        with contextlib.suppress(OSError):
                            await writer.wait_closed()
            finally:  # also when a reset cancels the wait above (it aborted both sockets)
                with self._lock:
                    self._connections.discard(connection)

    def _spawn(self, coroutine: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine, name=f"fault proxy {self.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read(self, pipe: _Pipe, reader: asyncio.StreamReader) -> None:
        """Queue what ``reader`` gives, each chunk stamped with its release time, then its end."""
        while True:
            try:
                data: bytes | None = await reader.read(_CHUNK)
            except OSError:
                data = None
            now = time.monotonic()
            delay = self._faults[pipe.direction].delay
            release = now
            if delay is not None:
                seconds, jitter = delay
                release += max(0.0, seconds + pipe.jitter.uniform(-jitter, jitter))
            release = max(release, pipe.last_release)
            pipe.last_release = release
            if data and release > now:
                self._count("chunks_delayed")
            await pipe.queue.put(_Item(data, release))
            if not data:
                return

    async def _forward(self, connection: _Connection, pipe: _Pipe, writer: asyncio.StreamWriter) -> None:
        """Forward ``pipe``'s chunks to ``writer`` under the faults, up to the end of the stream
        (passed on as a FIN); reset the connection on a reset, an error, or when TCP would give up."""
        while True:
            item = await pipe.queue.get()
            await _sleep_until(item.release)
            await self._flowing(pipe.direction)
            if item.data is None or writer.transport.is_closing():
                connection.reset()
                return
            if not item.data:
                try:
                    writer.write_eof()
                except OSError:  # the other side went away meanwhile: nothing to pass the FIN on to
                    connection.reset()
                return
            if not await self._survive_loss(connection, pipe):
                self._count("resets")
                connection.reset()
                return
            try:
                await self._send(pipe, item.data, writer)
            except OSError:
                connection.reset()
                return

    async def _survive_loss(self, connection: _Connection, pipe: _Pipe) -> bool:
        """Hold the next chunk while it is lost (see the module); False when TCP would give up."""
        number = pipe.chunks
        pipe.chunks += 1
        losses = 0
        timeout = 0.0
        while True:
            await self._flowing(pipe.direction)
            loss = self._faults[pipe.direction].loss
            if loss is None or pipe.loss.random() >= loss[0]:
                break
            losses += 1
            self._count("retransmissions")
            if losses == 1:
                self._count("chunks_stalled")
            if losses > _MAX_LOSSES:
                return False
            timeout = loss[1] if losses == 1 else min(2 * timeout, _RTO_MAX)
            await asyncio.sleep(timeout)
        if losses:
            with self._lock:
                self._stalls.append(Stall(connection.number, pipe.direction, number, losses))
        return True

    async def _send(self, pipe: _Pipe, data: bytes, writer: asyncio.StreamWriter) -> None:
        """Write ``data``, paced in pieces while the direction is slowed."""
        view = memoryview(data)
        while view:
            rate = self._faults[pipe.direction].rate
            piece = view if rate is None else view[: max(1, int(rate * _PACE))]
            if rate is not None:
                await _sleep_until(pipe.free_at)
                await self._flowing(pipe.direction)
                pipe.free_at = max(pipe.free_at, time.monotonic()) + len(piece) / rate
            writer.write(piece)
            await writer.drain()
            self._count(f"bytes_{pipe.direction}", len(piece))
            view = view[len(piece) :]

    async def _flowing(self, direction: Direction) -> None:
        """Return once ``direction`` is not blackholed."""
        while self._faults[direction].blackhole:
            assert self._changed is not None
            await self._changed.wait()


async def _sleep_until(deadline: float) -> None:
    """Return once ``time.monotonic()`` has reached ``deadline``. A loop's timers may fire early by
    its clock's grain (uvloop's is a millisecond, read at the top of each turn), so the clock is
    read again after each sleep: a delay or a pace is never shorter than it was set."""
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(left)


_OFF: dict[str, Callable[[LinkFaults], LinkFaults]] = {
    "delay": lambda on: replace(on, delay=None),
    "slow": lambda on: replace(on, rate=None),
    "drop": lambda on: replace(on, loss=None),
    "blackhole": lambda on: replace(on, blackhole=False),
}


def _named(sides: tuple[Direction, ...] | list[Direction]) -> str:
    return "both" if len(sides) == 2 else sides[0]
