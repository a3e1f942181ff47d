"""Seeded scenarios: a population of keys with their traffic, and a script of joins and leaves.

Keys are named ``key-<rank>``; each strategy places them with its own system's hash (the
keyfailover slot, Pulsar 4.x's consistent-hashing slot, Pulsar 3.x's 31-bit hash). A
window of measured traffic is a multinomial draw of messages over the keys, counted per
keyfailover slot (what the dispatcher measures); balance is judged on the expected traffic,
so a strategy that chases the noise of one window is not rewarded for it. The same seed
gives the same keys, windows and scripts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

from keyfailover.core.hashing import HASH_RANGE_SIZE, key_hashes, pulsar3_hashes, pulsar4_consistent_hashes
from keyfailover.tools.evaluate._events import Join, Leave

__all__ = ["SCENARIOS", "Membership", "Population", "Scenario", "build_scenario"]

SCENARIOS: tuple[str, ...] = ("uniform", "zipf", "hot-key", "rolling-restart", "scale", "random")
"""Every scenario name, in report order."""

Membership = Join | Leave

SEED = 6
"""The default seed of every draw (the one docs/evaluation.md reports); each scenario mixes in its own index."""

ZIPF_EXPONENT = 1.1
HOT_KEY_SHARE = 0.2
WINDOWS = 4
"""Measured windows drawn per scenario; shift chances cycle through them."""


@dataclass(frozen=True)
class _Size:
    keys: int
    messages: int
    consumers: int
    churn_rounds: int
    peak: int
    random_events: int
    random_cap: int


_FULL = _Size(keys=100_000, messages=200_000, consumers=8, churn_rounds=8, peak=32, random_events=200, random_cap=64)
_QUICK = _Size(keys=10_000, messages=20_000, consumers=4, churn_rounds=2, peak=6, random_events=12, random_cap=16)


@dataclass(frozen=True)
class Population:
    """The keys, their expected traffic, and each system's hash of them."""

    key_traffic: npt.NDArray[np.float64]
    """Expected messages of each key in one window."""
    key_shares: npt.NDArray[np.float64]
    """Each key's share of the messages (sums to 1)."""
    key_slots: npt.NDArray[np.int32]
    """keyfailover's slot of each key (Pulsar 3.x's and 4.x's auto-split slot, but for 0)."""
    key_pulsar4: npt.NDArray[np.int32]
    """Pulsar 4.x's consistent-hashing slot of each key, ``m31 % 65535 + 1``."""
    key_pulsar3: npt.NDArray[np.int32]
    """Pulsar 3.x's sticky-key hash of each key, ``m31``."""
    traffic: npt.NDArray[np.float64]
    """Expected messages per keyfailover slot in one window."""
    messages: int

    @classmethod
    def of(cls, shares: npt.NDArray[np.float64], messages: int) -> Population:
        """Keys ``key-0 .. key-<n-1>`` drawn with probabilities ``shares`` (normalised), ``messages`` per window."""
        shares = shares / shares.sum()
        slots, pulsar4, pulsar3 = _key_hashes(len(shares))
        traffic = np.asarray(np.bincount(slots, weights=shares * messages, minlength=HASH_RANGE_SIZE), dtype=np.float64)
        return cls(shares * messages, shares, slots, pulsar4, pulsar3, traffic, messages)

    def window(self, rng: np.random.Generator) -> npt.NDArray[np.float64]:
        """One measured window: ``messages`` messages drawn over the keys, counted per slot."""
        counts = rng.multinomial(self.messages, self.key_shares)
        return np.asarray(np.bincount(self.key_slots, weights=counts, minlength=HASH_RANGE_SIZE), dtype=np.float64)


@cache
def _key_hashes(count: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """keyfailover's slot, Pulsar 4.x's consistent-hashing slot and Pulsar 3.x's hash of ``key-0 .. key-<count-1>``."""
    names = [f"key-{rank}" for rank in range(count)]
    return key_hashes(names), pulsar4_consistent_hashes(names), pulsar3_hashes(names)


@dataclass(frozen=True)
class Scenario:
    """A population, the joins that build the starting group (not measured), and the measured events."""

    name: str
    summary: str
    population: Population
    setup: tuple[Membership, ...]
    events: tuple[Membership, ...]
    windows: tuple[npt.NDArray[np.float64], ...]


def _names(first: int, count: int) -> list[str]:
    return [f"c{index}" for index in range(first, first + count)]


def _churn(rng: np.random.Generator, members: list[str], rounds: int) -> list[Membership]:
    """``rounds`` times: a random member leaves, then a new consumer joins."""
    events: list[Membership] = []
    members = list(members)
    fresh = len(members)
    for _ in range(rounds):
        leaver = members.pop(int(rng.integers(len(members))))
        events.append(Leave(leaver))
        newcomer = f"c{fresh}"
        fresh += 1
        members.append(newcomer)
        events.append(Join(newcomer))
    return events


def _random_walk(rng: np.random.Generator, members: list[str], count: int, cap: int) -> list[Membership]:
    """``count`` events, each a join or a random member's leave with equal odds, between 1 and ``cap`` members."""
    events: list[Membership] = []
    members = list(members)
    fresh = len(members)
    for _ in range(count):
        joins = len(members) == 1 or (len(members) < cap and rng.random() < 0.5)
        if joins:
            newcomer = f"c{fresh}"
            fresh += 1
            members.append(newcomer)
            events.append(Join(newcomer))
        else:
            events.append(Leave(members.pop(int(rng.integers(len(members))))))
    return events


def _shares(kind: str, keys: int) -> npt.NDArray[np.float64]:
    if kind == "uniform":
        return np.ones(keys)
    if kind == "zipf":
        return np.arange(1, keys + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    shares = np.full(keys, (1.0 - HOT_KEY_SHARE) / (keys - 1))
    shares[0] = HOT_KEY_SHARE
    return shares


def build_scenario(name: str, quick: bool = False, seed: int = SEED) -> Scenario:
    """The scenario called ``name`` (one of :data:`SCENARIOS`); ``quick`` makes a small one for tests.

    ``seed`` (an int >= 0) draws the traffic windows and the random joins and leaves: another
    seed checks that a result is not one draw's luck.
    """
    if name not in SCENARIOS:
        raise ValueError(f"scenario {name!r} is unknown; expected one of {', '.join(SCENARIOS)}")
    if type(seed) is not int or seed < 0:
        raise ValueError(f"seed must be an int >= 0, not {seed!r}")
    size = _QUICK if quick else _FULL
    rng = np.random.default_rng([seed, SCENARIOS.index(name)])
    group = _names(0, size.consumers)
    setup: list[Membership] = [Join(consumer) for consumer in group]
    if name in ("uniform", "zipf", "hot-key"):
        kind = name if name != "hot-key" else "hot"
        summary = {
            "uniform": "uniform keys",
            "zipf": f"Zipf({ZIPF_EXPONENT}) keys",
            "hot": f"one key at {HOT_KEY_SHARE:.0%} of traffic, the rest uniform",
        }[kind]
        summary += f"; {size.consumers} consumers, then {size.churn_rounds} rounds of a random leave and a join"
        events = _churn(rng, group, size.churn_rounds)
    elif name == "rolling-restart":
        kind = "zipf"
        summary = f"Zipf({ZIPF_EXPONENT}) keys; each of {size.consumers} consumers leaves and rejoins in turn"
        events = [event for consumer in group for event in (Leave(consumer), Join(consumer))]
    elif name == "scale":
        kind = "zipf"
        summary = f"Zipf({ZIPF_EXPONENT}) keys; 1 consumer, joins up to {size.peak}, random leaves back to 1"
        setup = [Join("c0")]
        grown = _names(0, size.peak)
        events = [Join(consumer) for consumer in grown[1:]]
        while len(grown) > 1:
            events.append(Leave(grown.pop(int(rng.integers(len(grown))))))
    else:
        kind = "zipf"
        summary = (
            f"Zipf({ZIPF_EXPONENT}) keys; {size.consumers} consumers, then {size.random_events} random joins "
            f"and leaves (1 to {size.random_cap} consumers)"
        )
        events = _random_walk(rng, group, size.random_events, size.random_cap)
    population = Population.of(_shares(kind, size.keys), size.messages)
    windows = tuple(population.window(rng) for _ in range(WINDOWS))
    return Scenario(name, summary, population, tuple(setup), tuple(events), windows)
