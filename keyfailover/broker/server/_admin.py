"""The admin HTTP API: what the admin endpoint's routes answer, about the server's subscriptions and topics.

:class:`AdminApi` holds the handlers of ``/healthz``, ``/ranges``, ``/stats``, ``/history``, ``/dlq``,
``/dlq/replay``, ``/dlq/purge``, ``/topics``, ``/subscription-settings`` and ``/consume-mode``; the server
serves its routes on the admin endpoint (``--metrics-port``) beside the ones added with
:meth:`Server.add_admin_route`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from keyfailover.broker.server._connection import ServerView
from keyfailover.broker.server._http import Handler, Response, json_response
from keyfailover.broker.server._subscription import OwnSettings, Subscription, SubscriptionConfig
from keyfailover.broker.storage.records import DeadLetterRecord, dead_letter_topic
from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.core.errors import ConfigError, KeyFailoverError, RangeMapError
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.core.ranges import Range, RangeMap
from keyfailover.wire.properties import decode_properties

__all__ = ["AdminApi", "AdminHost", "union_snapshot"]


class _Settings(Protocol):
    """The server settings the admin API reads."""

    @property
    def subscription(self) -> SubscriptionConfig: ...


class AdminHost(ServerView, Protocol):
    """What the admin API needs of its server."""

    @property
    def config(self) -> _Settings: ...

    @property
    def connection_count(self) -> int: ...

    @property
    def settings_lock(self) -> asyncio.Lock: ...

    def live(self, topic: str, name: str) -> list[Subscription]: ...

    def partitions(self) -> dict[str, int]: ...

    def partition_names(self, topic: str) -> list[str]: ...

    async def create_topic(self, topic: str, partitions: int) -> bool: ...

    async def own_settings(self, topic: str, name: str) -> OwnSettings: ...


class AdminApi:
    """The admin endpoint's handlers for one server: :attr:`routes` for GET, :attr:`post_routes` for POST."""

    def __init__(self, server: AdminHost) -> None:
        self._server = server
        self.routes: dict[str, Handler] = {
            "/healthz": self._healthz,
            "/ranges": self._ranges,
            "/stats": self._stats,
            "/history": self._history,
            "/dlq": self._dead_letters,
            "/subscription-settings": self._subscription_settings,
            "/topics": self._list_topics,
        }
        self.post_routes: dict[str, Handler] = {
            "/dlq/replay": self._replay_dead_letters,
            "/dlq/purge": self._purge_dead_letters,
            "/consume-mode": self._set_consume_mode,
            "/subscription-settings": self._configure_subscription,
            "/topics": self._create_topic,
        }

    async def _history(self, query: dict[str, str]) -> Response:
        """``/history?topic=T&subscription=S``: the recent range maps with their wall-clock times, and the
        reason of each change (join, leave, shift, timeout, stuck, recovered, backlog) and the consumer it
        was about, None for a shift or a change older than the dispatcher's own history.

        A partitioned subscription's maps are the union of its partitions' at each change of one
        (only the ones that tile the slot space: every partition had consumers).
        """
        topic, name = query.get("topic", ""), query.get("subscription", "")
        live = self._server.live(self._server.partition_of(topic)[0], name) if topic and name else []
        if not live:
            return json_response({"error": "give the topic and subscription of a live subscription"}, 404)
        changes = sorted(
            (at, index, epoch, ranges)
            for index, subscription in enumerate(live)
            for at, epoch, ranges in subscription.history()
        )
        causes = [{e.epoch: (e.reason, e.consumer) for e in s.dispatcher.rebalances()} for s in live]
        now: dict[int, tuple[int, list[Range]]] = {}
        history = []
        for at, index, epoch, ranges in changes:
            now[index] = (epoch, ranges)
            union = _union_map(list(now.values())) if len(now) == len(live) else None
            if union is not None:  # None: a partition without consumers, no whole map
                reason, consumer = causes[index].get(epoch, (None, None))  # None: older than the core's history
                history.append({"time": at, "snapshot": union, "reason": reason, "consumer": consumer})
        return json_response({"topic": topic, "subscription": name, "history": history})

    async def _dead_letters(self, query: dict[str, str]) -> Response:
        """``/dlq?topic=T&subscription=S[&limit=N]``: the subscription's dead letters, oldest first."""
        topic, name = query.get("topic"), query.get("subscription")
        limit_text = query.get("limit", "1000")
        if not topic or not name or not limit_text.isdigit():
            return json_response({"error": "give topic and subscription (and a limit of digits, default 1000)"}, 400)
        limit = int(limit_text)
        records: list[tuple[int, DeadLetterRecord]] = []
        partitions = self._server.partition_names(topic)  # a partitioned topic's partitions, else the topic itself
        for served in partitions:
            found = await self._server.storage.dead_letters(served, name, limit - len(records))
            records += [(self._server.partition_of(served)[1], r) for r in found]
        return json_response(
            {
                "topic": topic,
                "subscription": name,
                "dlq_topic": dead_letter_topic(topic, name) if len(partitions) == 1 else None,
                "dead_letters": [
                    {
                        "partition": index,
                        "dlq_position": r.dlq_position,
                        "position": r.position,
                        "key": r.key if not isinstance(r.key, bytes) else {"bytes": r.key.hex()},
                        "payload_bytes": len(r.payload),
                        "redelivery_count": r.redelivery_count,
                        "reason": r.reason,
                        "time": r.time,
                        "replayed_at": r.replayed_at,
                        "publish_time": r.publish_time,
                        "properties": decode_properties(r.properties),
                    }
                    for index, r in records
                ],
            }
        )

    async def _set_consume_mode(self, query: dict[str, str]) -> Response:
        """``POST /consume-mode?topic=T&subscription=S&mode=ordered|unordered``: switch live and save."""
        topic, name, mode = query.get("topic"), query.get("subscription"), query.get("mode")
        if not topic or not name or mode not in ("ordered", "unordered"):
            return json_response({"error": "give topic, subscription and mode=ordered or mode=unordered"}, 400)
        try:
            topic, _, live = await self._settings_of(query)
        except _RefusedError as refused:
            return refused.response
        before = live[0].dispatcher.consume_mode if live else None
        await self._server.storage.save_consume_mode(topic, name, mode)
        for subscription in live:
            await subscription.set_consume_mode(mode)
        return json_response({"topic": topic, "subscription": name, "consume_mode": mode, "was": before})

    async def _settings_of(self, query: dict[str, str]) -> tuple[str, str, list[Subscription]]:
        """The subscription ``query`` names (of a topic, or of the topic of a partition named) and its
        live partitions (none when it is only stored); raises :class:`_RefusedError` if there is none."""
        topic, name = query.get("topic"), query.get("subscription")
        if not topic or not name:
            raise _RefusedError(400, "give topic and subscription")
        topic = self._server.partition_of(topic)[0]
        live = self._server.live(topic, name)
        if not live and not any(
            [name in await self._server.storage.subscriptions(p) for p in self._server.partition_names(topic)]
        ):
            raise _RefusedError(404, f"no subscription {name!r} of topic {topic!r}")
        return topic, name, live

    async def _subscription_settings(self, query: dict[str, str]) -> Response:
        """``/subscription-settings?topic=T&subscription=S``: the delivery settings in force, and which are its own."""
        try:
            topic, name, live = await self._settings_of(query)
        except _RefusedError as refused:
            return refused.response
        own = live[0].own_settings if live else await self._server.own_settings(topic, name)
        settings = self._server.config.subscription.delivery.with_overrides(own).own_view()
        return json_response(
            {"topic": topic, "subscription": name, "settings": settings, "own": sorted(own), "live": bool(live)}
        )

    async def _configure_subscription(self, query: dict[str, str]) -> Response:
        """``POST /subscription-settings?topic=T&subscription=S[&reset=1][&ack_timeout=SECONDS]...``.

        Each of ack_timeout, max_redeliveries (``none``: never), nack_backoff, nack_backoff_max
        and max_replay given becomes the subscription's own (``default``: the server's
        again); ``reset=1`` drops every own setting first. Live and saved at once.
        """
        names = DeliverySettings.own_names()
        unknown = sorted(set(query) - {"topic", "subscription", "reset", *names})
        if unknown or query.get("reset", "1") != "1":
            expected = f"expected settings of {list(names)} and reset=1"
            return json_response({"error": f"unknown parameters {unknown} or reset not 1; {expected}"}, 400)
        async with self._server.settings_lock:  # one change at a time, and none while the subscription opens
            return await self._configure_locked(query)

    async def _configure_locked(self, query: dict[str, str]) -> Response:
        """The body of :meth:`_configure_subscription`, holding the settings lock."""
        try:
            topic, name, _ = await self._settings_of(query)
        except _RefusedError as refused:
            return refused.response
        own: OwnSettings = {} if "reset" in query else dict(await self._server.own_settings(topic, name))
        try:
            for setting in DeliverySettings.own_names():
                text = query.get(setting)
                if text is None:
                    continue
                if text == "default":
                    own.pop(setting, None)
                else:
                    own[setting] = _setting_value(setting, text)
            settings = self._server.config.subscription.delivery.with_overrides(own).own_view()
        except ConfigError as exc:
            return json_response({"error": str(exc)}, 400)
        await self._server.storage.save_delivery_settings(topic, name, own)
        live = self._server.live(topic, name)  # looked up after the save: a partition may have opened meanwhile
        for subscription in live:
            subscription.configure(own)
        return json_response(
            {"topic": topic, "subscription": name, "settings": settings, "own": sorted(own), "live": bool(live)}
        )

    async def _replay_dead_letters(self, query: dict[str, str]) -> Response:
        """``POST /dlq/replay?topic=T&subscription=S``: re-publish the dead letters not replayed yet to T."""
        topic, name = query.get("topic"), query.get("subscription")
        if not topic or not name:
            return json_response({"error": "give topic and subscription"}, 400)
        served = self._server.partition_names(topic)
        positions: dict[str, list[int]] = {}
        for partition in served:
            if self._server.storage.serves(partition):
                positions[partition] = [
                    m.position for m in await self._server.storage.replay_dead_letters(partition, name)
                ]
        replayed = sum(map(len, positions.values()))
        return json_response(
            {
                "topic": topic,
                "subscription": name,
                "replayed": replayed,
                "positions": positions.get(topic, []) if len(served) == 1 else [],
                "by_partition": positions,
                "not_served_here": [p for p in served if p not in positions],
            }
        )

    async def _purge_dead_letters(self, query: dict[str, str]) -> Response:
        """``POST /dlq/purge?topic=T&subscription=S``: delete the subscription's dead-letter records, replayed or
        not, in the partitions served here. The messages stay in the dead-letter topic for its readers.

        Refused, with nothing deleted, without both names (400), for a subscription that is neither known nor
        holds dead letters (404), or on a broker that serves none of the topic's partitions (409).
        """
        topic, name = query.get("topic"), query.get("subscription")
        if not topic or not name:
            return json_response({"error": "give topic and subscription"}, 400)
        topic = self._server.partition_of(topic)[0]
        storage = self._server.storage
        served = self._server.partition_names(topic)
        here = [partition for partition in served if storage.serves(partition)]
        if not here:
            error = f"this broker serves no partition of {topic!r}; expected the broker that serves them"
            return json_response({"error": error}, 409)
        known = bool(self._server.live(topic, name))
        for partition in here:
            if known:
                break
            known = name in await storage.subscriptions(partition) or bool(
                await storage.dead_letters(partition, name, 1)
            )
        if not known:
            error = f"no subscription {name!r} of topic {topic!r} and no dead letters of one; nothing purged"
            return json_response({"error": error}, 404)
        purged = {partition: await storage.purge_dead_letters(partition, name) for partition in here}
        return json_response(
            {
                "topic": topic,
                "subscription": name,
                "purged": sum(purged.values()),
                "by_partition": purged,
                "not_served_here": [p for p in served if p not in purged],
            }
        )

    async def _list_topics(self, _query: dict[str, str]) -> Response:
        """``/topics``: every topic created with partitions, and those this broker serves that hold messages."""
        return json_response({"partitioned": self._server.partitions(), "served": self._server.storage.topics()})

    async def _create_topic(self, query: dict[str, str]) -> Response:
        """``POST /topics?topic=T&partitions=P``: create T with P partitions (a topic's count is fixed)."""
        topic, text = query.get("topic"), query.get("partitions", "1")
        if not topic or not text.isdigit():
            return json_response({"error": "give topic and partitions (a number from 1 to 65536, default 1)"}, 400)
        try:
            created = await self._server.create_topic(topic, int(text))
        except KeyFailoverError as exc:
            return json_response({"error": str(exc)}, 409 if "exists" in str(exc) or "holds" in str(exc) else 400)
        return json_response({"topic": topic, "partitions": int(text), "created": created})

    async def _healthz(self, _query: dict[str, str]) -> Response:
        return json_response(
            {"status": "shutting down" if self._server.closing else "ok"}, 503 if self._server.closing else 200
        )

    async def _ranges(self, query: dict[str, str]) -> Response:
        """``/ranges``: every subscription's range map; with topic and subscription, that snapshot alone."""
        topic, name = query.get("topic"), query.get("subscription")
        if topic is None and name is None:
            named = sorted({(s.settings_topic, s.name) for s in self._server.subscriptions().values()})
            counts = self._server.partitions()
            listing = [
                {
                    "topic": t,
                    "subscription": n,
                    "consume_mode": live[0].dispatcher.consume_mode,
                    "partitions": counts.get(t, 1),
                    "ranges": union_snapshot(live),
                }
                for t, n in named
                if (live := self._server.live(t, n))
            ]
            return json_response({"subscriptions": listing})
        if topic is None or name is None:
            return json_response({"error": "give both topic and subscription, or neither"}, 400)
        live = self._server.live(self._server.partition_of(topic)[0], name)
        if not live:
            return json_response({"error": f"no live subscription {name!r} of topic {topic!r}"}, 404)
        return json_response(union_snapshot(live))

    async def _stats(self, _query: dict[str, str]) -> Response:
        """``/stats``: per subscription, the dispatcher's per-consumer stats, cursor and backlog."""
        return json_response(
            {
                "connections": self._server.connection_count,
                "topics": {topic: self._server.storage.last_position(topic) for topic in self._server.storage.topics()},
                "subscriptions": [s.describe() for _, s in sorted(self._server.subscriptions().items())],
            }
        )


def union_snapshot(live: list[Subscription]) -> dict[str, Any]:
    """One range map snapshot of a subscription over all its partitions (their maps side by side).

    When every partition has consumers their ranges tile the slot space; a partition without
    any leaves its block out (the map does not tile then).
    """
    parts = [(subscription.dispatcher.epoch, subscription.dispatcher.ranges()) for subscription in live]
    union = _union_map(parts)
    if union is not None:
        return union
    snapshot = RangeMap(HASH_RANGE_SIZE, sum(epoch for epoch, _ in parts)).snapshot()
    ranges = sorted(r for _, held in parts for r in held)
    snapshot["ranges"] = [{"start": start, "end": end, "consumer": consumer} for start, end, consumer in ranges]
    return snapshot


def _union_map(parts: list[tuple[int, list[Range]]]) -> dict[str, Any] | None:
    """The snapshot of the map that partitions' ``(epoch, ranges)`` make side by side (its epoch their
    sum), or None when they do not tile the slot space."""
    ranges = sorted(r for _, held in parts for r in held)
    try:
        return RangeMap.from_ranges(ranges, HASH_RANGE_SIZE, sum(epoch for epoch, _ in parts)).snapshot()
    except RangeMapError:
        return None


def _setting_value(setting: str, text: str) -> float | int | None:
    """A delivery setting's value from an admin query, read as its field of :class:`DeliverySettings` is typed:
    digits for an int, a number for a float, ``none`` for a setting that may be None. Its range is checked
    by :meth:`DeliverySettings.with_overrides`."""
    number, optional = DeliverySettings.value_type(setting)
    if optional and text == "none":
        return None
    if number is int and text.isdigit():
        return int(text)
    if number is float:
        with contextlib.suppress(ValueError):
            return float(text)
    what = DeliverySettings.metadata(setting)["what"]
    raise ConfigError(f"{setting} must be {what}{', none' if optional else ''} or default, not {text!r}")


class _RefusedError(Exception):
    """An admin request that names nothing to act on: its error response."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.response = json_response({"error": error}, status)
