"""The Key_Failover server: an embedded durable log and the dispatcher core behind asyncio TCP."""

from keyfailover.broker.server._admin import union_snapshot
from keyfailover.broker.server._http import Handler, Response, json_response
from keyfailover.broker.server._server import Server, ServerConfig
from keyfailover.broker.server._subscription import SubscriptionConfig

__all__ = ["Handler", "Response", "Server", "ServerConfig", "SubscriptionConfig", "json_response", "union_snapshot"]
