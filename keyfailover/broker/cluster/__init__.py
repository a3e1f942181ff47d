"""Level 1 of scheduling in ZooKeeper: broker membership, the elected coordinator, the fenced
assignment of partitions to brokers, and the barrier a broker holds on each partition it serves.

See :class:`ClusterMember`; the assignment itself is :mod:`keyfailover.core.partitions`.
"""

from keyfailover.broker.cluster._member import (
    LEASE_SHARE,
    UNSAFE_NO_LEASE,
    ClusterMember,
    ClusterState,
    cluster_status,
    connect,
    create_topic,
    parse_cluster_url,
)

__all__ = [
    "LEASE_SHARE",
    "UNSAFE_NO_LEASE",
    "ClusterMember",
    "ClusterState",
    "cluster_status",
    "connect",
    "create_topic",
    "parse_cluster_url",
]
