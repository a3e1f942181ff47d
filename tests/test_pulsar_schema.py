"""The Pulsar endpoint's schema registry (issue 40) with the real ``pulsar-client`` wheel and raw frames.

Producers and consumers with Avro, JSON and string schemas, a compatible evolution and an incompatible one,
GET_SCHEMA answered in its own response (never an ERROR the client cannot match), and the registry read back
by a server started again on the same log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pulsar
import pytest
from pulsar.schema import AvroSchema, Integer, JsonSchema, Record, String, StringSchema

from keyfailover.broker.pulsar import SCHEMA_VERSION_PROPERTY
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    BaseCommand,
    IncompatibleSchema,
    Schema,
    TopicNotFound,
    UnknownError,
)
from keyfailover.client import Client
from tests.pulsar_wire import RawPulsar, client, command, connect_command
from tests.server_process import ServerProcess

pytestmark = pytest.mark.integration  # a server in a process of its own

KEY_SHARED = pulsar.ConsumerType.KeyShared


class User(Record):  # type: ignore[misc]  # pulsar is untyped
    name = String()
    age = Integer()


class UserWithEmail(Record):  # type: ignore[misc]  # User with a field that has a default: FULL compatible with it
    name = String()
    age = Integer()
    email = String(required_default=True)


class UserNeedingEmail(Record):  # type: ignore[misc]  # User with a field without a default: it cannot read what User wrote
    name = String()
    age = Integer()
    email = String(required=True)


def version(number: int) -> bytes:
    return number.to_bytes(8, "big")


def get_or_create(topic: str, request_id: int, schema: Schema) -> BaseCommand:
    built = command(BaseCommand.GET_OR_CREATE_SCHEMA, topic=topic, request_id=request_id)
    built.getOrCreateSchema.schema.CopyFrom(schema)
    return built


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path_factory.mktemp("schema") / "data", "--pulsar-port", "0") as started:
        yield started


@pytest.mark.parametrize("schema_class", [AvroSchema, JsonSchema])
def test_a_record_goes_through_with_its_value_and_schema_version(
    server: ServerProcess, schema_class: type[AvroSchema] | type[JsonSchema]
) -> None:
    topic = f"users-{schema_class.__name__}"
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(topic, "s", consumer_type=KEY_SHARED, schema=schema_class(User))
        producer = pc.create_producer(topic, schema=schema_class(User))
        producer.send(User(name="ada", age=36), partition_key="ada")
        message = consumer.receive(10_000)
        assert message.value() == User(name="ada", age=36)
        assert message.schema_version().encode() == version(0)
        consumer.acknowledge(message)


def test_a_string_schema_goes_through(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe("strings", "s", consumer_type=KEY_SHARED, schema=StringSchema())
        producer = pc.create_producer("strings", schema=StringSchema())
        producer.send("héllo", partition_key="k")
        message = consumer.receive(10_000)
        assert (message.value(), message.schema_version().encode()) == ("héllo", version(0))
        with pytest.raises(pulsar.IncompatibleSchema):
            pc.create_producer("strings", schema=AvroSchema(User))  # another type


def test_a_compatible_schema_is_the_next_version_and_an_incompatible_one_is_refused(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe("evolving", "s", consumer_type=KEY_SHARED, schema=AvroSchema(User))
        first = pc.create_producer("evolving", schema=AvroSchema(User))
        second = pc.create_producer("evolving", schema=AvroSchema(UserWithEmail))
        again = pc.create_producer("evolving", schema=AvroSchema(User))  # the same schema: version 0 again
        with pytest.raises(pulsar.IncompatibleSchema):
            pc.create_producer("evolving", schema=AvroSchema(UserNeedingEmail))
        with pytest.raises(pulsar.IncompatibleSchema):  # a consumer must read what the latest version wrote
            pc.subscribe("evolving", "t", consumer_type=KEY_SHARED, schema=AvroSchema(UserNeedingEmail))
        plain = pc.create_producer("evolving")  # no schema: taken, as Pulsar does by default
        first.send(User(name="a", age=1), partition_key="k")
        second.send(UserWithEmail(name="b", age=2, email="b@example.com"), partition_key="k")
        again.send(User(name="c", age=3), partition_key="k")
        plain.send(AvroSchema(User).encode(User(name="d", age=4)), partition_key="k")
        received = [consumer.receive(10_000) for _ in range(4)]
        # Each written with its version, each read as a User (the version 1 one through its writer schema).
        assert [message.schema_version().encode() for message in received] == [version(0), version(1), version(0), b""]
        assert [message.value() for message in received[:3]] == [
            User(name="a", age=1),
            User(name="b", age=2),
            User(name="c", age=3),
        ]
        assert received[3].data() == AvroSchema(User).encode(User(name="d", age=4))
        writer = pc._client.get_schema_info("persistent://public/default/evolving", 1)
        assert [field["name"] for field in json.loads(writer.schema())["fields"]] == ["name", "age", "email"]


def test_get_schema_without_one_is_answered_at_once_in_its_own_response(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc, pytest.raises(pulsar.TopicNotFound):
        pc._client.get_schema_info("persistent://public/default/schemaless", 0)
    with RawPulsar(server.pulsar_url or "") as raw:
        raw.send(connect_command())
        raw.receive_type(BaseCommand.CONNECTED)
        topic = "persistent://public/default/raw-schema"
        avro = Schema(name="u", type=Schema.Avro, schema_data=AvroSchema(User).schema_info().schema().encode())
        raw.send(command(BaseCommand.GET_SCHEMA, topic=topic, request_id=1))
        missing = raw.receive_type(BaseCommand.GET_SCHEMA_RESPONSE).getSchemaResponse
        assert (missing.request_id, missing.error_code) == (1, TopicNotFound)
        assert "topic 'raw-schema' has no schema" in missing.error_message
        raw.send(get_or_create(topic, 2, avro))
        created = raw.receive_type(BaseCommand.GET_OR_CREATE_SCHEMA_RESPONSE).getOrCreateSchemaResponse
        assert (created.request_id, created.HasField("error_code"), created.schema_version) == (2, False, version(0))
        string = Schema(name="s", type=Schema.String, schema_data=b"")
        raw.send(get_or_create(topic, 3, string))
        refused = raw.receive_type(BaseCommand.GET_OR_CREATE_SCHEMA_RESPONSE).getOrCreateSchemaResponse
        assert (refused.request_id, refused.error_code) == (3, IncompatibleSchema)
        assert "exists schema type AVRO, new schema type STRING" in refused.error_message
        raw.send(command(BaseCommand.GET_SCHEMA, topic=topic, request_id=4, schema_version=b"\x00"))
        malformed = raw.receive_type(BaseCommand.GET_SCHEMA_RESPONSE).getSchemaResponse
        assert (malformed.request_id, malformed.error_code) == (4, UnknownError)
        assert "schema version of 1 bytes; expected 8 bytes" in malformed.error_message
        raw.send(command(BaseCommand.GET_SCHEMA, topic=topic + "-partition-0", request_id=5))
        found = raw.receive_type(BaseCommand.GET_SCHEMA_RESPONSE).getSchemaResponse
        assert (found.schema.type, found.schema.schema_data, found.schema_version) == (
            Schema.Avro,
            avro.schema_data,
            version(0),
        )


def test_a_native_consumer_sees_the_schema_version_as_a_property(server: ServerProcess) -> None:
    with client(server.pulsar_url) as pc:
        pc.create_producer("native-read", schema=StringSchema()).send("x", partition_key="k")
    with Client(server.url, connect_timeout=5.0) as kc:
        message = kc.subscribe("native-read", "s", "c1").receive(timeout=10)
    assert dict(message.properties) == {SCHEMA_VERSION_PROPERTY: "0"}  # as the delivery time is: reserved, kept


def test_the_registry_survives_a_restart(tmp_path: Path) -> None:
    for started in range(2):
        with ServerProcess(tmp_path / "data", "--pulsar-port", "0") as server, client(server.pulsar_url) as pc:
            if not started:
                pc.create_producer("kept", schema=AvroSchema(User))
                pc.create_producer("kept", schema=AvroSchema(UserWithEmail))
                continue
            latest = pc._client.get_schema_info("persistent://public/default/kept", -1)
            assert json.loads(latest.schema())["name"] == "UserWithEmail"
            with pytest.raises(pulsar.IncompatibleSchema):
                pc.create_producer("kept", schema=StringSchema())
