"""The import path ``keyfailover.broker.protocol``, kept for existing code: see :mod:`keyfailover.wire.protocol`."""

from keyfailover.wire.protocol import *  # noqa: F403
from keyfailover.wire.protocol import __all__ as __all__  # noqa: PLC0414 (re-exported)
