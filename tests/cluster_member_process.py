"""A cluster member in a process of its own, for fault tests: ``python tests/cluster_member_process.py
HOSTS ROOT BROKER_ID SESSION_TIMEOUT``. Prints one JSON line per event on stdout:
``{"event": "acquired" | "released", "partition": [topic, index], "time": monotonic seconds}``,
and ``{"event": "ready"}`` once started; runs until stdin closes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from keyfailover.broker.cluster import ClusterMember
from keyfailover.core.partitions import PartitionId


def main() -> None:
    hosts, root, broker, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

    def note(event: str) -> Callable[[PartitionId], None]:
        def record(partition: PartitionId) -> None:
            print(json.dumps({"event": event, "partition": list(partition), "time": time.monotonic()}), flush=True)

        return record

    member = ClusterMember(
        hosts, root, broker, "127.0.0.1:0", session_timeout=timeout,
        on_acquired=note("acquired"), on_released=note("released"),
    )  # fmt: skip
    with member:
        print(json.dumps({"event": "ready"}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
