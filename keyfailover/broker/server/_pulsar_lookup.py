"""Where a Pulsar client finds a topic: PARTITIONED_METADATA and LOOKUP, answered from the server's routes,
and GET_TOPICS_OF_NAMESPACE, which a pattern consumer asks to learn its topics.

A single server serves every topic itself, so LOOKUP answers Connect; a broker of a cluster sends the
client to the Pulsar endpoint of the broker serving the topic or partition: Redirect. Both answers are
authoritative.
"""

from __future__ import annotations

from keyfailover.broker.pulsar import TopicNameError, keyfailover_topic, pulsar_topic
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    BaseCommand,
    CommandGetTopicsOfNamespace,
    CommandLookupTopic,
    CommandLookupTopicResponse,
    CommandPartitionedTopicMetadata,
    CommandPartitionedTopicMetadataResponse,
    NotAllowedError,
    ServerError,
    ServiceNotReady,
)
from keyfailover.broker.server._connection import ConnectionHost
from keyfailover.core.errors import KeyFailoverError
from keyfailover.core.partitions import split_partition_topic

__all__ = ["lookup", "partitioned_metadata", "topics_of_namespace"]


async def partitioned_metadata(server: ConnectionHost, request: CommandPartitionedTopicMetadata) -> BaseCommand:
    """The PARTITIONED_METADATA_RESPONSE to ``request``: how many partitions the topic has, 0 for none."""
    reply = BaseCommand(type=BaseCommand.PARTITIONED_METADATA_RESPONSE)
    answer = reply.partitionMetadataResponse
    answer.request_id = request.request_id
    try:
        served = keyfailover_topic(request.topic)
        count = 1 if await _partition_of(server, served) is not None else len(await server.route(served))
    except KeyFailoverError as exc:
        answer.response = CommandPartitionedTopicMetadataResponse.Failed
        answer.error, answer.message = _failure(exc, "the topic's partitions cannot be read")
    else:
        answer.response = CommandPartitionedTopicMetadataResponse.Success
        answer.partitions = count if count > 1 else 0  # Pulsar's 0: a topic without partitions
    return reply


async def lookup(server: ConnectionHost, request: CommandLookupTopic, here: tuple[str, int]) -> BaseCommand:
    """The LOOKUP_RESPONSE to ``request``: Connect to ``here``, the address the client reached, when this
    broker serves the topic, as a single server serves all; else Redirect to the Pulsar endpoint of the
    cluster's broker that does. A lookup naming an advertised listener fails: there are none."""
    reply = BaseCommand(type=BaseCommand.LOOKUP_RESPONSE)
    answer = reply.lookupTopicResponse
    answer.request_id = request.request_id
    listener = request.advertised_listener_name
    if listener:
        # Pulsar's advertisedListeners: keyfailover has one address per broker. Answered with a final error,
        # not ignored: the client would otherwise connect to an address that is not the one it asked for.
        answer.response = CommandLookupTopicResponse.Failed
        answer.error = NotAllowedError
        answer.message = (
            f"keyfailover has no advertised listener {listener!r:.80}: each broker has one Pulsar endpoint; "
            "expected a client without listener_name"
        )
        return reply
    try:
        owner = await _owner(server, keyfailover_topic(request.topic))
    except KeyFailoverError as exc:
        answer.response = CommandLookupTopicResponse.Failed
        answer.error, answer.message = _failure(exc, "the topic's broker cannot be looked up")
    else:
        if owner is None:
            answer.response = CommandLookupTopicResponse.Failed
            answer.error = ServiceNotReady
            answer.message = f"no broker with a Pulsar endpoint serves {request.topic} now; try again"
        else:
            if owner in ("", server.pulsar_advertised):
                host, port = here
                answer.response = CommandLookupTopicResponse.Connect
            else:
                host, _, found = owner.rpartition(":")
                host, port = host.strip("[]"), int(found)
                answer.response = CommandLookupTopicResponse.Redirect
            # A TLS client takes brokerServiceUrlTls; the brokers of a cluster share one TLS setting.
            answer.brokerServiceUrl = _pulsar_url("pulsar", host, port)
            if server.pulsar_tls:
                answer.brokerServiceUrlTls = _pulsar_url("pulsar+ssl", host, port)
        answer.authoritative = True
    return reply


async def topics_of_namespace(server: ConnectionHost, request: CommandGetTopicsOfNamespace) -> BaseCommand:
    """The GET_TOPICS_OF_NAMESPACE_RESPONSE to ``request``: the Pulsar names of the namespace's topics, each
    partition of a topic created with several by its own name, as Pulsar lists them; none for the
    non-persistent ones, which keyfailover does not have. Not filtered by the request's pattern: the client
    applies its own (Java's regular expressions are not Python's), and no ``topics_hash``: the list is
    always sent whole."""
    reply = BaseCommand(type=BaseCommand.GET_TOPICS_OF_NAMESPACE_RESPONSE)
    answer = reply.getTopicsOfNamespaceResponse
    answer.request_id = request.request_id
    if request.mode != CommandGetTopicsOfNamespace.NON_PERSISTENT:
        prefix = f"persistent://{request.namespace}/"
        for topic in await server.topic_names():
            name = pulsar_topic(topic)
            if name is not None and name.startswith(prefix) and "/" not in name[len(prefix) :]:
                answer.topics.append(name)
    return reply


def _failure(exc: KeyFailoverError, what: str) -> tuple[ServerError.ValueType, str]:
    """The ServerError and message of a lookup that failed with ``exc``: a bad topic name, or ``what``
    cannot be done now."""
    if isinstance(exc, TopicNameError):  # final for the client, as InvalidTopicName is not: see server_error
        return NotAllowedError, str(exc)
    return ServiceNotReady, f"{what} now: {exc}"


async def _owner(server: ConnectionHost, served: str) -> str | None:
    """The Pulsar endpoint serving ``served``, a topic or partition ``T-partition-p``: ``""`` this
    broker as a single server, a cluster broker's ``HOST:PORT``, or None when none serves it now."""
    partition = await _partition_of(server, served)
    if partition is not None:
        return (await server.route(partition[0], pulsar=True))[partition[1]]
    return (await server.route(served, pulsar=True))[0]


async def _partition_of(server: ConnectionHost, served: str) -> tuple[str, int] | None:
    """``(topic, index)`` when ``served`` names partition ``index`` of a topic created with more
    partitions, else None: it is a topic of its own, and looking it up creates nothing else."""
    split = split_partition_topic(served)
    if split is None:
        return None
    count = await server.partition_count(split[0])
    return split if count is not None and split[1] < count else None


def _pulsar_url(scheme: str, host: str, port: int) -> str:
    """The service URL of a Pulsar endpoint: ``scheme://host:port``, an IPv6 host in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
