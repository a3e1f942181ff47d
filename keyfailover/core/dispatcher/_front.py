"""The dispatcher as callers get it: the compiled core where the build has one, behind a front that keeps its errors.

The compiled core (``scripts/setup`` has mypyc compile :mod:`._core` in place) checks each argument
against its annotation before the method runs: a wrong type raises mypyc's own ``TypeError`` instead of the
error the method's checks raise, such as :class:`~keyfailover.core.errors.ConsumerError`, and
``True`` passes as ``1`` where an ``int`` is declared. So in the compiled build
:class:`Dispatcher` is a subclass whose public methods pass arguments of the types
the core takes as they are straight to the compiled method, and hand any other call to the same
method of the *reference*: the plain source of :mod:`._core`, loaded on first need as a module of
its own. Every check comes before any change there (a rejected call changes nothing), so the
reference raises the very error of the plain build, or answers as it does: ``failures(cid, "x")``
is None; the constructor builds a throwaway reference dispatcher first, for the same errors.
Batched calls (``publish_many``, ``ack_many``, ``poll``) cross the front once a batch.

``KEYFAILOVER_COMPILED=0`` in the environment at import runs the plain source even where the
compiled build is installed (how the tests run the core's properties against both); so does a
compiled core older than its source, with a warning.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

SWITCH = "KEYFAILOVER_COMPILED"
"""The environment variable that, set to ``0`` at import, runs the plain source of the dispatcher core."""

_CORE = "keyfailover.core.dispatcher._core"
_REFERENCE = "keyfailover.core.dispatcher._reference"
_SOURCE = Path(__file__).with_name("_core.py")


def _load_source(name: str) -> ModuleType:
    """The plain source of the core (``_core.py``), executed as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, _SOURCE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the dispatcher core's source {str(_SOURCE)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _stale() -> str | None:
    """The compiled core beside the source when it is older than the source (built before its last edit), else None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = _SOURCE.with_name("_core" + suffix)
        if built.exists():
            return str(built) if built.stat().st_mtime < _SOURCE.stat().st_mtime else None
    return None


if _CORE not in sys.modules:
    if os.environ.get(SWITCH, "1") not in ("0", "1"):
        warnings.warn(
            f"{SWITCH}={os.environ[SWITCH]!r} is ignored: 0 runs the dispatcher core's plain source, 1 (the default) "
            "the compiled core where it is built",
            stacklevel=2,
        )
    if os.environ.get(SWITCH) == "0":
        _load_source(_CORE)
    elif (stale := _stale()) is not None:
        warnings.warn(
            f"the compiled dispatcher core {stale} is older than its source, which runs instead; "
            "scripts/setup compiles it again",
            stacklevel=2,
        )
        _load_source(_CORE)

from keyfailover.core.dispatcher._core import Dispatcher as _Core  # noqa: E402  (the switch above picks it)
from keyfailover.core.dispatcher._core import check_consume_mode  # noqa: E402
from keyfailover.core.dispatcher._settings import DEFAULT_NACK_BACKOFF_MAX, DeliverySettings  # noqa: E402

COMPILED = not str(sys.modules[_CORE].__file__).endswith(".py")
"""Whether the dispatcher core running is the compiled one."""


def _reference() -> ModuleType:
    """The plain source of the core as a module of its own (loaded on first use): the errors of the plain build."""
    return sys.modules.get(_REFERENCE) or _load_source(_REFERENCE)


def _number(value: object) -> bool:
    """Whether the compiled core takes ``value`` where a float is declared without changing what it means."""
    return type(value) is float or type(value) is int


def _key(value: object) -> bool:
    """Whether ``value`` is a key the compiled core takes as it is: a str, bytes or None."""
    return value is None or isinstance(value, str | bytes)


def _listed(values: Any) -> Any:
    """``values`` as a list when it is an iterator or another iterable (so both sides see all), else as it is."""
    if type(values) is list or type(values) is tuple:
        return values
    try:
        return list(values)
    except TypeError:  # not iterable: the core's own error comes from iterating it
        return values


def _ints(values: Any) -> bool:
    """Whether ``values`` is a list or tuple of ints, not bools: what the compiled core loops over as it is."""
    return (type(values) is list or type(values) is tuple) and set(map(type, values)) <= _INT


_INT = {int}


def _optional_int(value: object) -> bool:
    """Whether ``value`` is None or an int, not a bool: what the compiled core takes as it is for ``int | None``."""
    return value is None or type(value) is int


class _CheckedDispatcher(_Core):
    """The compiled core behind its front (see the module): the plain build's errors and answers for every call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _reference().Dispatcher(*args, **kwargs)  # raises what the plain build raises; else it is thrown away
        super().__init__(*args, **kwargs)

    def add_consumer(self, cid: Any, ranges: Any = None) -> None:
        if isinstance(cid, str):
            super().add_consumer(cid, ranges)
        else:
            _reference().Dispatcher.add_consumer(self, cid, ranges)

    def remove_consumer(self, cid: Any, *, reason: Any = "leave") -> None:
        if isinstance(cid, str) and isinstance(reason, str):
            super().remove_consumer(cid, reason=reason)
        else:
            _reference().Dispatcher.remove_consumer(self, cid, reason=reason)

    def flow(self, cid: Any, permits: Any) -> None:
        if isinstance(cid, str) and type(permits) is int:
            super().flow(cid, permits)
        else:
            _reference().Dispatcher.flow(self, cid, permits)

    def permits(self, cid: Any) -> int:
        if isinstance(cid, str):
            return super().permits(cid)
        return int(_reference().Dispatcher.permits(self, cid))

    def withdraw_permits(self, cid: Any) -> int:
        if isinstance(cid, str):
            return super().withdraw_permits(cid)
        return int(_reference().Dispatcher.withdraw_permits(self, cid))

    def inflight_count(self, cid: Any) -> int:
        if isinstance(cid, str):
            return super().inflight_count(cid)
        return int(_reference().Dispatcher.inflight_count(self, cid))

    def publish(self, position: Any, key: Any, payload: Any = None, *, deliver_at: Any = 0.0) -> None:
        if type(position) is int and _key(key) and _number(deliver_at):
            super().publish(position, key, payload, deliver_at=deliver_at)
        else:
            _reference().Dispatcher.publish(self, position, key, payload, deliver_at=deliver_at)

    def restore(self, position: Any, key: Any, payload: Any = None, *, deliver_at: Any = 0.0) -> None:
        if type(position) is int and _key(key) and _number(deliver_at):
            super().restore(position, key, payload, deliver_at=deliver_at)
        else:
            _reference().Dispatcher.restore(self, position, key, payload, deliver_at=deliver_at)

    def restored(self, slots: Any, through: Any) -> None:
        slots = _listed(slots)
        if type(through) is int and _ints(slots):
            super().restored(slots, through)
        else:
            _reference().Dispatcher.restored(self, slots, through)

    def ack(self, cid: Any, position: Any) -> None:
        if isinstance(cid, str) and type(position) is int:
            super().ack(cid, position)
        else:
            _reference().Dispatcher.ack(self, cid, position)

    def ack_many(self, cid: Any, positions: Any) -> tuple[list[int], list[int]]:
        positions = _listed(positions)
        if isinstance(cid, str) and _ints(positions):
            return super().ack_many(cid, positions)
        return _pair(_reference().Dispatcher.ack_many(self, cid, positions))

    def extend(self, cid: Any, positions: Any) -> tuple[list[int], list[int]]:
        positions = _listed(positions)
        if isinstance(cid, str) and _ints(positions):
            return super().extend(cid, positions)
        return _pair(_reference().Dispatcher.extend(self, cid, positions))

    def unsent(self, cid: Any, positions: Any) -> tuple[list[int], list[int]]:
        positions = _listed(positions)
        if isinstance(cid, str) and _ints(positions):
            return super().unsent(cid, positions)
        return _pair(_reference().Dispatcher.unsent(self, cid, positions))

    def dead_lettered(self, positions: Any) -> tuple[list[int], list[int]]:
        positions = _listed(positions)
        if _ints(positions):
            return super().dead_lettered(positions)
        return _pair(_reference().Dispatcher.dead_lettered(self, positions))

    def lease_expired(self, cid: Any, position: Any) -> bool:
        if isinstance(cid, str) and type(position) is int:
            return super().lease_expired(cid, position)
        return bool(_reference().Dispatcher.lease_expired(self, cid, position))

    def failures(self, cid: Any, position: Any) -> int | None:
        if isinstance(cid, str) and type(position) is int:
            return super().failures(cid, position)
        found: int | None = _reference().Dispatcher.failures(self, cid, position)
        return found

    def nack(self, cid: Any, position: Any) -> None:
        if isinstance(cid, str) and type(position) is int:
            super().nack(cid, position)
        else:
            _reference().Dispatcher.nack(self, cid, position)

    def ranges_of(self, cid: Any) -> list[tuple[int, int]]:
        if isinstance(cid, str):
            return super().ranges_of(cid)
        return list(_reference().Dispatcher.ranges_of(self, cid))

    def declared_ranges(self, cid: Any) -> list[tuple[int, int]] | None:
        if isinstance(cid, str):
            return super().declared_ranges(cid)
        found: list[tuple[int, int]] | None = _reference().Dispatcher.declared_ranges(self, cid)
        return found

    def set_policy(self, policy: Any) -> None:
        if isinstance(policy, str):
            super().set_policy(policy)
        else:
            _reference().Dispatcher.set_policy(self, policy)

    def set_consume_mode(self, mode: Any) -> None:
        super().set_consume_mode(check_consume_mode(mode))  # its check takes any object

    def set_delivery_settings(
        self,
        *,
        ack_timeout: Any,
        max_redeliveries: Any,
        nack_backoff: Any = 0.0,
        nack_backoff_max: Any = DEFAULT_NACK_BACKOFF_MAX,
        max_replay: Any = None,
    ) -> None:
        arguments = {
            "ack_timeout": ack_timeout,
            "max_redeliveries": max_redeliveries,
            "nack_backoff": nack_backoff,
            "nack_backoff_max": nack_backoff_max,
            "max_replay": max_replay,
        }
        if (
            _number(ack_timeout)
            and _optional_int(max_redeliveries)
            and _number(nack_backoff)
            and _number(nack_backoff_max)
            and _optional_int(max_replay)
        ):
            super().set_delivery_settings(**arguments)
        else:
            _reference().Dispatcher.set_delivery_settings(self, **arguments)

    def set_settings(self, settings: Any) -> None:
        if isinstance(settings, DeliverySettings):
            super().set_settings(settings)
        else:
            _reference().Dispatcher.set_settings(self, settings)

    def owner_of(self, key: Any) -> str | None:
        if isinstance(key, str | bytes):
            return super().owner_of(key)
        owner: str | None = _reference().Dispatcher.owner_of(self, key)
        return owner

    def honour_delays(self, honour: Any) -> None:
        if type(honour) is bool:
            super().honour_delays(honour)
        else:
            _reference().Dispatcher.honour_delays(self, honour)


def _pair(value: Any) -> tuple[list[int], list[int]]:
    """A reference method's ``(taken, rejected)`` answer, typed."""
    taken, rejected = value
    return list(taken), list(rejected)


_CheckedDispatcher.__name__ = _CheckedDispatcher.__qualname__ = "Dispatcher"

if TYPE_CHECKING:
    Dispatcher = _Core
else:
    Dispatcher = _CheckedDispatcher if COMPILED else _Core
