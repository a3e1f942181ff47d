"""Pulsar's schema compatibility (the FULL strategy) and the Avro schema resolution under it, as pure functions.

Each Avro rule has an example; the properties check that every schema reads itself, and that a pair of schemas
the check calls compatible really resolves: data written with the writer schema is read with the reader schema
by fastavro (the Avro library the Pulsar Python client decodes with).
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import fastavro
import fastavro.utils
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyfailover.broker.pulsar import SCHEMA_VERSION_PROPERTY, PulsarMetadata, from_pulsar, to_pulsar
from keyfailover.broker.pulsar._avro import AvroSchemaError, parse, read_problem
from keyfailover.broker.pulsar._schemas import (
    SchemaData,
    check_data,
    compatibility_problem,
    same_schema,
    type_name,
    version_bytes,
    version_of,
)
from keyfailover.broker.pulsar.PulsarApi_pb2 import Schema
from keyfailover.wire.properties import decode_properties, encode_properties


def record(name: str, *fields: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": list(fields), **extra}


def problem(reader: object, writer: object) -> str | None:
    return read_problem(parse(json.dumps(reader)), parse(json.dumps(writer)))


USER = record("User", {"name": "name", "type": "string"}, {"name": "age", "type": "int"})


# -- Avro's rules, one example each ------------------------------------------------------


@pytest.mark.parametrize(
    ("reader", "writer"),
    [
        ("long", "int"),
        ("float", "int"),
        ("float", "long"),
        ("double", "int"),
        ("double", "long"),
        ("double", "float"),
        ("bytes", "string"),
        ("string", "bytes"),
        ({"type": "int", "logicalType": "date"}, "int"),
    ],
)
def test_a_primitive_reads_the_types_promoted_to_it(reader: object, writer: object) -> None:
    assert problem(reader, writer) is None


@pytest.mark.parametrize(
    ("reader", "writer"),
    [("int", "long"), ("long", "float"), ("float", "double"), ("int", "string"), ("boolean", "int"), ("null", "int")],
)
def test_a_primitive_does_not_read_a_wider_or_another_type(reader: str, writer: str) -> None:
    assert problem(reader, writer) == f"at /: the reader's {reader} cannot read the writer's {writer}"


def test_a_record_reads_fields_by_name_skips_writer_fields_and_needs_defaults_for_its_own() -> None:
    reordered = record("User", {"name": "age", "type": "long"}, {"name": "name", "type": "string"})
    assert problem(reordered, USER) is None  # by name, with int promoted to long
    fewer = record("User", {"name": "name", "type": "string"})
    assert problem(fewer, USER) is None  # the writer's age is skipped
    defaulted = record("User", *USER["fields"], {"name": "email", "type": "string", "default": ""})
    assert problem(defaulted, USER) is None
    undefaulted = record("User", *USER["fields"], {"name": "email", "type": "string"})
    assert problem(undefaulted, USER) == (
        "at /email: field 'email' of record 'User' has no default value, and the writer's record has no such field"
    )
    aliased = record("User", {"name": "years", "type": "int", "aliases": ["age"]})
    assert problem(aliased, USER) is None


def test_a_record_reads_a_record_of_any_name_but_enums_and_fixed_need_theirs() -> None:
    assert problem(record("Person", *USER["fields"]), USER) is None  # Avro's resolver does not compare them
    assert problem(
        {"type": "enum", "name": "A", "symbols": ["X"]}, {"type": "enum", "name": "B", "symbols": ["X"]}
    ) == ("at /: the reader's enum 'A' cannot read the writer's enum 'B': names differ")
    aliased = {"type": "fixed", "name": "A", "size": 1, "aliases": ["B"]}
    assert problem(aliased, {"type": "fixed", "name": "B", "size": 1}) is None


def test_a_reader_union_reads_with_its_branch_of_the_writer_s_type_else_one_it_is_promoted_to() -> None:
    assert problem(["null", "double", "long"], "int") is None  # the first promotion: double
    assert (
        problem(
            [{"type": "array", "items": "int"}, {"type": "array", "items": "long"}],
            {
                "type": "array",
                "items": "long",
            },
        )
        == "at /items: the reader's int cannot read the writer's long"
    )  # the first array branch, as Avro picks it
    one = record("One", {"name": "a", "type": "int"})
    other = record("Other", {"name": "b", "type": "int"})
    assert problem(["null", other, one], record("Written", {"name": "a", "type": "int"})) is None  # by structure


def test_enum_symbols_the_reader_lacks_need_its_default() -> None:
    def enum(symbols: list[str], **extra: Any) -> dict[str, Any]:
        return {"type": "enum", "name": "Color", "symbols": symbols, **extra}

    assert problem(enum(["RED", "GREEN", "BLUE"]), enum(["RED", "GREEN"])) is None
    assert problem(enum(["RED"]), enum(["RED", "GREEN"])) == (
        "at /: enum 'Color' of the reader lacks the writer's symbols ['GREEN'] and has no default symbol"
    )
    assert problem(enum(["RED", "OTHER"], default="OTHER"), enum(["RED", "GREEN"])) is None


def test_fixed_needs_the_same_name_and_size() -> None:
    assert problem({"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "F", "size": 4}) is None
    assert problem({"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "F", "size": 8}) == (
        "at /: fixed 'F' has 4 bytes, the writer's 8"
    )


def test_arrays_and_maps_resolve_their_items_and_values() -> None:
    assert problem({"type": "array", "items": "long"}, {"type": "array", "items": "int"}) is None
    assert problem({"type": "map", "values": "int"}, {"type": "map", "values": "long"}) == (
        "at /values: the reader's int cannot read the writer's long"
    )
    assert problem({"type": "array", "items": "int"}, {"type": "map", "values": "int"}) == (
        "at /: the reader's array cannot read the writer's map"
    )


def test_unions_each_writer_branch_must_be_read_by_some_reader_branch() -> None:
    assert problem(["null", "string"], "string") is None
    assert problem(["null", "long"], ["null", "int"]) is None
    assert problem("string", ["null", "string"]) == "at /: the reader's string cannot read the writer's null"
    assert problem(["null", "int"], "string") == "at /: no branch of the reader's union can read the writer's string"


def test_nested_and_recursive_records_resolve() -> None:
    node = record("Node", {"name": "value", "type": "int"}, {"name": "next", "type": ["null", "Node"]})
    wider = record("Node", {"name": "value", "type": "long"}, {"name": "next", "type": ["null", "Node"]})
    assert problem(wider, node) is None
    assert problem(node, wider) == "at /value: the reader's int cannot read the writer's long"
    inner = record("Inner", {"name": "x", "type": "int"})
    outer = record("Outer", {"name": "a", "type": inner}, {"name": "b", "type": "Inner"})
    assert problem(outer, outer) is None


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"not json", "schema data is not JSON"),
        (b'{"type": "record", "name": "R"}', "record 'R' has no list of fields"),
        (b'{"type": "Unknown"}', "type 'Unknown' is neither a primitive type nor a named type defined before"),
        (b'[{"type": "enum", "name": "E", "symbols": [1]}]', "enum 'E' has no list of string symbols"),
    ],
)
def test_data_that_is_no_avro_schema_says_what_is_wrong(data: bytes, expected: str) -> None:
    with pytest.raises(AvroSchemaError, match=expected):
        parse(data)


# -- Pulsar's rules ------------------------------------------------------------------------


def avro(document: object, kind: int = Schema.Avro) -> SchemaData:
    return SchemaData(kind, json.dumps(document).encode())


def test_full_compatibility_checks_both_ways() -> None:
    added = record("User", *USER["fields"], {"name": "email", "type": ["null", "string"], "default": None})
    assert compatibility_problem(avro(USER), avro(added)) is None
    required = record("User", *USER["fields"], {"name": "email", "type": "string"})
    assert compatibility_problem(avro(USER), avro(required)) == (
        "Error during schema compatibility check with strategy FULL: the new schema cannot read data written with "
        "the latest version: at /email: field 'email' of record 'User' has no default value, and the writer's record "
        "has no such field"
    )
    # A consumer only reads: BACKWARD
    dropped = record("User", {"name": "name", "type": "string"})
    assert compatibility_problem(avro(USER), avro(dropped), "BACKWARD") is None
    assert compatibility_problem(avro(USER), avro(dropped)) == (
        "Error during schema compatibility check with strategy FULL: the latest version cannot read data written "
        "with the new schema: at /age: field 'age' of record 'User' has no default value, and the writer's record "
        "has no such field"
    )
    assert compatibility_problem(avro(USER, Schema.Json), avro(required, Schema.Json)) is not None


def test_schemas_of_other_types_are_compatible_with_one_of_their_type_only() -> None:
    assert compatibility_problem(SchemaData(Schema.String, b""), SchemaData(Schema.String, b"x")) is None
    assert compatibility_problem(SchemaData(Schema.Protobuf, b"{}"), SchemaData(Schema.Protobuf, b"[]")) is None
    assert compatibility_problem(avro(USER), SchemaData(Schema.String, b"")) == (
        "Incompatible schema: exists schema type AVRO, new schema type STRING"
    )
    assert compatibility_problem(avro(USER, Schema.Json), avro(USER)) == (
        "Incompatible schema: exists schema type JSON, new schema type AVRO"
    )
    assert type_name(Schema.KeyValue) == "KEY_VALUE" and type_name(99) == "type 99"


def key_value(key: SchemaData | None, value: SchemaData, key_type: str = "AVRO") -> SchemaData:
    """A KEY_VALUE schema as Pulsar's clients encode it: both parts' data, each after its length (-1: none), and
    their types in the properties."""
    data = b"".join(
        struct.pack(">i", -1) if part is None else struct.pack(">i", len(part.data)) + part.data
        for part in (key, value)
    )
    properties = (("key.schema.type", key_type), ("value.schema.type", "AVRO"))
    return SchemaData(Schema.KeyValue, data, properties)


def test_a_key_value_schema_s_key_and_value_schemas_are_checked_each() -> None:
    added = record("User", *USER["fields"], {"name": "email", "type": ["null", "string"], "default": None})
    required = record("User", *USER["fields"], {"name": "email", "type": "string"})
    string = SchemaData(Schema.String, b"")
    assert (
        compatibility_problem(key_value(string, avro(USER), "STRING"), key_value(string, avro(added), "STRING")) is None
    )
    assert compatibility_problem(key_value(avro(USER), avro(USER)), key_value(avro(required), avro(USER))) == (
        "KEY_VALUE schema's key schema: Error during schema compatibility check with strategy FULL: the new schema "
        "cannot read data written with the latest version: at /email: field 'email' of record 'User' has no default "
        "value, and the writer's record has no such field"
    )
    assert compatibility_problem(key_value(string, avro(USER), "STRING"), key_value(None, avro(USER), "BYTES")) == (
        "Key schemas or Value schemas are different schema type, from key schema type is STRING and to key schema is "
        "BYTES, from value schema is AVRO and to value schema is AVRO"
    )
    cut = SchemaData(Schema.KeyValue, b"\x00\x00\x00\x09abc")
    assert compatibility_problem(key_value(string, avro(USER), "STRING"), cut) == (
        "Incompatible schema: KEY_VALUE schema data of 7 bytes ends inside its key schema"
    )


def test_a_protobuf_native_schema_keeps_its_root_message() -> None:
    def native(root: str, descriptors: str = "AA==") -> SchemaData:
        document = {"fileDescriptorSet": descriptors, "rootMessageTypeName": root, "rootFileDescriptorName": "t.proto"}
        return SchemaData(Schema.ProtobufNative, json.dumps(document).encode())

    assert compatibility_problem(native("test.Message"), native("test.Message", "AQ==")) is None
    assert compatibility_problem(native("test.Message"), native("test.Other")) == (
        "Protobuf root message isn't allow change! (from 'test.Message' to 'test.Other')"
    )


def test_the_same_schema_is_the_same_type_and_json_document_whatever_its_layout() -> None:
    compact = SchemaData(Schema.Avro, json.dumps(USER, separators=(",", ":")).encode())
    spaced = SchemaData(Schema.Avro, json.dumps(USER, indent=2, sort_keys=True).encode())
    assert same_schema(compact, spaced)
    assert not same_schema(compact, spaced._replace(kind=Schema.Json))
    assert not same_schema(SchemaData(Schema.String, b"a"), SchemaData(Schema.String, b" a"))
    assert check_data(SchemaData(Schema.Avro, b"{")) is not None
    assert check_data(SchemaData(Schema.Json, b"{")) is not None
    assert check_data(avro(USER)) is None


def test_versions_are_eight_bytes_big_endian() -> None:
    assert version_bytes(0) == b"\x00" * 8
    assert version_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert version_of(version_bytes(7)) == 7
    assert version_of(b"\x01") is None


def test_a_message_s_schema_version_is_kept_as_a_property_and_given_back() -> None:
    kept = from_pulsar([("k", "v")], 0, schema_version=version_bytes(3))
    assert decode_properties(kept) == {"k": "v", SCHEMA_VERSION_PROPERTY: "3"}
    assert to_pulsar(kept) == PulsarMetadata({"k": "v"}, schema_version=version_bytes(3))
    assert from_pulsar([], 0, schema_version=b"\x01") is None  # no version the registry gives out: not kept
    odd = encode_properties({SCHEMA_VERSION_PROPERTY: "-1"})  # a native producer's: stays a property
    assert to_pulsar(odd) == PulsarMetadata({SCHEMA_VERSION_PROPERTY: "-1"})


# -- properties ------------------------------------------------------------------------------

_PRIMITIVES = ["null", "boolean", "int", "long", "float", "double", "bytes", "string"]
_DEFAULTS: dict[str, Any] = {
    "null": None,
    "boolean": False,
    "int": 0,
    "long": 0,
    "float": 0.0,
    "double": 0.0,
    "bytes": "",
    "string": "",
}


@st.composite
def avro_schemas(draw: st.DrawFn, depth: int = 0, path: str = "") -> Any:
    """A JSON Avro schema: records and enums (named by their ``path`` of field names, so each name is defined
    once), arrays, maps, unions of a few primitives and primitives."""
    kinds = ["primitive", "union"] + (["record", "array", "map", "enum"] if depth < 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "primitive":
        return draw(st.sampled_from(_PRIMITIVES))
    if kind == "union":
        # Not both string and bytes: fastavro resolves a writer's bytes branch with the reader's first promotable
        # branch, string, where Avro takes the branch of the same type first.
        branches = draw(st.lists(st.sampled_from(_PRIMITIVES), min_size=1, max_size=3, unique=True))
        return [branch for branch in branches if branch != "bytes"] if "string" in branches else branches
    if kind == "array":
        return {"type": "array", "items": draw(avro_schemas(depth + 1, path))}
    if kind == "map":
        return {"type": "map", "values": draw(avro_schemas(depth + 1, path))}
    if kind == "enum":
        symbols = draw(st.lists(st.sampled_from(["A", "B", "C"]), min_size=1, unique=True))
        return {"type": "enum", "name": f"E{path}", "symbols": symbols}
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=3, unique=True))
    fields = []
    for name in names:
        field: dict[str, Any] = {"name": name, "type": draw(avro_schemas(depth + 1, path + name))}
        if isinstance(field["type"], str) and draw(st.booleans()):
            field["default"] = _DEFAULTS[field["type"]]
        fields.append(field)
    return record(f"R{path}", *fields)


@st.composite
def evolved(draw: st.DrawFn, document: Any) -> Any:
    """``document`` with some of its records changed: a field dropped, added (with a default or without), or
    its primitive type replaced."""
    if isinstance(document, dict) and document.get("type") == "record":
        fields = [{**field, "type": draw(evolved(field["type"]))} for field in document["fields"]]
        change = draw(st.sampled_from(["none", "drop", "add", "add-default", "retype"]))
        if change == "drop" and len(fields) > 1:
            fields.pop(draw(st.integers(0, len(fields) - 1)))
        elif change in ("add", "add-default"):
            kind = draw(st.sampled_from(_PRIMITIVES))
            added: dict[str, Any] = {"name": "z", "type": kind}
            if change == "add-default":
                added["default"] = _DEFAULTS[kind]
            fields.append(added)
        elif change == "retype":
            at = draw(st.integers(0, len(fields) - 1))
            kind = draw(st.sampled_from(_PRIMITIVES))
            fields[at] = {"name": fields[at]["name"], "type": kind}
        return {**document, "fields": fields}
    if isinstance(document, dict) and document.get("type") in ("array", "map"):
        inner = "items" if document["type"] == "array" else "values"
        return {**document, inner: draw(evolved(document[inner]))}
    return document


def utf8_bytes(datum: Any) -> Any:
    """``datum`` with each bytes value replaced by UTF-8 text: Avro promotes bytes to string, and random bytes
    are no text."""
    if isinstance(datum, bytes):
        return b"text"
    if isinstance(datum, dict):
        return {key: utf8_bytes(value) for key, value in datum.items()}
    if isinstance(datum, list):
        return [utf8_bytes(value) for value in datum]
    return datum


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(avro_schemas())
def test_every_schema_reads_itself(document: Any) -> None:
    assert problem(document, document) is None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_what_the_check_calls_readable_fastavro_reads(data: st.DataObject) -> None:
    writer = data.draw(avro_schemas())
    reader = data.draw(evolved(writer))
    if problem(reader, writer) is not None:
        return
    parsed_writer, parsed_reader = fastavro.parse_schema(writer), fastavro.parse_schema(reader)
    for generated in fastavro.utils.generate_many(parsed_writer, 3):
        datum = utf8_bytes(generated)
        buffer = io.BytesIO()
        fastavro.schemaless_writer(buffer, parsed_writer, datum)
        buffer.seek(0)
        fastavro.schemaless_reader(buffer, parsed_writer, parsed_reader)
