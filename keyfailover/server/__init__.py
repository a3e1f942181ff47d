"""The Key_Failover server: an embedded durable log and the dispatcher core behind asyncio TCP."""

from keyfailover.server._main import run_server
from keyfailover.server._server import Server, ServerConfig
from keyfailover.server._subscription import SubscriptionConfig

__all__ = ["Server", "ServerConfig", "SubscriptionConfig", "run_server"]
