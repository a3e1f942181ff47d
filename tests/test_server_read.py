"""Reads by position over the native protocol: a server in this process, real clients and raw connections.

What a read returns is checked against what was produced (and what a consumer received); the paging
property reads a stored log from 0 in pages of random limits under a random slot filter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyfailover.broker.server import ServerConfig
from keyfailover.broker.storage import Store, StoreUnavailableError
from keyfailover.broker.storage.records import StoredMessage
from keyfailover.client import Client, LogEntries, LogEntry, ServerError, ServerTooOldError, Timeout
from keyfailover.client.aio import AsyncClient
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hash
from keyfailover.core.partitions import partition_of_key, partition_slots, partition_topic
from keyfailover.wire.protocol import (
    MAX_READ,
    Connect,
    Connected,
    Entries,
    Error,
    ErrorCode,
    Key,
    Read,
    encode,
)
from tests.aio import run_async
from tests.server_process import RawConnection, ServerThread

LAST_SLOT = HASH_RANGE_SIZE - 1

# Keys of both types and none, payloads of several sizes, properties on some: what the stored log holds.
STORED: list[tuple[Key, bytes, dict[str, str] | None]] = [
    (
        None if i % 7 == 0 else f"key-{i % 13}" if i % 2 else f"key-{i % 11}".encode(),
        bytes([i % 256]) * (i % 50),
        {"i": str(i), "even": str(i % 2 == 0)} if i % 5 == 0 else None,
    )
    for i in range(300)
]


def produce(client: Client, topic: str, messages: Sequence[tuple[Key, bytes, dict[str, str] | None]]) -> list[int]:
    """Send ``messages`` to ``topic`` in order; their positions."""
    producer = client.create_producer(topic)
    positions = [producer.send(payload, key, properties=properties) for key, payload, properties in messages]
    producer.close()
    return positions


def read_all(client: Client, topic: str, limit: int, slots: tuple[int, int] | None = None) -> list[LogEntry]:
    """Every message of ``topic`` the filter takes, read from 0 in pages of ``limit``."""
    found: list[LogEntry] = []
    after = 0
    while True:
        page = client.read(topic, after=after, limit=limit, slots=slots)
        found += page.messages
        assert page.through >= after
        if page.through >= page.last:
            return found
        after = page.through


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Client]]:
    """A server whose topic ``log`` holds :data:`STORED` at positions 1 to 300, and a client of it."""
    data = tmp_path_factory.mktemp("read") / "data"
    with ServerThread(ServerConfig(data_dir=data)) as server, Client(server.url) as client:
        assert produce(client, "log", STORED) == list(range(1, len(STORED) + 1))
        yield server, client


def test_a_read_returns_the_stored_messages_as_they_were_produced(stored: tuple[ServerThread, Client]) -> None:
    _, client = stored
    entries = client.read("log", after=0, limit=MAX_READ)
    assert isinstance(entries, LogEntries)
    assert (entries.partition, entries.through, entries.last) == (0, len(STORED), len(STORED))
    assert [m.position for m in entries.messages] == list(range(1, len(STORED) + 1))
    for entry, (key, payload, properties) in zip(entries.messages, STORED, strict=True):
        assert type(entry.key) is type(key) and entry.key == key  # str stays str, bytes stay bytes
        assert entry.payload == payload
        assert dict(entry.properties) == (properties or {})
        assert entry.slot == (None if key is None else key_hash(key))
        assert entry.partition == 0
    # The publish times and producer names are those a consumer is delivered.
    consumer = client.subscribe("log", "check", receiver_queue_size=len(STORED))
    delivered: dict[int, tuple[int | None, str | None]] = {}
    while len(delivered) < len(STORED):
        message = consumer.receive(timeout=10)
        delivered[message.position] = (message.publish_time, message.producer)
        consumer.acknowledge(message)
    consumer.close()
    assert {m.position: (m.publish_time, m.producer) for m in entries.messages} == delivered
    assert all(at is not None for at, _ in delivered.values())
    (name,) = {producer for _, producer in delivered.values()}  # the client named its producer
    assert name is not None and name.startswith("producer-")


def test_limit_through_and_last_page_the_log(stored: tuple[ServerThread, Client]) -> None:
    _, client = stored
    first = client.read("log", after=0, limit=10)
    assert ([m.position for m in first.messages], first.through, first.last) == (list(range(1, 11)), 10, 300)
    middle = client.read("log", after=first.through, limit=5)
    assert [m.position for m in middle.messages] == [11, 12, 13, 14, 15]
    only_the_end = client.read("log", after=42, limit=0)
    assert (only_the_end.messages, only_the_end.through, only_the_end.last) == ([], 42, 300)
    tail = client.read("log", after=298, limit=10)
    assert ([m.position for m in tail.messages], tail.through, tail.last) == ([299, 300], 300, 300)
    past = client.read("log", after=1000, limit=10)
    assert (past.messages, past.through, past.last) == ([], 1000, 300)
    assert client.log_ends("log") == [300]


def test_a_topic_nothing_was_produced_to_reads_as_an_empty_log(stored: tuple[ServerThread, Client]) -> None:
    _, client = stored
    assert client.read("never-produced", after=5) == LogEntries(0, [], 5, 0)
    assert client.log_ends("never-produced") == [0]


@pytest.mark.parametrize("slots", [(0, LAST_SLOT), (0, 0), (10_000, 30_000), (key_hash("key-3"), key_hash("key-3"))])
def test_the_slot_filter_keeps_exactly_the_keys_hashing_into_it(
    stored: tuple[ServerThread, Client], slots: tuple[int, int]
) -> None:
    _, client = stored
    entries = client.read("log", after=0, limit=MAX_READ, slots=slots)
    expected = [
        position
        for position, (key, _, _) in enumerate(STORED, start=1)
        if key is not None and slots[0] <= key_hash(key) <= slots[1]
    ]
    assert [m.position for m in entries.messages] == expected
    assert (entries.through, entries.last) == (300, 300)  # examined to the end, whatever it kept
    assert all(m.slot is not None and slots[0] <= m.slot <= slots[1] for m in entries.messages)


def test_a_filtered_read_that_keeps_nothing_still_moves_on(stored: tuple[ServerThread, Client]) -> None:
    _, client = stored
    unused = next(
        slot for slot in range(HASH_RANGE_SIZE) if all(k is None or key_hash(k) != slot for k, _, _ in STORED)
    )
    entries = client.read("log", after=100, limit=5, slots=(unused, unused))
    assert (entries.messages, entries.through, entries.last) == ([], 300, 300)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    limits=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    first=st.integers(0, LAST_SLOT),
    width=st.integers(0, HASH_RANGE_SIZE),
    filtered=st.booleans(),
)
def test_paging_from_zero_yields_every_message_in_the_filter_once_in_order(
    stored: tuple[ServerThread, Client], limits: list[int], first: int, width: int, filtered: bool
) -> None:
    """Pages of random limits (cycled), under a random slot filter or none: exactly the stored messages the
    filter takes, in position order, each once, and every page within its limit."""
    _, client = stored
    slots = (first, min(first + width, LAST_SLOT)) if filtered else None
    found: list[LogEntry] = []
    after = 0
    for page_number in range(len(STORED) + 1):
        limit = limits[page_number % len(limits)]
        page = client.read("log", after=after, limit=limit, slots=slots)
        assert len(page.messages) <= limit
        assert all(after < m.position <= page.through for m in page.messages)
        found += page.messages
        if page.through >= page.last:
            break
        assert page.through > after  # every page moves on
        after = page.through
    expected = [
        position
        for position, (key, _, _) in enumerate(STORED, start=1)
        if slots is None or (key is not None and slots[0] <= key_hash(key) <= slots[1])
    ]
    assert [m.position for m in found] == expected


SMALL_FRAME = 16 * 1024
SIZED: list[tuple[Key, bytes, dict[str, str] | None]] = [
    (f"key-{i % 17}" if i % 4 else None, bytes([i % 256]) * (i * 977 % 6000), {"i": str(i)} if i % 3 else None)
    for i in range(80)
]
"""Messages of up to 6,000 bytes: a few fill a frame of :data:`SMALL_FRAME`."""


@pytest.fixture(scope="module")
def small_frames(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server with frames of at most :data:`SMALL_FRAME` bytes whose topic ``sized`` holds :data:`SIZED`."""
    data = tmp_path_factory.mktemp("read-small-frames") / "data"
    with ServerThread(ServerConfig(data_dir=data, max_frame=SMALL_FRAME)) as server:
        with Client(server.url) as client:
            produce(client, "sized", SIZED)
        yield server


@settings(max_examples=40, deadline=None)
@given(
    limits=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    first=st.integers(0, LAST_SLOT),
    width=st.integers(0, HASH_RANGE_SIZE),
    filtered=st.booleans(),
)
def test_pages_cut_to_the_frame_limit_still_yield_every_message_once(
    small_frames: ServerThread, limits: list[int], first: int, width: int, filtered: bool
) -> None:
    """As the paging property, over raw frames of a server with small frames: every answer fits the frame
    limit, holds at least one message when one is left to take, and the pages hold each message once."""
    slots = (first, min(first + width, LAST_SLOT)) if filtered else None
    expected = [
        (position, key, payload)
        for position, (key, payload, _) in enumerate(SIZED, start=1)
        if slots is None or (key is not None and slots[0] <= key_hash(key) <= slots[1])
    ]
    found = []
    after = 0
    with RawConnection(small_frames.port) as raw:
        raw.connect()
        for page_number in range(len(SIZED) + 1):
            raw.send(
                Read(req=page_number, topic="sized", after=after, limit=limits[page_number % len(limits)], slots=slots)
            )
            answer = raw.receive()
            assert isinstance(answer, Entries), answer
            assert len(encode(answer)) - 4 <= SMALL_FRAME
            assert len(answer.messages) <= limits[page_number % len(limits)]
            assert answer.messages or not [e for e in expected if e[0] > after]  # never an empty page mid-way
            found += [(position, key, payload) for position, key, payload, _, _, _ in answer.messages]
            if answer.through >= answer.last:
                break
            after = answer.through
    assert found == expected


def test_an_answer_is_cut_to_the_frame_limit_and_a_message_larger_than_a_frame_is_refused(tmp_path: Path) -> None:
    max_frame = 64 * 1024
    big = [(f"k{i}", bytes([i]) * 10_000, None) for i in range(12)]
    config = ServerConfig(data_dir=tmp_path / "data", max_frame=max_frame)
    with ServerThread(config) as server:
        with Client(server.url) as client:
            produce(client, "big", big)
            assert [m.payload for m in read_all(client, "big", 100)] == [payload for _, payload, _ in big]
        with RawConnection(server.port) as raw:
            raw.connect()
            raw.send(Read(req=1, topic="big", after=0, limit=100))
            answer = raw.receive()
            assert isinstance(answer, Entries), answer
            assert 0 < len(answer.messages) < len(big)
            assert len(encode(answer)) - 4 <= max_frame
            assert (answer.through, answer.last) == (answer.messages[-1][0], len(big))
    smaller = ServerThread(ServerConfig(data_dir=tmp_path / "data", max_frame=8 * 1024))
    with smaller, Client(smaller.url) as client:
        with pytest.raises(ServerError, match="position 1 of 'big' takes up to") as info:
            client.read("big")
        assert info.value.code == ErrorCode.INVALID_MESSAGE
        assert client.read("big", limit=0).last == len(big)  # asking for the end only is served


def test_a_server_with_a_token_reads_only_to_a_connection_that_presented_it(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", token="s3cret")) as server:
        with Client(server.url, token="s3cret") as client:
            produce(client, "guarded", [("k", b"v", None)])
            assert [m.payload for m in client.read("guarded").messages] == [b"v"]
        for token in (None, "guess"):
            with RawConnection(server.port) as raw:
                raw.send(
                    Connect(version=8, token=token, client="no token"), Read(req=1, topic="guarded", after=0, limit=5)
                )
                frames = raw.until_closed()
                assert [(type(f), getattr(f, "code", None)) for f in frames] == [(Error, ErrorCode.UNAUTHORIZED)]
        with RawConnection(server.port) as raw:
            raw.send(Read(req=1, topic="guarded", after=0, limit=5))
            [refusal] = raw.until_closed()
            assert isinstance(refusal, Error) and refusal.code == ErrorCode.NOT_CONNECTED
        with pytest.raises(ServerError, match="unauthorized"):
            Client(server.url)


def test_a_read_of_a_partitioned_topic_goes_partition_by_partition(tmp_path: Path) -> None:
    partitions = 4
    keys = [f"account-{i}" for i in range(40)]
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        server.call(lambda s: s.create_topic("orders", partitions))
        producer = client.create_producer("orders")
        for key in keys:
            producer.send(key.encode(), key)
        producer.close()
        counts = [sum(partition_of_key(k, partitions) == p for k in keys) for p in range(partitions)]
        assert client.log_ends("orders") == counts
        for partition in range(partitions):
            entries = client.read("orders", partition)
            first, last = partition_slots(partition, partitions)
            assert [m.key for m in entries.messages] == [
                k for k in keys if partition_of_key(k, partitions) == partition
            ]
            assert all(
                m.partition == partition and m.slot is not None and first <= m.slot <= last for m in entries.messages
            )
        with pytest.raises(KeyFailoverError, match="'orders' has 4 partition"):
            client.read("orders", 4)
        with RawConnection(server.port) as raw:
            raw.connect()
            raw.send(Read(req=7, topic="orders", after=0, limit=5))
            refusal = raw.receive()
            assert isinstance(refusal, Error) and (refusal.code, refusal.req) == (ErrorCode.WRONG_PARTITION, 7)
            raw.send(Read(req=8, topic=partition_topic("orders", 0, partitions), after=0, limit=0))
            assert raw.receive() == Entries(req=8, through=0, last=counts[0], messages=[])


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"limit": MAX_READ + 1}, "limit must be an int from 0 to 10000"),
        ({"limit": -1}, "limit must be"),
        ({"after": -1}, "after must be a position"),
        ({"partition": -1}, "partition must be"),
        ({"slots": (5, 4)}, "slots must be None or a pair"),
        ({"slots": (0, HASH_RANGE_SIZE)}, "slots must be None or a pair"),
        ({"topic": ""}, "topic must be"),
    ],
)
def test_bad_read_arguments_are_refused_before_anything_is_sent(
    stored: tuple[ServerThread, Client], arguments: dict[str, object], says: str
) -> None:
    _, client = stored
    call = {"topic": "log", **arguments}
    with pytest.raises(KeyFailoverError, match=says):
        client.read(**call)  # type: ignore[arg-type]


def test_the_asyncio_client_reads_and_finds_the_log_ends(stored: tuple[ServerThread, Client]) -> None:
    server, _ = stored

    async def main() -> tuple[LogEntries, list[int]]:
        async with AsyncClient(server.url) as client:
            return await client.read("log", after=7, limit=3, slots=(0, LAST_SLOT)), await client.log_ends("log")

    entries, ends = run_async(main())
    keyed = [p for p, (key, _, _) in enumerate(STORED, start=1) if key is not None and p > 7][:3]
    assert ([m.position for m in entries.messages], entries.through, ends) == (keyed, keyed[-1], [300])


def test_a_client_of_a_server_too_old_for_reads_gets_a_clear_error_and_still_produces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server speaking up to version 7 refuses the client's 8; the client connects again with 7, produces,
    and refuses a read itself, sending nothing. A version 7 connection that sends read anyway is closed."""
    monkeypatch.setattr("keyfailover.broker.server._native.PROTOCOL_VERSION", 7)
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server:
        with Client(server.url) as client:
            assert produce(client, "old", [("k", b"v", None)]) == [1]
            with pytest.raises(ServerTooOldError, match="speaks protocol version 7; reading by position needs") as info:
                client.read("old")
            assert info.value.code == ErrorCode.VERSION_MISMATCH
            with pytest.raises(ServerTooOldError):
                client.log_ends("old")
        with RawConnection(server.port) as raw:
            raw.send(Connect(version=7, token=None, client="version 7"))
            assert isinstance(raw.receive(), Connected)
            raw.send(encode(Read(req=1, topic="old", after=0, limit=5)))
            [refusal] = raw.until_closed()
            assert isinstance(refusal, Error) and refusal.code == ErrorCode.UNKNOWN_TYPE
            assert "'read' came with protocol version 8; this connection speaks version 7" in refusal.message


def test_a_client_of_a_version_8_server_consumes_and_reads_without_producer_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server speaking up to version 8 refuses the client's 9; the client connects again with 8 and gets its
    messages and entries as version 8 carries them: without the producer's name."""
    monkeypatch.setattr("keyfailover.broker.server._native.PROTOCOL_VERSION", 8)
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        client.create_producer("old", "billing").send(b"v", "k")
        consumer = client.subscribe("old", "check")
        message = consumer.receive(timeout=10)
        assert (message.payload, message.producer) == (b"v", None)
        consumer.acknowledge(message)
        [entry] = client.read("old").messages
        assert (entry.payload, entry.producer) == (b"v", None)


def test_a_read_while_the_store_is_out_of_reach_is_refused_retriably_and_the_client_waits_it_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data")) as server, Client(server.url) as client:
        produce(client, "t", [("k", b"v", None)])
        store: Store = server.call(lambda s: s.storage)
        real = store.read
        refusals = [3]  # how many reads the store refuses next; counted on the server's loop

        async def failing_over(topic: str, after: int, limit: int) -> list[StoredMessage]:
            """The store's read, out of reach for the next ``refusals[0]`` reads."""
            if refusals[0] > 0:
                refusals[0] -= 1
                raise StoreUnavailableError("the store fails over (a test)")
            return await real(topic, after, limit)

        monkeypatch.setattr(store, "read", failing_over)
        with RawConnection(server.port) as raw:
            raw.connect()
            raw.send(Read(req=4, topic="t", after=0, limit=5))
            refusal = raw.receive()
            assert isinstance(refusal, Error) and (refusal.code, refusal.req) == (ErrorCode.STORE_UNAVAILABLE, 4)
            raw.send(Read(req=5, topic="t", after=0, limit=0))  # the end alone needs no read of the store
            assert raw.receive() == Entries(req=5, through=0, last=1, messages=[])
        assert [m.payload for m in client.read("t").messages] == [b"v"]  # after the two refusals left
        assert refusals == [0]
        refusals[0] = 10**9
        with pytest.raises(Timeout, match=r"could not be read within 1\.0 s: .*store_unavailable"):
            client.read("t", timeout=1.0)
