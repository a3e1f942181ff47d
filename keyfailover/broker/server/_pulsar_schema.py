"""The Pulsar endpoint's schema registry: a topic's schema versions in the log, as Apache Pulsar's broker keeps them.

Each topic has schema versions 0, 1, 2, ... (its partitions share the topic's), in the server's store
(:meth:`Store.schemas`). A PRODUCER with a schema gets the version of the same schema when the topic has one
(any version), else its schema is added as the next version if it is compatible with the latest one
(:mod:`keyfailover.broker.pulsar._schemas`: Pulsar's default strategy, FULL), else it is refused with
``IncompatibleSchema``; PRODUCER_SUCCESS carries the version. A producer without a schema is taken on any
topic, as Pulsar takes it while ``schemaValidationEnforced`` is off (its default). A SUBSCRIBE with a schema
registers it on an idle topic without one (no schema, no message, no producer, no consumer), else its schema
must read what the latest version wrote (Pulsar's ``addSchemaIfIdleOrCheckCompatible``). GET_SCHEMA answers
a version (the latest by default) or ``TopicNotFound`` in its own response, as Pulsar does, so that a client
matches the answer to its request; GET_OR_CREATE_SCHEMA adds a schema as a producer's is added.
"""

from __future__ import annotations

from typing import Final

from keyfailover.broker.pulsar import keyfailover_topic
from keyfailover.broker.pulsar._schemas import (
    SchemaData,
    check_data,
    compatibility_problem,
    same_schema,
    type_name,
    version_bytes,
    version_of,
)
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    BaseCommand,
    CommandGetOrCreateSchema,
    CommandGetSchema,
    CommandProducer,
    CommandSubscribe,
    IncompatibleSchema,
    Schema,
    ServiceNotReady,
    TopicNotFound,
    UnknownError,
)
from keyfailover.broker.server._connection import ConnectionHost
from keyfailover.broker.server._pulsar_errors import RefusedError, server_error
from keyfailover.broker.storage.records import SchemaRecord
from keyfailover.core.errors import KeyFailoverError

__all__ = ["consumer_schema", "get_or_create_schema", "get_schema", "producer_schema"]

_NONE: Final = Schema.Type.Value("None")
"""The schema type NONE (``Schema.None`` is no Python name)."""
_ADD_TRIES: Final = 5
"""Times a schema is checked and added again when another broker or connection added a version meanwhile."""


def _topic(server: ConnectionHost, served: str) -> str:
    """The topic whose schema ``served`` has: a partition has its topic's."""
    return server.partition_of(served)[0]


def _data(schema: Schema) -> SchemaData:
    """What the rules read of a schema in a command."""
    return SchemaData(schema.type, schema.schema_data, _properties(schema))


def _properties(schema: Schema) -> tuple[tuple[str, str], ...]:
    """A schema's properties, sorted by key (a later pair of a key wins)."""
    return tuple(sorted({pair.key: pair.value for pair in schema.properties}.items()))


def _stored(record: SchemaRecord) -> SchemaData:
    """What the rules read of a stored schema version."""
    return SchemaData(record.kind, record.data, record.properties)


async def _add(server: ConnectionHost, topic: str, schema: Schema) -> int:
    """The version of ``schema`` in ``topic``'s registry: the same schema's, else the new version it is added as
    when compatible with the latest; :class:`RefusedError` ``IncompatibleSchema`` else, storing nothing."""
    data = _data(schema)
    problem = check_data(data)
    if problem is not None:
        raise RefusedError(IncompatibleSchema, problem)
    for _ in range(_ADD_TRIES):
        known = await server.storage.schemas(topic)
        for record in known:
            if same_schema(_stored(record), data):
                return record.version
        if known:
            latest = known[-1]
            problem = compatibility_problem(_stored(latest), data)
            if problem is not None:
                raise RefusedError(IncompatibleSchema, f"{problem} (topic {topic!r}, latest version {latest.version})")
        added = SchemaRecord(len(known), schema.type, schema.name, schema.schema_data, data.properties)
        if await server.storage.add_schema(topic, added):
            return added.version
    raise RefusedError(
        ServiceNotReady, f"the schema of topic {topic!r} changed {_ADD_TRIES} times while this one was added; try again"
    )


async def producer_schema(server: ConnectionHost, served: str, request: CommandProducer) -> bytes | None:
    """The schema version a PRODUCER of ``served`` is answered with (None: it has no schema); raises
    :class:`RefusedError` for an incompatible schema."""
    if not request.HasField("schema"):
        return None
    return version_bytes(await _add(server, _topic(server, served), request.schema))


def _idle(server: ConnectionHost, served: str) -> bool:
    """Whether ``served`` holds no message and has no Pulsar producer and no consumer."""
    if server.storage.last_position(served) > 0 or server.pulsar_producers.get(served):
        return False
    return not any(
        subscription.sessions for (topic, _), subscription in server.subscriptions().items() if topic == served
    )


async def consumer_schema(server: ConnectionHost, served: str, request: CommandSubscribe) -> None:
    """Check the schema a SUBSCRIBE to ``served`` brings, as Pulsar does for the FULL strategy: on a topic
    without a schema it is added if the topic is idle, else refused; on a topic with one it must read what the
    latest version wrote (BACKWARD). An AUTO_CONSUME schema reads whatever comes. Raises :class:`RefusedError`."""
    if not request.HasField("schema") or request.schema.type == Schema.AutoConsume:
        return
    topic = _topic(server, served)
    known = await server.storage.schemas(topic)
    if not known:
        if _idle(server, served):
            await _add(server, topic, request.schema)
            return
        raise RefusedError(
            IncompatibleSchema,
            "Failed to add schema to an active topic with empty(BYTES) schema: new schema type "
            f"{type_name(request.schema.type)} (topic {topic!r} has messages, producers or consumers and no schema)",
        )
    latest = known[-1]
    problem = compatibility_problem(_stored(latest), _data(request.schema), "BACKWARD")
    if problem is not None:
        raise RefusedError(IncompatibleSchema, f"{problem} (topic {topic!r}, latest version {latest.version})")


def _pulsar_name(topic: str) -> str:
    """The name Pulsar gives ``topic``'s schema: ``TENANT/NAMESPACE/NAME``."""
    return topic if "/" in topic else f"public/default/{topic}"


async def get_schema(server: ConnectionHost, request: CommandGetSchema) -> BaseCommand:
    """The GET_SCHEMA_RESPONSE to a GET_SCHEMA: the version asked for, or the latest; ``TopicNotFound`` when
    there is none, and any other refusal too, in its ``error_code``."""
    reply = BaseCommand(type=BaseCommand.GET_SCHEMA_RESPONSE)
    answer = reply.getSchemaResponse
    answer.request_id = request.request_id
    try:
        topic = _topic(server, keyfailover_topic(request.topic))
        version = None
        if request.HasField("schema_version"):
            version = version_of(request.schema_version)
            if version is None:
                raise RefusedError(
                    UnknownError,
                    f"schema version of {len(request.schema_version)} bytes; expected 8 bytes, a big-endian long",
                )
        known = await server.storage.schemas(topic)
    except (RefusedError, KeyFailoverError) as exc:
        answer.error_code, answer.error_message = server_error(exc)  # type: ignore[assignment]
        return reply
    found = known[-1:] if version is None else [record for record in known if record.version == version]
    if not found:
        answer.error_code = TopicNotFound
        wanted = "no schema" if version is None else f"no schema version {version}"
        answer.error_message = f"Topic not found or no-schema: topic {topic!r} has {wanted}"
        return reply
    record = found[0]
    answer.schema.name = _pulsar_name(topic)
    answer.schema.schema_data = record.data
    answer.schema.type = record.kind  # type: ignore[assignment]
    for key, value in record.properties:
        answer.schema.properties.add(key=key, value=value)
    answer.schema_version = version_bytes(record.version)
    return reply


async def get_or_create_schema(server: ConnectionHost, request: CommandGetOrCreateSchema) -> BaseCommand:
    """The GET_OR_CREATE_SCHEMA_RESPONSE to a GET_OR_CREATE_SCHEMA on a topic served here: the version of its
    schema, added as a producer's is (an empty version for a schema of type NONE, as Pulsar answers a producer
    without one); a refusal in its ``error_code``."""
    reply = BaseCommand(type=BaseCommand.GET_OR_CREATE_SCHEMA_RESPONSE)
    answer = reply.getOrCreateSchemaResponse
    answer.request_id = request.request_id
    try:
        served = keyfailover_topic(request.topic)
        server.check_served(served, "get or create the schema of")
        if request.schema.type == _NONE:
            answer.schema_version = b""
        else:
            answer.schema_version = version_bytes(await _add(server, _topic(server, served), request.schema))
    except (RefusedError, KeyFailoverError) as exc:
        answer.error_code, answer.error_message = server_error(exc)  # type: ignore[assignment]
    return reply
