"""``keyfailover serve``: run a server until SIGTERM or SIGINT, then shut down cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from keyfailover.broker.server import Server, ServerConfig
from keyfailover.integrations.metrics import serve_metrics

__all__ = ["run_server"]


async def run_server(config: ServerConfig) -> int:
    """Serve until a stop signal; prints ``listening on HOST:PORT`` once accepting.

    A broker of a cluster also prints each partition it starts or stops serving, with its owner epoch.
    """
    if config.cluster is not None:
        events = logging.StreamHandler(sys.stderr)
        events.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        ownership = logging.getLogger("keyfailover.ownership")
        ownership.addHandler(events)
        ownership.setLevel(logging.INFO)
    server = Server(config)
    serve_metrics(server)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    host, port = server.address
    print(f"listening on {host}:{port}", flush=True)
    if server.admin_address is not None:
        admin_host, admin_port = server.admin_address
        scheme = "https" if config.tls_cert is not None else "http"
        print(f"metrics on {scheme}://{admin_host}:{admin_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
    print("stopped", file=sys.stderr, flush=True)
    return 0
