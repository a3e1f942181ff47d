"""A live console in the browser on a server's admin endpoint: ``/ui``, with the JSON its pages poll.

:func:`serve_console` adds it beside ``/metrics``: three static files (no CDN, no build step)
served without the token, and JSON routes under ``/console/`` that keep the token rule.
"""

from keyfailover.integrations.console._sampler import Sampler
from keyfailover.integrations.console._server import serve_console

__all__ = ["Sampler", "serve_console"]
