"""The broker: the storage backends, the cluster member and the asyncio server around the core.

Imports the core and the wire (:mod:`keyfailover.wire`) and nothing further out.
"""
