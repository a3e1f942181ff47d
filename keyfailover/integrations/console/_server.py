"""``/ui`` and the console's JSON routes on a server's admin endpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache
from importlib import resources

from keyfailover.broker.server import Response, Server, json_response
from keyfailover.integrations.console._cluster import ClusterProbe
from keyfailover.integrations.console._sampler import Sampler
from keyfailover.integrations.console._views import dead_letter_view, overview, subscription_view

__all__ = ["FRESH_SECONDS", "STATIC_FILES", "serve_console"]

FRESH_SECONDS = 1.0
"""How long one answer of the overview or of a subscription's view serves every page that asks: a view
reads each dispatcher's keys, so ten pages polling once a second cost the server what one does, and what
they show is at most this much older than a poll."""

STATIC_FILES = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/": ("index.html", "text/html; charset=utf-8"),
    "/ui/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/ui/console.css": ("console.css", "text/css; charset=utf-8"),
}
"""Each static path of the console: its file in the package's ``static`` folder and its content type."""


class _Fresh:
    """Answers of the dispatcher views by route and subscription, each reused for :data:`FRESH_SECONDS`."""

    def __init__(self) -> None:
        self._answers: dict[tuple[str, ...], tuple[float, Response]] = {}

    def answer(self, key: tuple[str, ...], compute: Callable[[], Response]) -> Response:
        """The answer kept for ``key`` while fresh, else ``compute()``'s, kept when it is a 200. Stale answers
        are dropped at each new one: what is kept is bounded by the live subscriptions."""
        now = time.monotonic()
        kept = self._answers.get(key)
        if kept is not None and now - kept[0] < FRESH_SECONDS:
            return kept[1]
        response = compute()
        if response[0] == 200:
            self._answers = {k: v for k, v in self._answers.items() if now - v[0] < FRESH_SECONDS}
            self._answers[key] = (now, response)
        return response


@cache
def _static(name: str) -> bytes:
    """A static file's bytes, read once from the package."""
    return resources.files(__package__).joinpath("static", name).read_bytes()


def serve_console(server: Server) -> Sampler:
    """Add the console to ``server``'s admin endpoint: ``GET /ui`` and its two assets without the token, and
    ``/console/overview``, ``/console/subscription``, ``/console/dlq`` and ``/console/cluster`` with it.
    A sampler keeps each live subscription's backlog and delivery latency for the last minutes while the
    endpoint serves. Call before ``server.start()``; returns the sampler."""
    for path, (name, content_type) in STATIC_FILES.items():

        async def static(_query: dict[str, str], name: str = name, content_type: str = content_type) -> Response:
            return 200, content_type, _static(name)

        server.add_admin_route(path, static, without_token=True)

    fresh = _Fresh()

    async def overview_route(_query: dict[str, str]) -> Response:
        return fresh.answer(("overview",), lambda: json_response(overview(server)))

    def subscription_answer(topic: str, name: str) -> Response:
        view = subscription_view(server, topic, name, sampler.series(server.partition_of(topic)[0], name))
        if view is None:
            return json_response({"error": f"no live subscription {name!r} of topic {topic!r} on this server"}, 404)
        return json_response(view)

    async def subscription_route(query: dict[str, str]) -> Response:
        topic, name = query.get("topic"), query.get("subscription")
        if not topic or not name:
            return json_response({"error": "give topic and subscription"}, 400)
        return fresh.answer(("subscription", topic, name), lambda: subscription_answer(topic, name))

    async def dead_letter_route(_query: dict[str, str]) -> Response:
        return json_response(await dead_letter_view(server))

    probe = ClusterProbe(server)
    sampler = Sampler(server)
    server.add_admin_task(sampler.run)

    async def cluster_route(_query: dict[str, str]) -> Response:
        return json_response(await probe.view())

    server.add_admin_route("/console/overview", overview_route)
    server.add_admin_route("/console/cluster", cluster_route)
    server.add_admin_route("/console/dlq", dead_letter_route)
    server.add_admin_route("/console/subscription", subscription_route)
    return sampler
