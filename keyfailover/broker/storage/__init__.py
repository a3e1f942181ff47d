"""Storage backends behind one interface: the embedded SQLite log, run on a worker thread."""

from keyfailover.broker.storage._executor import Storage
from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, Log, LogSnapshot, StoredMessage

__all__ = ["LOG_FILE_NAME", "Log", "LogSnapshot", "Storage", "StoredMessage"]
