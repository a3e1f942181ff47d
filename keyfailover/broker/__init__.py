"""The broker: the wire protocol, the storage backends and the asyncio server around the core.

Imports the core and nothing further out. ``keyfailover.broker.protocol`` is shared with the
clients; importing it does not load the server.
"""
