"""The delivery settings, declared once: for the dispatcher, the server's subscriptions, the admin endpoint
and the command line.

Each field of :class:`DeliverySettings` holds a setting's default, its unit and meaning, and in its
metadata what the command line shows and accepts: ``help``, the text of its ``keyfailover serve``
option; ``what``, the kind of value in words; ``flag_range``, for an int, the inclusive range its options
accept, narrower than what the type itself accepts; ``own``, whether a subscription may have its own value
(``keyfailover admin configure``). A float setting is seconds, whose options take 0 to a day.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

from keyfailover.core.errors import ConfigError

__all__ = [
    "DEFAULT_ACK_TIMEOUT",
    "DEFAULT_MAX_REPLAY",
    "DEFAULT_MAX_UNACKED",
    "DEFAULT_NACK_BACKOFF_MAX",
    "DeliverySettings",
    "check_delivery_settings",
]

DEFAULT_ACK_TIMEOUT = 30.0
"""The server's ack deadline unless configured otherwise: SQS's default visibility timeout and
Kafka share groups' record lock. The core's own default is 0 (no leases): its caller owns the clock."""

DEFAULT_NACK_BACKOFF_MAX = 60.0
"""The longest a nacked key waits for its redelivery unless configured otherwise (Apache Pulsar's
MultiplierRedeliveryBackoff default maxDelayMs)."""

DEFAULT_MAX_UNACKED = 50_000
"""Apache Pulsar's default maxUnackedMessagesPerConsumer."""

DEFAULT_MAX_REPLAY = 100_000
"""Messages a dispatcher holds unacknowledged unless configured otherwise."""


def check_int(name: str, value: object, low: int) -> None:
    """Refuse ``value`` unless it is an int, not a bool, of at least ``low``."""
    if type(value) is not int or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, not {value!r}")


def check_number(name: str, value: object, low: float, *, inclusive: bool = True, extra: str = "") -> None:
    """Refuse ``value`` unless it is a finite int or float, not a bool, above ``low``: or equal, when ``inclusive``."""
    sign = ">=" if inclusive else ">"
    if type(value) not in (int, float):
        raise ConfigError(f"{name} must be a finite number {sign} {low}{extra}, not {type(value).__name__} {value!r}")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or number < low or (not inclusive and number == low):
        raise ConfigError(f"{name} must be a finite number {sign} {low}{extra}, not {value!r}")


def check_delivery_settings(
    ack_timeout: object,
    max_redeliveries: object,
    max_unacked_per_consumer: object,
    nack_backoff: object = 0.0,
    nack_backoff_max: object = DEFAULT_NACK_BACKOFF_MAX,
    *,
    max_replay: object = None,
) -> None:
    """Check ``ack_timeout``: finite seconds >= 0; ``max_redeliveries``: an int >= 0 or None;
    ``max_unacked_per_consumer``: an int >= 0; ``nack_backoff``: finite seconds >= 0;
    ``nack_backoff_max``: finite seconds, at least ``nack_backoff``; and ``max_replay``: an int >= 1,
    or None when not given. Raises :class:`ConfigError` naming the first that is not."""
    if max_replay is not None:
        check_int("max_replay", max_replay, 1)
    check_number("ack_timeout", ack_timeout, 0.0, extra=" (0 disables leases)")
    if max_redeliveries is not None:
        check_int("max_redeliveries", max_redeliveries, 0)
    check_int("max_unacked_per_consumer", max_unacked_per_consumer, 0)
    check_number("nack_backoff", nack_backoff, 0.0, extra=" (0 redelivers a nacked message at once)")
    low = float(nack_backoff)  # type: ignore[arg-type]
    check_number("nack_backoff_max", nack_backoff_max, low, extra=f" (at least nack_backoff, {low:g})")


def _setting(
    default: object, *, what: str, help: str, flag_range: tuple[int, int] | None = None, own: bool = True
) -> Any:
    """A field of :class:`DeliverySettings` with the metadata the command line and the admin endpoint read."""
    return field(default=default, metadata={"what": what, "flag_range": flag_range, "help": help, "own": own})


@dataclass(frozen=True)
class DeliverySettings:
    """How a subscription's messages are delivered: leases, redeliveries, backoffs and buffer bounds.

    Its defaults are the server's (``keyfailover serve``); the dispatcher's own keyword arguments
    default to no leases and no unacked limit, as its caller owns the clock. A value that is not
    valid raises :class:`ConfigError` saying what was wrong and what was expected, so a made
    instance is always valid.
    """

    ack_timeout: float = _setting(
        DEFAULT_ACK_TIMEOUT,
        what="a number of seconds",
        help="seconds a consumer has to ack a delivery before it is taken back and the consumer loses its ranges "
        f"until it acks or asks for more again; 0 disables (default {DEFAULT_ACK_TIMEOUT:g})",
    )
    """Seconds a consumer has to ack a delivery before it is taken back and the consumer loses
    its ranges until it shows progress; 0 disables leases."""
    max_redeliveries: int | None = _setting(
        None,
        what="a number of redeliveries",
        flag_range=(0, 1_000_000),
        help="after this many redeliveries a message goes to the dead-letter topic <topic>-<subscription>-DLQ "
        "and its key goes on (default: redeliver for ever)",
    )
    """Failed deliveries after the first that a message may have before it is dead-lettered,
    to ``<topic>-<subscription>-DLQ`` on a server; None redelivers for ever."""
    max_replay: int = _setting(
        DEFAULT_MAX_REPLAY,
        what="a number of messages",
        flag_range=(100, 100_000_000),
        help=f"messages a subscription holds unacked in memory, waiting and in flight (default {DEFAULT_MAX_REPLAY}); "
        "past half of it, the messages of consumers that cannot take them stay in the log and are re-read later",
    )
    """Messages held unacknowledged, waiting and in flight: the dispatcher takes no more at the bound."""
    max_unacked_per_consumer: int = _setting(
        DEFAULT_MAX_UNACKED,
        what="a number of messages",
        flag_range=(0, 10_000_000),
        help="a consumer holding this many unacked messages gets no more until it acks half of them "
        f"(Pulsar's maxUnackedMessagesPerConsumer); 0 is no limit (default {DEFAULT_MAX_UNACKED})",
        own=False,
    )
    """Unacked deliveries at which a consumer gets no more until it is down to half of them; 0: no
    limit. The same for every subscription of a server, and fixed for the life of a dispatcher."""
    nack_backoff: float = _setting(
        0.0,
        what="a number of seconds",
        help="seconds a nacked message waits before it is delivered again, doubling with each failure of it up to "
        "--nack-backoff-max; in ordered mode its key waits with it, no other key does (default 0: at once)",
    )
    """Seconds a nacked message waits before it is delivered again, doubling with each failure of it
    up to ``nack_backoff_max``; in ordered mode its whole key waits. 0 redelivers at once."""
    nack_backoff_max: float = _setting(
        DEFAULT_NACK_BACKOFF_MAX,
        what="a number of seconds",
        help=f"the longest nack backoff in seconds (default {DEFAULT_NACK_BACKOFF_MAX:g})",
    )
    """The longest nack backoff, in seconds: at least ``nack_backoff``."""

    def __post_init__(self) -> None:
        """Refuse a value that is not valid: :func:`check_delivery_settings`, ``max_replay`` included."""
        check_int("max_replay", self.max_replay, 1)  # None is a value here, not "not given"
        check_delivery_settings(
            self.ack_timeout,
            self.max_redeliveries,
            self.max_unacked_per_consumer,
            self.nack_backoff,
            self.nack_backoff_max,
        )

    @classmethod
    def declared(cls) -> tuple[Field[Any], ...]:
        """Every setting's field, in declaration order: its ``name``, ``default`` and ``metadata``."""
        return fields(cls)

    @classmethod
    def metadata(cls, name: str) -> Mapping[str, Any]:
        """A setting's metadata: ``what``, ``help``, ``flag_range`` and ``own``, as the module says."""
        return next(declared.metadata for declared in fields(cls) if declared.name == name)

    @classmethod
    def own_names(cls) -> tuple[str, ...]:
        """The settings a subscription may have of its own, in declaration order."""
        return tuple(setting.name for setting in fields(cls) if setting.metadata["own"])

    @classmethod
    def value_type(cls, name: str) -> tuple[type[int] | type[float], bool]:
        """A setting's type: int or float, and whether None is a value of it."""
        hint = typing.get_type_hints(cls)[name]
        kinds = typing.get_args(hint) or (hint,)
        number = int if int in kinds else float
        return number, type(None) in kinds

    def with_overrides(self, own: Mapping[str, object]) -> DeliverySettings:
        """These settings with a subscription's ``own`` values over them. Raises :class:`ConfigError`,
        changing nothing, for a name that is not one a subscription may set, or a result not valid."""
        allowed = self.own_names()
        unknown = sorted(name for name in own if name not in allowed)
        if unknown:
            raise ConfigError(f"unknown delivery settings {unknown}; expected some of {list(allowed)}")
        return replace(self, **own)  # type: ignore[arg-type]

    def own_view(self) -> dict[str, float | int | None]:
        """The settings a subscription may have of its own, by name: as the admin endpoint shows them."""
        return {name: getattr(self, name) for name in self.own_names()}
