"""The zombie consumer: paused past its session timeout, it wakes up and acks what it no longer owns.

A consumer process ("zombie") takes messages and holds them unacked; SIGSTOP freezes it
past the server's session timeout, so the server ends its session and hands its messages
to the other consumer ("healthy", in the test process). After SIGCONT the zombie acks the
messages of its old session: the server must reject those acks (``unknown_session``) and
change nothing, because the healthy consumer owns those messages now (docs/protocol.md,
"Dead sessions"). Each message is acked once, and each key's messages are processed in
order. The zombie's client learns of the timeout, drops what it had prefetched and
subscribes again with a new session.

The zombie runs :func:`zombie_main` in a child process, driven by commands on its stdin,
and reports JSON lines on its stdout.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from keyfailover.broker.storage.sqlite import Log
from keyfailover.client import Client, Consumer, Message, Timeout
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from tests.server_process import ServerProcess, wait_until

pytestmark = pytest.mark.integration  # a server in a process of its own, suspended

TOPIC = "orders"
SUBSCRIPTION = "billing"
SESSION_TIMEOUT = 1.0
KEYS = 40
PER_KEY = 10
PREFETCH = 20  # the zombie's receiver queue: messages sent to it before it asks for more
HOLD = 4  # of those, handed to the zombie's application and held unacked: under a quarter, so no flow asks for more
LATE = 10  # messages produced for the zombie's new session
WAIT = 30.0  # bound on every wait for something that must happen
WHOLE = [(0, HASH_RANGE_SIZE - 1)]

ROOT = Path(__file__).resolve().parent.parent
ZOMBIE_SCRIPT = "import sys; from tests.test_server_zombie import zombie_main; zombie_main(sys.argv[1])"


# -- the zombie process -----------------------------------------------------------------------


class _TimedOut(logging.Handler):
    """Sets ``event`` when the client logs that the server timed its consumer out."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "timed out on the server" in record.getMessage():
            self.count += 1
            self.event.set()


def _report(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _described(message: Message) -> list[Any]:
    return [message.position, message.key, message.session, message.redelivery_count]


def zombie_main(url: str) -> None:
    """Subscribe as "zombie", hold ``HOLD`` messages, then obey stdin.

    Commands: ``receive N`` (take N more messages, unacked), ``ack held|fresh|mixed`` (ack
    the held messages, the received ones, or both interleaved), ``close``.
    """
    timed_out = _TimedOut()
    logging.getLogger("keyfailover.client").addHandler(timed_out)
    client = Client(url)
    consumer = client.subscribe(TOPIC, SUBSCRIPTION, "zombie", receiver_queue_size=PREFETCH)
    held = [consumer.receive(timeout=WAIT) for _ in range(HOLD)]
    fresh: list[Message] = []
    _report("held", ranges=consumer.ranges, messages=[_described(m) for m in held])
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "receive":
            fresh = [consumer.receive(timeout=WAIT) for _ in range(int(argument))]
            _report("received", messages=[_described(m) for m in fresh])
        elif command == "ack":
            with_held = argument in {"held", "mixed"}
            # Only once the client has seen the timeout (and subscribed again): before, the
            # acks could still be queued for the old session and dropped with it, unsent.
            if with_held and not timed_out.event.wait(WAIT):
                raise TimeoutError("the client never saw its session time out")
            order = {"held": held, "fresh": fresh, "mixed": [*fresh[:1], *held, *fresh[1:]]}[argument]
            for message in order:
                consumer.acknowledge(message)
            if with_held:
                wait_until(lambda: bool(client.server_errors()), "an answer to the acks of the old session", WAIT)
            _report("acked", errors=client.server_errors(), timeouts=timed_out.count)
        elif command == "close":
            client.close()
            _report("closed", errors=client.server_errors())
            return


class Zombie:
    """The zombie's process, seen from the test: commands in, JSON reports out, SIGSTOP/SIGCONT."""

    def __init__(self, url: str, stderr: IO[str]) -> None:
        self._stderr = stderr
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZOMBIE_SCRIPT, url],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def tell(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def report(self, event: str) -> dict[str, Any]:
        """The zombie's next report, which must be ``event``."""
        try:
            line = self._lines.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"no {event!r} report from the zombie within {WAIT} s: {self.errors()}") from None
        if line is None:
            raise AssertionError(f"the zombie exited before its {event!r} report: {self.errors()}")
        report: dict[str, Any] = json.loads(line)
        assert report["event"] == event, report
        return report

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def wait(self) -> int:
        return self.process.wait(timeout=WAIT)

    def errors(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.resume()
            self.process.kill()
            self.process.wait(timeout=WAIT)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        self._reader.join(timeout=WAIT)


# -- the healthy consumer ---------------------------------------------------------------------


class Healthy:
    """The consumer in the test process: acks what it gets at once, except positions it keeps."""

    def __init__(self, client: Client, keep: set[int]) -> None:
        self.changed = threading.Condition()
        self.ranges: list[list[tuple[int, int]]] = []  # every list on_ranges_changed was called with
        self.deliveries: list[Message] = []
        self.kept: dict[int, Message] = {}
        self._keep = keep
        self._stop = threading.Event()
        self.consumer: Consumer = client.subscribe(
            TOPIC, SUBSCRIPTION, "healthy", receiver_queue_size=50, on_ranges_changed=self._ranged
        )
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _ranged(self, ranges: list[tuple[int, int]]) -> None:
        with self.changed:
            self.ranges.append(ranges)
            self.changed.notify_all()

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.consumer.receive(timeout=0.1)
            except Timeout:
                continue
            with self.changed:
                self.deliveries.append(message)
                if message.position in self._keep:
                    self.kept[message.position] = message
                self.changed.notify_all()
            if message.position not in self._keep:
                self.consumer.acknowledge(message)

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, timeout=WAIT), f"{what}: not within {WAIT} s"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)
        assert not self._thread.is_alive()


# -- the test ---------------------------------------------------------------------------------


def produce(client: Client, keys: list[str]) -> dict[int, str]:
    """Store one message per entry of ``keys``, in order; position -> key."""
    producer = client.create_producer(TOPIC)
    stored: dict[int, str] = {}
    failed: list[BaseException] = []

    def remember(key: str) -> Callable[[int | None, BaseException | None], None]:
        def callback(position: int | None, error: BaseException | None) -> None:
            if error is not None or position is None:
                failed.append(error or AssertionError("no position"))
            else:
                stored[position] = key

        return callback

    for key in keys:
        producer.send_async(f"{key} payload".encode(), key, remember(key))
    producer.flush()
    assert not failed and len(stored) == len(keys), failed
    return stored


def positions_by_key(positions: list[int], keys: dict[int, str]) -> dict[str, list[int]]:
    by_key: dict[str, list[int]] = defaultdict(list)
    for position in positions:
        by_key[keys[position]].append(position)
    return dict(by_key)


class Outcome:
    """What the zombie and the healthy consumer reported."""

    def __init__(self) -> None:
        self.held: dict[int, Any] = {}  # position -> [key, session, redelivery_count], as the zombie got it
        self.acked: dict[str, Any] = {}
        self.received: list[list[Any]] = []  # [position, key, session, redelivery_count]
        self.closed: dict[str, Any] = {}
        self.late: dict[int, str] = {}
        self.healthy: list[Message] = []  # deliveries to the healthy consumer, in order


def run_zombie(client: Client, zombie: Zombie, mixed: bool) -> Outcome:
    """The scenario, step by step; every wait is on something the test observes."""
    outcome = Outcome()
    # The zombie owns every key while it takes its first messages.
    report = zombie.report("held")
    assert [tuple(pair) for pair in report["ranges"]] == WHOLE
    outcome.held = {position: rest for position, *rest in report["messages"]}
    healthy = Healthy(client, keep=set(outcome.held))
    try:
        joined = healthy.consumer.ranges
        assert joined not in (WHOLE, []) and healthy.ranges == [joined]

        # Frozen past the session timeout, the zombie loses its ranges and its messages.
        zombie.pause()
        healthy.wait_for(lambda: healthy.ranges[-1] == WHOLE, "the healthy consumer told it owns every key")
        assert healthy.consumer.ranges == WHOLE
        healthy.wait_for(
            lambda: len({m.position for m in healthy.deliveries}) == KEYS * PER_KEY,
            "the healthy consumer received every message",
        )
        zombie.resume()
        healthy.wait_for(lambda: healthy.ranges[-1] != WHOLE, "the zombie subscribed again")
        # Told each change once: its share on joining, everything, then a share again.
        assert healthy.ranges == [joined, WHOLE, healthy.consumer.ranges]

        def receive_late() -> None:
            """New messages for the zombie's new session: new keys in its new ranges."""
            owned = healthy.consumer.ranges
            late_keys = [
                k
                for k in (f"late-{i}" for i in range(10_000))
                if not any(start <= key_hash(k) <= end for start, end in owned)
            ]
            outcome.late = produce(client, late_keys[:LATE])
            zombie.tell(f"receive {LATE}")
            outcome.received = zombie.report("received")["messages"]

        # The zombie acks the messages of its old session (alone, or mixed with acks of its
        # new session); then the healthy consumer, which has them in flight, acks them.
        if mixed:
            receive_late()
            zombie.tell("ack mixed")
            outcome.acked = zombie.report("acked")
        else:
            zombie.tell("ack held")
            outcome.acked = zombie.report("acked")
            receive_late()
            zombie.tell("ack fresh")
            zombie.report("acked")
        for message in healthy.kept.values():
            healthy.consumer.acknowledge(message)
        zombie.tell("close")
        outcome.closed = zombie.report("closed")
        assert zombie.wait() == 0, zombie.errors()
    finally:
        healthy.stop()
    healthy.consumer.close()
    outcome.healthy = healthy.deliveries
    return outcome


@pytest.mark.parametrize("mixed", [False, True], ids=["old-session-acks", "old-and-new-session-acks-together"])
def test_zombie_consumer_acks_nothing_after_its_session_timed_out(tmp_path: Path, mixed: bool) -> None:
    with ServerProcess(tmp_path / "data", "--session-timeout", str(SESSION_TIMEOUT)) as server:
        with Client(server.url) as client, (tmp_path / "zombie.err").open("w+") as zombie_err:
            keys = produce(client, [f"key-{i % KEYS}" for i in range(KEYS * PER_KEY)])
            zombie = Zombie(server.url, zombie_err)
            try:
                outcome = run_zombie(client, zombie, mixed)
            finally:
                zombie.kill()
            assert client.server_errors() == {}, "an ack of the healthy consumer was rejected"
        assert server.stop() == 0

    # The zombie held messages of one session, delivered for the first time.
    old_sessions = {session for _, session, _ in outcome.held.values()}
    assert len(outcome.held) == HOLD and len(old_sessions) == 1
    assert {count for _, _, count in outcome.held.values()} == {0}

    # After SIGCONT its client saw ConsumerClosed(reason=timeout) once; the acks of the old
    # session were rejected as unknown_session, and every other ack of the zombie accepted.
    assert outcome.acked["timeouts"] == 1
    assert set(outcome.acked["errors"]) == {"unknown_session"}, outcome.acked
    # The held acks may go out in up to HOLD frames (each rejected frame counts once), and the
    # report above was taken at the first rejection; nothing else was rejected by the close.
    assert set(outcome.closed["errors"]) == {"unknown_session"}, outcome.closed
    assert outcome.acked["errors"]["unknown_session"] <= outcome.closed["errors"]["unknown_session"] <= HOLD

    # Its new session got exactly the late messages, in order, and none it had prefetched before.
    new_sessions = {session for _, _, session, _ in outcome.received}
    assert len(new_sessions) == 1 and new_sessions.isdisjoint(old_sessions), new_sessions
    zombie_positions = [position for position, *_ in outcome.received]
    assert sorted(zombie_positions) == sorted(outcome.late)
    assert {count for *_, count in outcome.received} == {0}
    for key, positions in positions_by_key(zombie_positions, outcome.late).items():
        assert positions == sorted(positions), f"{key}: out of order on the zombie's new session"

    # The healthy consumer got every initial message once, each key in order, and every
    # message of the zombie's old session (held or only prefetched) redelivered.
    delivered = [m.position for m in outcome.healthy]
    assert sorted(delivered) == sorted(keys), "each initial message delivered to the healthy consumer once"
    by_key = positions_by_key(sorted(keys), keys)
    for key, positions in positions_by_key(delivered, keys).items():
        assert positions == by_key[key], f"{key}: first deliveries out of order"
    redelivered = {m.position: m.redelivery_count for m in outcome.healthy if m.redelivery_count}
    assert outcome.held.keys() < redelivered.keys() and len(redelivered) <= PREFETCH, sorted(redelivered)
    assert set(redelivered.values()) == {1}

    # The server's view: every position acked (by the healthy consumer, or by the zombie's
    # new session for the late ones), none twice (else one of those acks was rejected).
    with Log(tmp_path / "data" / "keyfailover.db") as log:
        last = log.last_position(TOPIC)
        cursor = log.load_cursor(TOPIC, SUBSCRIPTION)
    assert last == KEYS * PER_KEY + LATE
    assert (cursor.mark_delete, cursor.acked) == (last, frozenset())
