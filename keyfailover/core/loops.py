"""Which event loop runs the server, the brokers and the synchronous client: uvloop (libuv's loop for asyncio)
when it is installed, the standard library's otherwise.

``auto``, the default, takes uvloop when it can be imported (``scripts/setup`` installs it, the ``fast``
extra) and asyncio's own loop when not; ``uvloop`` insists on it; ``asyncio`` never uses it. ``serve
--loop`` chooses for a server; the environment variable ``KEYFAILOVER_LOOP`` chooses where no option
does (a server without ``--loop``, the synchronous client's loop thread, the tools' processes), so one
setting moves every process of a run to the other loop.

A program that must shape every loop keyfailover makes in its process (the chaos worker routes each
connection through its fault proxies) sets a loop factory with :func:`set_loop_factory`. Before Python
3.14 an event loop policy of the program's own is honoured too; from 3.14 on, which deprecates event
loop policies, it is not read at all.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import Final, Literal

from keyfailover.core.errors import ConfigError

__all__ = [
    "LOOP_CHOICES",
    "LOOP_ENV",
    "LoopName",
    "chosen_loop",
    "loop_class",
    "loop_name",
    "new_loop",
    "set_loop_factory",
]

LoopName = Literal["asyncio", "uvloop"]

LOOP_CHOICES = ("auto", "asyncio", "uvloop")
"""What ``--loop`` and ``KEYFAILOVER_LOOP`` accept."""

LOOP_ENV = "KEYFAILOVER_LOOP"
"""The environment variable that chooses the loop where no option does."""

_READS_POLICY: Final = sys.version_info < (3, 14)
"""Whether :func:`new_loop` honours a program's own event loop policy: not from Python 3.14 on, which deprecates
policies (reading one there warns)."""

_FACTORY: list[Callable[[], asyncio.AbstractEventLoop] | None] = [None]
"""The loop factory :func:`set_loop_factory` set (None: none), in a slot each thread reads once a loop."""


def chosen_loop(choice: str | None = None) -> LoopName:
    """The loop ``choice`` names, ``auto`` resolved: ``"uvloop"`` or ``"asyncio"``. ``None`` reads
    ``KEYFAILOVER_LOOP``, ``auto`` when it is unset or empty. Raises ConfigError for a name not in
    :data:`LOOP_CHOICES`, and for ``uvloop`` when it is not installed."""
    where = "loop"
    if choice is None:
        choice = os.environ.get(LOOP_ENV) or "auto"
        where = f"${LOOP_ENV}"
    if choice not in LOOP_CHOICES:
        raise ConfigError(f"{where} {choice!r} is not one of {', '.join(LOOP_CHOICES)}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                f"{where} 'uvloop' needs the uvloop package, which is not installed "
                "(pip install 'keyfailover[fast]', or scripts/setup); 'auto' or 'asyncio' run without it"
            ) from None
        return "asyncio"
    return "uvloop"


def loop_class(choice: str | None = None) -> type[asyncio.AbstractEventLoop]:
    """The class of the loop :func:`chosen_loop` picks, for code that subclasses it."""
    if chosen_loop(choice) == "uvloop":
        import uvloop

        return uvloop.Loop
    return asyncio.SelectorEventLoop


def loop_name(loop: asyncio.AbstractEventLoop) -> LoopName:
    """Which kind of loop ``loop`` is, a subclass of one counted as it: ``"uvloop"`` or ``"asyncio"``."""
    return "uvloop" if any(kind.__module__.startswith("uvloop") for kind in type(loop).__mro__) else "asyncio"


def set_loop_factory(factory: Callable[[], asyncio.AbstractEventLoop] | None) -> None:
    """Make :func:`new_loop` make every loop of this process from now on with ``factory``, whatever the choice
    (None: the chosen kind again). For a program that must shape each loop keyfailover makes, as an event loop
    policy did before Python 3.14 deprecated policies. Raises TypeError for anything but a callable or None."""
    if factory is not None and not callable(factory):
        raise TypeError(f"a loop factory must be callable or None, not {type(factory).__name__}")
    _FACTORY[0] = factory


def new_loop(choice: str | None = None) -> asyncio.AbstractEventLoop:
    """A new event loop of the kind :func:`chosen_loop` picks, not set as any thread's current loop. A loop
    factory set with :func:`set_loop_factory` makes it instead, whatever the choice; so does, before Python
    3.14, an event loop policy the program set of its own."""
    kind = loop_class(choice)  # checked even where a factory or policy decides
    factory = _FACTORY[0]
    if factory is not None:
        return factory()
    if _READS_POLICY and type(asyncio.get_event_loop_policy()) is not asyncio.DefaultEventLoopPolicy:
        return asyncio.new_event_loop()
    return kind()
