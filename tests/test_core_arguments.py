"""The core checks its arguments up front: a bad one is refused with a KeyFailoverError that names it,
and a refused call changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover import (
    ConfigError,
    ConsumerError,
    ContiguousPolicy,
    Dispatcher,
    InvalidKeyError,
    KeyFailoverError,
    ManualClock,
    MultiRangePolicy,
    key_hash,
    key_hashes,
)

BAD_NUMBERS: list[object] = ["1", None, True, float("nan"), float("inf"), [1.0]]


@pytest.mark.parametrize(
    ("argument", "bad"),
    [
        *[("half_life", value) for value in [*BAD_NUMBERS, 0, 0.0, -1.0]],
        *[("shift_interval", value) for value in [*BAD_NUMBERS, -0.5]],
        *[("shift_min_traffic", value) for value in [*BAD_NUMBERS, -1]],
        *[("shift_threshold", value) for value in ["1.2", True, float("nan"), float("inf"), 0.99, [1.1]]],
        *[("history", value) for value in ["10", None, True, 1.5, -1]],
        *[("max_replay", value) for value in ["10", None, True, 1.5, 0, -3]],
        *[("split", value) for value in ["middle", None, 3, ["traffic"]]],
        *[("policy", value) for value in ["single", "", None, 3, ["multi"], "Multi"]],
        *[("max_ranges", value) for value in ["16", None, True, 1.5, 0, -1]],
        ("clock", "not callable"),
        ("clock", lambda: "noon"),
        ("clock", lambda: math.nan),
    ],
)
def test_every_constructor_argument_is_checked_at_construction(argument: str, bad: object) -> None:
    arguments: dict[str, Any] = {"clock": ManualClock(), argument: bad}
    with pytest.raises(ConfigError, match=argument):
        Dispatcher(**arguments)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "half_life": st.one_of(st.floats(), st.integers(-5, 5), st.text(max_size=2), st.none(), st.booleans()),
            "shift_interval": st.one_of(st.floats(), st.integers(-5, 5), st.none(), st.booleans()),
            "shift_min_traffic": st.one_of(st.floats(), st.integers(-5, 5), st.text(max_size=2)),
            "shift_threshold": st.one_of(st.floats(), st.none(), st.booleans()),
            "history": st.one_of(st.integers(-3, 5), st.floats(), st.booleans()),
            "max_replay": st.one_of(st.integers(-3, 50), st.floats(), st.booleans()),
            "policy": st.one_of(st.sampled_from(["multi", "contiguous"]), st.text(max_size=3), st.none()),
            "max_ranges": st.one_of(st.integers(-2, 20), st.floats(), st.booleans()),
        },
    )
)
def test_a_constructed_dispatcher_always_works(arguments: dict[str, Any]) -> None:
    """Either construction is refused, or every later call works: nothing bad is accepted silently."""
    clock = ManualClock()
    try:
        dispatcher = Dispatcher(clock=clock, **arguments)
    except ConfigError:
        return
    dispatcher.add_consumer("c1")
    dispatcher.flow("c1", 10)
    for position in range(1, min(dispatcher.wants(), 5) + 1):
        dispatcher.publish(position, f"k{position}")
    for step in range(3):
        clock.now += 40.0 * step
        for delivery in dispatcher.poll():
            dispatcher.ack(delivery.consumer, delivery.position)
    dispatcher.add_consumer("c2")
    dispatcher.remove_consumer("c1")
    dispatcher.poll()
    dispatcher.stats()


def test_the_policy_is_built_from_the_arguments() -> None:
    clock = ManualClock()
    assert Dispatcher(clock=clock).policy == MultiRangePolicy(max_ranges=16, threshold=1.1, min_traffic=1000.0)
    assert Dispatcher(clock=clock, max_ranges=3, shift_threshold=1.3, shift_min_traffic=5).policy == MultiRangePolicy(
        max_ranges=3, threshold=1.3, min_traffic=5.0
    )
    contiguous = Dispatcher(clock=clock, policy="contiguous", split="midpoint", shift_threshold=None, max_ranges=2)
    assert contiguous.policy == ContiguousPolicy(split="midpoint", threshold=1.1, min_traffic=1000.0)


def test_a_dispatcher_with_shift_threshold_one_takes_a_third_consumer() -> None:
    dispatcher = Dispatcher(clock=ManualClock(), shift_threshold=1.0)
    for cid in ("c1", "c2", "c3"):
        dispatcher.add_consumer(cid)
    assert sorted(dispatcher.range_map().consumers()) == ["c1", "c2", "c3"]


def _state(dispatcher: Dispatcher) -> tuple[Any, ...]:
    stats = dispatcher.stats()
    return dispatcher.snapshot(), stats["consumers"], stats["held"], dispatcher.consumers()


@pytest.mark.parametrize("cid", [["c1"], {"c": 1}, {1, 2}, 7, None, "", b"c1"])
def test_a_malformed_consumer_id_is_a_consumer_error_and_changes_nothing(cid: Any) -> None:
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock)
    dispatcher.add_consumer("c1")
    dispatcher.flow("c1", 1)
    dispatcher.publish(1, "k")
    dispatcher.poll()
    before = _state(dispatcher)
    calls: list[Callable[[], object]] = [
        lambda: dispatcher.add_consumer(cid),
        lambda: dispatcher.remove_consumer(cid),
        lambda: dispatcher.flow(cid, 1),
        lambda: dispatcher.ack(cid, 1),
        lambda: dispatcher.ack_many(cid, [1]),
        lambda: dispatcher.nack(cid, 1),
        lambda: dispatcher.ranges_of(cid),
    ]
    for call in calls:
        with pytest.raises(ConsumerError, match="consumer id must be a non-empty str"):
            call()
        assert _state(dispatcher) == before


def test_key_hashes_refuses_one_key_where_a_batch_belongs() -> None:
    for one in ["abc", b"abc", bytearray(b"abc")]:
        with pytest.raises(InvalidKeyError, match="takes a batch of keys"):
            key_hashes(one)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError, match="takes an iterable of keys, not int"):
        key_hashes(5)  # type: ignore[arg-type]
    assert key_hashes(["abc"]).tolist() == [key_hash("abc")]


def test_the_drain_histogram_observes_every_change_whatever_the_history() -> None:
    """history bounds rebalances() only: with history=1 and three changes waiting, all three are observed."""
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock, history=1, shift_threshold=None)
    dispatcher.add_consumer("c1")
    dispatcher.flow("c1", 1000)
    keys = [f"k{i}" for i in range(400)]
    for position, key in enumerate(keys, 1):
        dispatcher.publish(position, key)
    held = dispatcher.poll()  # everything in flight on c1, unacked
    before = dispatcher.drain_histogram().count
    for joiner in ("c2", "c3", "c4"):  # each change moves keys in flight on c1: they drain
        clock.now += 1.0
        dispatcher.add_consumer(joiner)
    assert dispatcher.drain_histogram().count == before  # nothing drained yet
    clock.now += 1.0
    dispatcher.ack_many("c1", [delivery.position for delivery in held])
    assert dispatcher.drain_histogram().count == before + 3
    assert len(dispatcher.rebalances()) == 1


def test_poll_returns_waiting_keys_then_waiting_keyless_then_fresh_messages() -> None:
    dispatcher = Dispatcher(clock=ManualClock())
    dispatcher.add_consumer("c1")
    for position, key in [(1, "a"), (2, None), (3, "b"), (4, None)]:
        dispatcher.publish(position, key)
    assert dispatcher.poll() == []  # no permits: a and b wait on c1, 2 and 4 wait keyless
    dispatcher.flow("c1", 10)
    dispatcher.publish(5, "c")
    dispatcher.publish(6, None)
    assert [d.position for d in dispatcher.poll()] == [1, 3, 2, 4, 5, 6]


def test_every_core_error_is_a_keyfailover_error() -> None:
    assert issubclass(ConfigError, KeyFailoverError) and issubclass(ConfigError, ValueError)
