"""Ctrl-C never leaves an event loop half-made: keyfailover.core.signals.whole_loop."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from keyfailover.core.loops import new_loop
from keyfailover.core.signals import whole_loop


@pytest.fixture(autouse=True)
def fresh_sigint() -> Iterator[None]:
    """SIGINT's handler as a new interpreter has it, as the command line's is, whatever an earlier test of this
    process put there (a SparkSession puts its own); the one from before again afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_given_to_another_thread_while_a_loop_is_made_comes_after_it() -> None:
    """The kernel gives SIGINT to a thread that does not block it, and Python runs the handler in the main
    thread, mask or not: the loop is made whole first, then closed, then KeyboardInterrupt is raised."""
    made: list[asyncio.AbstractEventLoop] = []

    def interrupted_while_made() -> asyncio.AbstractEventLoop:
        release = threading.Event()
        other = threading.Thread(target=release.wait)  # a live thread that does not block SIGINT
        other.start()
        signal.pthread_kill(other.ident or 0, signal.SIGINT)
        release.set()
        other.join()
        for _ in range(10_000):  # bytecodes, at which Python runs a pending handler in the main thread
            pass
        made.append(new_loop())
        return made[0]

    with pytest.raises(KeyboardInterrupt):
        whole_loop(interrupted_while_made)
    assert len(made) == 1 and made[0].is_closed()


def test_a_loop_made_without_a_signal_is_open() -> None:
    loop = whole_loop()
    try:
        assert not loop.is_closed()
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_as_the_handlers_are_put_back_leaves_them_all_back_and_the_loop_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C right after SIGINT's own handler is back (before SIGTERM's): the interrupt still comes, every
    handler is the one from before and the loop made meanwhile is closed, not left for the collector."""
    made: list[asyncio.AbstractEventLoop] = []

    def recorded() -> asyncio.AbstractEventLoop:
        made.append(new_loop())
        return made[-1]

    put = signal.signal

    def put_then_interrupted(number: int, handler: signal._HANDLER) -> signal._HANDLER:
        before = put(number, handler)
        if number == signal.SIGINT and handler is signal.default_int_handler:
            raise KeyboardInterrupt  # as the default handler would, were Ctrl-C pressed now
        return before

    def terminate(number: int, frame: FrameType | None) -> None:
        """A Python SIGTERM handler, as serve has: one whole_loop puts off too."""

    before = put(signal.SIGTERM, terminate)
    try:
        monkeypatch.setattr(signal, "signal", put_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            whole_loop(recorded)
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is terminate
        assert len(made) == 1 and made[0].is_closed()
    finally:
        put(signal.SIGTERM, before)
