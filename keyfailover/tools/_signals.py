"""SIGTERM as Ctrl-C for the tools that start processes of their own (the cluster demo, chaos runs), and
event loops made whole whatever signal comes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["sigterm_interrupts", "whole_loop"]


def whole_loop() -> asyncio.AbstractEventLoop:
    """A new event loop, made with Ctrl-C and SIGTERM held off (one interrupted half-made would be collected
    with an error printed); one that came meanwhile is handled as it returns."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        return asyncio.new_event_loop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt as Ctrl-C does, so that a tool stops what it started (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
