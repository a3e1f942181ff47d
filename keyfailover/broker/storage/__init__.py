"""Storage backends behind one interface (:class:`Store`): the embedded SQLite log, and a
cluster's shared log in PostgreSQL (:mod:`keyfailover.broker.storage.postgresql`)."""

from keyfailover.broker.storage._cache import DEFAULT_ENTRY_CACHE_BYTES, EntryCache
from keyfailover.broker.storage._executor import SQLiteStore
from keyfailover.broker.storage._store import NotServedError, Store, StoreUnavailableError
from keyfailover.broker.storage.records import StoredMessage
from keyfailover.broker.storage.sqlite import LOG_FILE_NAME, Log, LogSnapshot

__all__ = [
    "DEFAULT_ENTRY_CACHE_BYTES",
    "LOG_FILE_NAME",
    "EntryCache",
    "Log",
    "LogSnapshot",
    "NotServedError",
    "SQLiteStore",
    "Store",
    "StoreUnavailableError",
    "StoredMessage",
]
