"""The entry cache (keyfailover/broker/storage/_cache.py): whatever it answers is what the log holds, it stays
within its bound, and a store reads through it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from keyfailover.broker.storage import EntryCache, Log, SQLiteStore, StoredMessage
from keyfailover.broker.storage._cache import ENTRY_OVERHEAD
from tests.aio import run_async

TOPICS = ("a", "b", "c")


def message(position: int, payload: bytes = b"x" * 10, key: str | None = "k") -> StoredMessage:
    return StoredMessage(position, key, payload, 1_000_000 + position, None)


def messages(first: int, count: int) -> list[StoredMessage]:
    return [message(position) for position in range(first, first + count)]


def entry_bytes(message: StoredMessage) -> int:
    """What the cache counts a message as, by its documented rule: ENTRY_OVERHEAD plus its parts' lengths."""
    return ENTRY_OVERHEAD + len(message.payload) + len(message.key or "") + len(message.properties or b"")


def test_a_read_is_answered_from_where_the_run_holds_it_and_missed_elsewhere() -> None:
    cache = EntryCache(1 << 20)
    cache.add("t", messages(1, 10))
    assert cache.read("t", 0, 3) == messages(1, 3)
    assert cache.read("t", 7, 100) == messages(8, 3)  # ends where the cache does
    assert cache.read("t", 10, 5) is None  # position 11 is not stored yet
    assert cache.read("u", 0, 5) is None
    assert cache.read("t", 0, 0) is None
    assert cache.read("t", 2.0, 3) is None and cache.read("t", 2, 3.0) is None  # type: ignore[arg-type]
    assert (cache.hits, cache.misses) == (6, 5)
    assert len(cache) == 10 and cache.bytes == sum(map(entry_bytes, messages(1, 10)))


def test_the_oldest_messages_leave_first_once_the_bound_is_passed() -> None:
    size = entry_bytes(message(1))
    cache = EntryCache(25 * size)
    cache.add("t", messages(1, 10))
    cache.add("u", messages(1, 10))
    cache.add("t", messages(11, 10))  # 30 in all: the 5 oldest go, of t's first commit
    assert cache.bytes == 25 * size == cache.max_bytes
    assert cache.read("t", 0, 5) is None and cache.read("t", 4, 1) is None
    assert cache.read("t", 5, 20) == messages(6, 15)
    assert cache.read("u", 0, 20) == messages(1, 10)
    cache.add("v", messages(1, 30))  # more than the bound in one commit: nothing older stays, nor all of it
    assert cache.bytes == 25 * size
    assert cache.read("u", 0, 1) is None and cache.read("t", 10, 1) is None
    assert cache.read("v", 5, 100) == messages(6, 25) and cache.read("v", 4, 1) is None


def test_a_commit_that_does_not_continue_the_run_replaces_it() -> None:
    cache = EntryCache(1 << 20)
    cache.add("t", messages(1, 5))
    cache.add("t", messages(9, 3))  # 6 to 8 were written elsewhere (another broker): not here
    assert cache.read("t", 0, 10) is None
    assert cache.read("t", 8, 10) == messages(9, 3)
    assert cache.bytes == 3 * entry_bytes(message(1))
    cache.add("t", [message(12), message(14)])  # a gap inside (13 written elsewhere): not cached
    assert cache.read("t", 11, 10) is None and cache.read("t", 8, 10) == messages(9, 3)
    cache.add("t", messages(15, 2))  # the run ended at 11: it is replaced
    assert cache.read("t", 8, 10) is None and cache.read("t", 14, 10) == messages(15, 2)
    assert len(cache) == 2


def test_get_many_splits_positions_into_cached_and_missing() -> None:
    cache = EntryCache(1 << 20)
    cache.add("t", messages(5, 5))
    found, missing = cache.get_many("t", [3, 5, 9, 10, 7])
    assert found == {5: message(5), 9: message(9), 7: message(7)}
    assert missing == [3, 10]
    assert cache.get_many("u", [1, 2]) == ({}, [1, 2])


def test_a_dropped_topic_frees_its_bytes_and_a_cache_of_zero_keeps_nothing() -> None:
    cache = EntryCache(1 << 20)
    cache.add("t", messages(1, 4))
    cache.add("u", messages(1, 2))
    cache.drop("t")
    assert cache.bytes == 2 * entry_bytes(message(1)) and cache.read("t", 0, 1) is None
    cache.add("t", messages(5, 1))  # its chunks from before leave later without counting twice
    cache.add("w", messages(1, 10_000))
    assert 0 < cache.bytes <= cache.max_bytes
    off = EntryCache(0)
    off.add("t", messages(1, 3))
    assert off.read("t", 0, 3) is None and off.bytes == 0


def test_a_message_is_counted_as_its_key_payload_and_properties() -> None:
    cache = EntryCache(1 << 20)
    cache.add("t", [StoredMessage(1, None, b"abc", None, None)])
    assert cache.bytes == ENTRY_OVERHEAD + 3
    cache.add("t", [StoredMessage(2, b"kk", b"abc", None, b"\x81\xa1a\xa1b"), StoredMessage(3, "é", b"", 7, None)])
    assert cache.bytes == 3 * ENTRY_OVERHEAD + 3 + (3 + 2 + 5) + 1  # a str key by its characters


def test_cached_messages_keep_their_producer_name_one_object_for_a_commit() -> None:
    cache = EntryCache(1 << 20)
    name = "".join(["bill", "ing"])  # a string of its own, not an interned constant
    cache.add_columns("t", 1, 3, ["a", "b", None], [b"1", b"2", b"3"], [5] * 3, [None] * 3, [name] * 3)
    cache.add_columns("t", 4, 4, ["a"], [b"4"], [6], [None], [None])
    found = cache.read("t", 0, 10) or []
    assert [message.producer for message in found] == ["billing"] * 3 + [None]
    assert all(message.producer is name for message in found[:3])
    assert cache.get_many("t", [2, 4])[0] == {2: found[1], 4: found[3]}


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(
            st.none() | st.text(max_size=8) | st.binary(max_size=8),
            st.binary(max_size=40),
            st.none() | st.integers(0, 2**53),
            st.none() | st.binary(max_size=12),
            st.none() | st.sampled_from(["billing", "p"]),
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 3000),
)
def test_what_stays_cached_is_counted_as_its_messages_one_by_one(
    parts: list[tuple[str | bytes | None, bytes, int | None, bytes | None, str | None]], bound: int
) -> None:
    """A commit is sized column by column and trimmed to the bound message by message: either way the cache's
    bytes are the sum of its messages' sizes, with keys None, empty, text or bytes, and properties or none."""
    stored = [StoredMessage(position, *rest) for position, rest in enumerate(parts, start=1)]
    cache = EntryCache(bound)
    cache.add("t", stored[: len(stored) // 2])
    cache.add("t", stored[len(stored) // 2 :])
    kept = (cache.read("t", len(stored) - len(cache), len(stored)) or []) if len(cache) else []
    assert kept == stored[len(stored) - len(cache) :]
    assert cache.bytes == sum(map(entry_bytes, kept)) <= bound


def test_columns_of_different_lengths_are_refused_and_change_nothing() -> None:
    cache = EntryCache(1 << 20)
    cache.add("t", messages(1, 2))
    with pytest.raises(ValueError, match="columns of 2 keys, 2 payloads, 1 publish times, 2 properties and 2 producer"):
        cache.add_columns("t", 3, 4, ["k", "k"], [b"a", b"b"], [5], [None, None], ["p", "p"])
    with pytest.raises(ValueError, match="columns of 1 keys, 1 payloads, 1 publish times, 0 properties and 1 producer"):
        cache.add_columns("t", 9, 9, ["k"], [b"a"], [5], [], ["p"])  # not continuing the run: it stays all the same
    with pytest.raises(ValueError, match="1 properties and 0 producer names"):
        cache.add_columns("t", 3, 3, ["k"], [b"a"], [5], [None], [])
    assert len(cache) == 2 and cache.read("t", 0, 5) == messages(1, 2)


def test_cached_messages_are_no_work_for_the_garbage_collector() -> None:
    """The cache holds strings, bytes and ints in a few lists: objects the collector does not track, where a
    StoredMessage (a named tuple) stays tracked as long as it lives and is walked at every full collection."""
    cache = EntryCache(1 << 30)
    count = 20_000
    gc.collect()
    before = len(gc.get_objects())
    for first in range(1, count, 1000):
        cache.add_columns(
            "t",
            first,
            first + 999,
            [f"key-{i}" for i in range(first, first + 1000)],
            [b"payload %d" % i for i in range(first, first + 1000)],
            [first] * 1000,
            [None] * 1000,
            ["producer"] * 1000,
        )
    assert len(cache) == count
    assert len(gc.get_objects()) - before < 100  # the lists and chunk records, not an object per message
    assert cache.read("t", count - 1, 5) == [
        StoredMessage(count, f"key-{count}", b"payload %d" % count, 19_001, None, "producer")
    ]


@pytest.mark.parametrize("bad", [-1, 1.5, "64", None, True])
def test_a_bad_bound_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        EntryCache(bad)  # type: ignore[arg-type]


class CacheAgainstTheLog(RuleBasedStateMachine):
    """Commits (some written elsewhere, not through this cache), drops and reads in any order: every answer is
    what the log holds, a read's answer is a non-empty prefix of the log's, and the bound and counts hold."""

    def __init__(self) -> None:
        super().__init__()
        self.size = entry_bytes(message(1))
        self.cache = EntryCache(12 * self.size)
        self.log: dict[str, list[StoredMessage]] = {topic: [] for topic in TOPICS}

    def _commit(self, topic: str, count: int) -> list[StoredMessage]:
        stored = messages(len(self.log[topic]) + 1, count)
        self.log[topic] += stored
        return stored

    @rule(topic=st.sampled_from(TOPICS), count=st.integers(1, 8))
    def commit(self, topic: str, count: int) -> None:
        self.cache.add(topic, self._commit(topic, count))

    @rule(topic=st.sampled_from(TOPICS), count=st.integers(1, 3))
    def written_elsewhere(self, topic: str, count: int) -> None:
        self._commit(topic, count)

    @rule(topic=st.sampled_from(TOPICS))
    def drop(self, topic: str) -> None:
        self.cache.drop(topic)

    @precondition(lambda self: any(self.log.values()))
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        topic = data.draw(st.sampled_from([t for t in TOPICS if self.log[t]]))
        after = data.draw(st.integers(-1, len(self.log[topic]) + 1))
        limit = data.draw(st.integers(0, 20))
        found = self.cache.read(topic, after, limit)
        if found is not None:
            truth = [m for m in self.log[topic] if m.position > after][:limit]
            assert found and found == truth[: len(found)]

    @precondition(lambda self: any(self.log.values()))
    @rule(data=st.data())
    def get_many(self, data: st.DataObject) -> None:
        topic = data.draw(st.sampled_from([t for t in TOPICS if self.log[t]]))
        positions = data.draw(st.lists(st.integers(0, len(self.log[topic]) + 2), max_size=8))
        found, missing = self.cache.get_many(topic, positions)
        assert set(found) | set(missing) == set(positions) and not set(found) & set(missing)
        for position, stored in found.items():
            assert stored == self.log[topic][position - 1]

    @invariant()
    def bounded_and_counted(self) -> None:
        assert self.cache.bytes <= self.cache.max_bytes
        assert self.cache.bytes == len(self.cache) * self.size


CacheAgainstTheLog.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_the_cache_agrees_with_the_log = pytest.mark.slow(CacheAgainstTheLog.TestCase)


def test_a_store_reads_what_it_just_stored_from_its_cache_and_the_rest_from_the_log(tmp_path: Path) -> None:
    async def run() -> None:
        store = SQLiteStore(Log(tmp_path / "log.db"), entry_cache_bytes=5 * entry_bytes(message(1, b"p" * 10)))
        await store.start()
        try:
            for n in range(8):
                await store.append("t", None, [(None, "k", b"p" * 10)])
                assert store.last_position("t") == n + 1
            cache = store.entry_cache
            assert len(cache) == 5  # the bound holds positions 4 to 8
            misses = cache.misses
            recent = await store.read("t", 3, 100)
            assert [m.position for m in recent] == [4, 5, 6, 7, 8] and cache.misses == misses
            early = await store.read("t", 0, 100)  # position 1 left the cache: the log answers, all of it
            assert [m.position for m in early] == list(range(1, 9)) and cache.misses == misses + 1
            assert early[3:] == recent  # the same messages from either
            found = await store.read_positions("t", [2, 6, 8, 12])
            assert sorted(found) == [2, 6, 8] and found[2] == early[1] and found[6] == recent[2]
        finally:
            await store.close()

    run_async(run())
