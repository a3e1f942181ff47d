"""The cluster page's JSON: the brokers a cluster broker knows, whether each answers, and who serves what.

Reachability is a short TCP connect to each broker's advertised address, at most one round every
:data:`PROBE_SECONDS` (the pages' polls share the cached answer), each connect given
:data:`CONNECT_SECONDS`: the event loop never waits on a broker for long. The shared log's owner
epochs and subscriptions are read as often, in one query.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from keyfailover.broker.server import Server
from keyfailover.broker.storage.postgresql import PartitionRow
from keyfailover.core.errors import KeyFailoverError

__all__ = ["CONNECT_SECONDS", "PROBE_SECONDS", "ClusterProbe"]

PROBE_SECONDS = 2.0
"""How long a round of connects and the read of the owner epochs are reused."""
CONNECT_SECONDS = 0.5
"""The most one connect to a broker may take before it counts as unreachable."""


async def _answers(address: str) -> bool:
    """Whether a TCP connect to ``HOST:PORT`` succeeds within :data:`CONNECT_SECONDS`."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(CONNECT_SECONDS):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class ClusterProbe:
    """The cluster view of one server, with its cached connects and owner epochs."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._checked = -PROBE_SECONDS
        self._reachable: dict[str, bool] = {}
        self._table: list[PartitionRow] = []
        self._store_error: str | None = None
        self._round: asyncio.Lock = asyncio.Lock()

    async def _refresh(self, addresses: dict[str, str]) -> None:
        """Probe every broker and read the owner epochs, unless a round ended less than :data:`PROBE_SECONDS`
        ago (a concurrent request waits for the round under way)."""
        async with self._round:
            if time.monotonic() - self._checked < PROBE_SECONDS and set(addresses) <= set(self._reachable):
                return
            ids = sorted(addresses)
            answers = await asyncio.gather(*(_answers(addresses[broker]) for broker in ids))
            self._reachable = dict(zip(ids, answers, strict=True))
            broker = self._server.broker
            assert broker is not None
            try:
                self._table = await broker.store.partition_table()
                self._store_error = None
            except KeyFailoverError as exc:  # the store fails over: the epochs are not known now
                self._table, self._store_error = [], str(exc)
            self._checked = time.monotonic()

    async def view(self) -> dict[str, Any]:
        """The cluster page's JSON (``cluster`` false on a single server)."""
        broker = self._server.broker
        if broker is None:
            return {"time": time.time(), "cluster": False}
        if not broker.joined:
            return {"time": time.time(), "cluster": True, "joined": False, "brokers": [], "partitions": []}
        state = broker.member.state
        await self._refresh(state.addresses)
        epochs = {(row.topic, row.partition): row for row in self._table}
        owners = dict(state.assignment.owners)
        counts = {broker_id: 0 for broker_id in state.addresses}
        partitions = []
        for (topic, index), owner in sorted(owners.items()):
            counts[owner] = counts.get(owner, 0) + 1
            row = epochs.get((topic, index))
            partitions.append(
                {
                    "topic": topic,
                    "partition": index,
                    "broker": owner,
                    "owner_epoch": None if row is None else row.owner_epoch,
                    "opened_by": None if row is None else row.owner,
                    "subscriptions": [] if row is None else row.subscriptions,
                }
            )
        brokers = [
            {
                "id": broker_id,
                "address": address,
                "admin": state.admin_addresses.get(broker_id),
                "pulsar": state.pulsar_addresses.get(broker_id),
                "reachable": self._reachable.get(broker_id, False),
                "partitions": counts.get(broker_id, 0),
            }
            for broker_id, address in sorted(state.addresses.items())
        ]
        return {
            "time": time.time(),
            "cluster": True,
            "joined": True,
            "broker": state.broker_id,
            "coordinator": state.coordinator_id,
            "epoch": state.applied[0],
            "generation": state.applied[1],
            "brokers": brokers,
            "partitions": partitions,
            "store_error": self._store_error,
        }
