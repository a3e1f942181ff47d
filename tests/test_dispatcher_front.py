"""The compiled build's front: every call, with arguments of any type, raises or answers as the plain source does.

In the compiled build (scripts/setup) ``Dispatcher`` is the compiled core behind a front
(:mod:`keyfailover.core.dispatcher._front`); the plain source of the core is loaded beside it as the
reference. Each example drives a front dispatcher and a reference one through the same calls,
arguments drawn from well-formed values and from values of every wrong type mypyc refuses or
converts (a bool for an int, an int for a float, a float, bytes for a str...), and compares what
each call raised (type and message) or returned, and the state after it. Without the compiled
build both sides are the plain source, and the test still runs the calls.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyfailover.core.clock import ManualClock
from keyfailover.core.dispatcher import COMPILED, DeliverySettings, Dispatcher
from keyfailover.core.dispatcher._front import _reference


class _Iterated(list[Any]):
    """Positions each side of the comparison is handed as an iterator of its own."""


ODD = st.sampled_from([None, True, False, 1.5, 2, -1, 0, "", "c1", "x", b"c1", ["c1"], (1,), {"a": 1}, float("nan")])
CIDS = st.one_of(st.sampled_from(["c1", "c2", "c3"]), ODD)
POSITIONS = st.one_of(st.integers(0, 12), ODD)
KEYS = st.one_of(st.sampled_from(["k1", "k2", b"k3", None]), ODD)
NUMBERS = st.one_of(st.sampled_from([0.0, 0.5, 2.0]), ODD)

CALLS = st.one_of(
    st.tuples(st.just("add_consumer"), st.tuples(CIDS)),
    st.tuples(st.just("remove_consumer"), st.tuples(CIDS)),
    st.tuples(st.just("flow"), st.tuples(CIDS, POSITIONS)),
    st.tuples(st.just("permits"), st.tuples(CIDS)),
    st.tuples(st.just("withdraw_permits"), st.tuples(CIDS)),
    st.tuples(st.just("inflight_count"), st.tuples(CIDS)),
    st.tuples(st.just("publish"), st.tuples(POSITIONS, KEYS)),
    st.tuples(st.just("publish_at"), st.tuples(POSITIONS, KEYS, NUMBERS)),
    st.tuples(st.just("restore"), st.tuples(POSITIONS, KEYS, NUMBERS)),
    st.tuples(st.just("poll"), st.just(())),
    st.tuples(st.just("ack"), st.tuples(CIDS, POSITIONS)),
    st.tuples(st.just("ack_many"), st.tuples(CIDS, st.lists(POSITIONS, max_size=3))),
    st.tuples(st.just("extend"), st.tuples(CIDS, st.lists(POSITIONS, max_size=3))),
    st.tuples(st.just("unsent"), st.tuples(CIDS, st.lists(POSITIONS, max_size=3))),
    st.tuples(st.just("nack"), st.tuples(CIDS, POSITIONS)),
    st.tuples(st.just("failures"), st.tuples(CIDS, POSITIONS)),
    st.tuples(st.just("lease_expired"), st.tuples(CIDS, POSITIONS)),
    st.tuples(st.just("ranges_of"), st.tuples(CIDS)),
    st.tuples(st.just("declared_ranges"), st.tuples(CIDS)),
    st.tuples(st.just("owner_of"), st.tuples(KEYS)),
    st.tuples(st.just("set_policy"), st.tuples(st.one_of(st.just("contiguous"), ODD))),
    st.tuples(st.just("set_consume_mode"), st.tuples(st.one_of(st.just("unordered"), st.just("ordered"), ODD))),
    st.tuples(st.just("honour_delays"), st.tuples(ODD)),
    st.tuples(st.just("set_settings"), st.tuples(st.one_of(st.just(DeliverySettings(ack_timeout=5.0)), ODD))),
    st.tuples(st.just("restored"), st.tuples(st.lists(POSITIONS, max_size=2), POSITIONS)),
    st.tuples(st.just("dead_lettered"), st.tuples(st.lists(POSITIONS, max_size=3))),
    st.tuples(st.just("publish_many"), st.tuples(st.lists(st.tuples(POSITIONS, KEYS), max_size=3))),
    st.tuples(st.just("ack_many"), st.tuples(CIDS, st.lists(POSITIONS, max_size=3).map(_Iterated))),
)


def _outcome(target: Any, name: str, args: tuple[Any, ...]) -> tuple[str, Any]:
    """What ``target.name(*args)`` did: ``("raised", (type name, message))`` or ``("returned", a comparable form)``."""
    args = tuple(iter(list(arg)) if isinstance(arg, _Iterated) else arg for arg in args)
    try:
        if name in ("publish_at", "restore"):  # the delivery time is a keyword argument
            position, key, deliver_at = args
            result = getattr(target, "publish" if name == "publish_at" else name)(position, key, deliver_at=deliver_at)
        else:
            result = getattr(target, name)(*args)
    except Exception as exc:  # the point: any error, compared by type and message
        return "raised", (type(exc).__name__, str(exc))
    if name == "poll":
        result = [tuple(delivery) for delivery in result]
    return "returned", result


def _state(dispatcher: Any) -> tuple[Any, ...]:
    return (
        dispatcher.consumers(),
        dispatcher.ranges(),
        dispatcher.stats(),
        dispatcher.wants(),
        dispatcher.consume_mode,
        dispatcher.policy.name,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(CALLS, max_size=25),
    ack_timeout=st.one_of(st.just(0.0), st.just(5.0)),
)
def test_the_front_raises_and_answers_as_the_plain_source_for_arguments_of_any_type(
    calls: list[tuple[str, tuple[Any, ...]]], ack_timeout: float
) -> None:
    front = Dispatcher(clock=ManualClock(100.0), ack_timeout=ack_timeout, max_replay=8)
    plain = _reference().Dispatcher(clock=ManualClock(100.0), ack_timeout=ack_timeout, max_replay=8)
    for name, args in calls:
        assert _outcome(front, name, args) == _outcome(plain, name, args), (name, args)
        assert _state(front) == _state(plain), (name, args)


@settings(max_examples=100, deadline=None)
@given(
    argument=st.sampled_from(["max_replay", "half_life", "history", "max_ranges", "spill", "slots", "ack_timeout"]),
    value=st.one_of(ODD, st.just((0, 65535)), st.just((1, 2.0))),
)
def test_the_front_builds_or_refuses_as_the_plain_source(argument: str, value: object) -> None:
    def build(kind: Any) -> tuple[str, Any]:
        try:
            built = kind(clock=ManualClock(1.0), **{argument: value})
        except Exception as exc:  # compared by type and message
            return "raised", (type(exc).__name__, str(exc))
        return "built", (built.max_replay, built.slots, built.ack_timeout)

    assert build(Dispatcher) == build(_reference().Dispatcher)


def test_the_front_is_the_compiled_core_in_the_compiled_build() -> None:
    """In the compiled build, calls of the right types go to the compiled core; else it is the plain one."""
    core = type(Dispatcher()).__mro__[1 if COMPILED else 0]
    assert core.__module__ == "keyfailover.core.dispatcher._core"
    assert (type(Dispatcher.poll).__name__ != "function") == COMPILED
