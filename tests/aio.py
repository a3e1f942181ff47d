"""The tests' own event loops: of the kind the processes they start run on (uvloop by default when installed,
asyncio's with ``KEYFAILOVER_LOOP=asyncio``), made by :func:`keyfailover.core.loops.new_loop` as every loop of
the package is, without an event loop policy (Python 3.14 deprecates them)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from keyfailover.core.loops import new_loop

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop of the chosen kind."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)
