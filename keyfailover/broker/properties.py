"""The import path ``keyfailover.broker.properties``, kept for existing code: see :mod:`keyfailover.wire.properties`."""

from keyfailover.wire.properties import *  # noqa: F403
from keyfailover.wire.properties import __all__ as __all__  # noqa: PLC0414 (re-exported)
