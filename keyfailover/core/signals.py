"""Ctrl-C and SIGTERM kept from where they do harm: held off while a thread is started (so they reach
the thread that acts on them) and put off while an event loop is made (so none is left half-made)."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from keyfailover.core.loops import new_loop

__all__ = ["interrupts_held", "whole_loop"]

_Handler = Callable[[int, FrameType | None], Any]


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held off in the calling thread while the block runs; one that came meanwhile is
    handled when it ends. A thread started in the block inherits the mask and keeps it: the kernel then
    always gives these signals to the thread that can act on them (Python runs handlers only in the main
    thread; one given to another thread would leave the main thread asleep in a wait until the wait ended
    by itself, so Ctrl-C during a blocking receive with no timeout would be lost until a message came)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def whole_loop(make: Callable[[], asyncio.AbstractEventLoop] = new_loop) -> asyncio.AbstractEventLoop:
    """A new event loop made by ``make``, by default of the kind :mod:`keyfailover.core.loops` chooses, that
    Ctrl-C or SIGTERM never interrupts half-made (it would be collected with an error printed): a loop
    factory for ``asyncio.Runner``. In the main thread their Python handlers are put off while it is made,
    and one that came meanwhile is run as it returns. A mask would not do: the kernel gives the signal to
    any thread that does not block it, and Python then runs the handler in the main thread whatever its
    mask. In another thread no handler runs, so none is put off."""
    if threading.current_thread() is not threading.main_thread():
        return make()
    came: list[tuple[int, FrameType | None]] = []

    def put_off(signum: int, frame: FrameType | None) -> None:
        """Remember a signal that came while the loop was being made, to run its handler once it is."""
        came.append((signum, frame))

    handlers: list[tuple[int, _Handler]] = []
    loop: asyncio.AbstractEventLoop | None = None
    try:
        for held in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(held)
            if callable(handler):
                handlers.append((held, handler))
                signal.signal(held, put_off)
        loop = make()
    finally:
        try:
            _put_back(handlers)
        except BaseException:  # a signal came as one handler was back: the others are back too
            if loop is not None:
                loop.close()
            raise
    try:
        for signum, frame in came[:1]:
            dict(handlers)[signum](signum, frame)
    except BaseException:
        loop.close()
        raise
    return loop


def _put_back(handlers: list[tuple[int, _Handler]]) -> None:
    """Put each handler back, each from a ``finally`` of its own: one that runs as soon as it is back
    (Ctrl-C just then raises KeyboardInterrupt) still leaves every other one back."""
    if handlers:
        (number, handler), rest = handlers[0], handlers[1:]
        try:
            signal.signal(number, handler)
        finally:
            _put_back(rest)
