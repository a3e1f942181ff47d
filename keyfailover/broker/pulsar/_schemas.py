"""Apache Pulsar's schema rules, sans-IO: which schemas are the same, which are compatible, and schema versions.

A topic's schema has versions 0, 1, 2, ...; on the wire a version is 8 bytes, a big-endian long (Pulsar's
``LongSchemaVersion``). A schema is the same as a registered one when both have the same type and the same
data: for AVRO, JSON and PROTOBUF, whose data is an Avro schema in JSON, the same JSON document (whitespace and
the order of an object's keys do not count); for the others the same bytes. Properties never count.

Compatibility is Pulsar's broker default, the strategy FULL checked against the latest version: a schema of
another type is incompatible; AVRO and JSON schemas must each read what the other wrote (Avro schema
resolution, :mod:`._avro`); a KEY_VALUE schema's key and value schemas must each be of the latest one's types
and compatible with them; a PROTOBUF_NATIVE schema must keep the latest one's root message; any other schema is
compatible with one of its type, as Pulsar's default check has it. A consumer's schema is checked as Pulsar
does for FULL: it must read what the latest version wrote (BACKWARD).
"""

from __future__ import annotations

import json
import struct
from typing import Final, Literal, NamedTuple

from keyfailover.broker.pulsar._avro import AvroSchemaError, parse, read_problem
from keyfailover.broker.pulsar.PulsarApi_pb2 import Schema

__all__ = [
    "STRATEGY",
    "SchemaData",
    "check_data",
    "compatibility_problem",
    "same_schema",
    "type_name",
    "version_bytes",
    "version_of",
]

STRATEGY: Final = "FULL"
"""Pulsar's broker default ``schemaCompatibilityStrategy``, the one keyfailover applies."""

_LONG: Final = struct.Struct(">q")
_LENGTH: Final = struct.Struct(">i")
_AVRO_CHECKED: Final = frozenset({Schema.Avro, Schema.Json})
"""Types whose compatibility is Avro's schema resolution (Pulsar's default checkers: AVRO and JSON)."""
_AVRO_PARSED: Final = frozenset({Schema.Avro, Schema.Json, Schema.Protobuf})
"""Types whose data is compared as an Avro schema in JSON (Pulsar's ``isUsingAvroSchemaParser``)."""
_NAMES: Final[dict[int, str]] = {
    Schema.Bool: "BOOLEAN",
    Schema.KeyValue: "KEY_VALUE",
    Schema.LocalDate: "LOCAL_DATE",
    Schema.LocalTime: "LOCAL_TIME",
    Schema.LocalDateTime: "LOCAL_DATE_TIME",
    Schema.ProtobufNative: "PROTOBUF_NATIVE",
    Schema.AutoConsume: "AUTO_CONSUME",
}


_BYTES: Final = -1
"""Pulsar's schema type BYTES, which has no ``Schema.Type`` (a client sends no schema for it)."""
_KEY_VALUE_PARTS: Final = (("key", "key.schema.type"), ("value", "value.schema.type"))
"""The parts of a KEY_VALUE schema, and the property that names each one's type."""


class SchemaData(NamedTuple):
    """What the rules read of a schema: its type (Pulsar's ``Schema.Type``), its data and its properties."""

    kind: int
    data: bytes
    properties: tuple[tuple[str, str], ...] = ()


def type_name(kind: int) -> str:
    """The name Pulsar gives a schema type (``AVRO``, ``KEY_VALUE``...)."""
    if kind == _BYTES:
        return "BYTES"
    if kind in _NAMES:
        return _NAMES[kind]
    try:
        return Schema.Type.Name(kind).upper()  # type: ignore[arg-type]
    except ValueError:
        return f"type {kind}"


def version_bytes(version: int) -> bytes:
    """Schema version ``version`` as the wire carries it: 8 bytes, big-endian."""
    return _LONG.pack(version)


def version_of(data: bytes) -> int | None:
    """The schema version 8 bytes hold; None for bytes of another length."""
    return _LONG.unpack(data)[0] if len(data) == _LONG.size else None


def check_data(schema: SchemaData) -> str | None:
    """Why a schema's data is not valid for its type (AVRO: no Avro schema; JSON: no JSON); None when it is."""
    if schema.kind == Schema.Avro:
        try:
            parse(schema.data)
        except AvroSchemaError as exc:
            return f"Invalid schema definition data for AVRO schema: {exc}"
    elif schema.kind == Schema.Json:
        try:
            json.loads(schema.data)
        except (ValueError, UnicodeDecodeError) as exc:
            return f"Invalid schema definition data for JSON schema: {exc}"
    return None


def same_schema(one: SchemaData, other: SchemaData) -> bool:
    """Whether two schemas are the same: same type and data, as the module says."""
    if one.kind != other.kind:
        return False
    if one.data == other.data:
        return True
    if one.kind not in _AVRO_PARSED:
        return False
    try:
        return bool(json.loads(one.data) == json.loads(other.data))
    except (ValueError, UnicodeDecodeError):
        return False


def compatibility_problem(
    latest: SchemaData, new: SchemaData, strategy: Literal["FULL", "BACKWARD"] = STRATEGY
) -> str | None:
    """Why ``new`` is incompatible with ``latest`` under ``strategy`` (FULL for a producer, BACKWARD for a
    consumer: ``new`` reads what ``latest`` wrote); None when it is compatible."""
    if latest.kind != new.kind:
        return (
            f"Incompatible schema: exists schema type {type_name(latest.kind)}, new schema type {type_name(new.kind)}"
        )
    if same_schema(latest, new):
        return None
    if new.kind == Schema.KeyValue:
        return _key_value_problem(latest, new, strategy)
    if new.kind == Schema.ProtobufNative:
        return _root_message_problem(latest, new)
    if new.kind not in _AVRO_CHECKED:
        return None
    try:
        existing, wanted = parse(latest.data), parse(new.data)
    except AvroSchemaError as exc:
        if new.kind == Schema.Json:  # a JSON schema of the format before Avro's: only the same one is compatible
            return f"Incompatible schema: JSON schemas that are no Avro schema must be the same: {exc}"
        return f"Incompatible schema: {exc}"
    problem = read_problem(wanted, existing)
    if problem is not None:
        return (
            f"Error during schema compatibility check with strategy {strategy}: the new schema cannot read data "
            f"written with the latest version: {problem}"
        )
    if strategy == "FULL":
        problem = read_problem(existing, wanted)
        if problem is not None:
            return (
                f"Error during schema compatibility check with strategy {strategy}: the latest version cannot read "
                f"data written with the new schema: {problem}"
            )
    return None


def _key_value_parts(schema: SchemaData) -> tuple[SchemaData, SchemaData] | str:
    """The key and value schemas of a KEY_VALUE schema (its data ``[length: 4][key][length: 4][value]``, a length
    of -1 for none; their types in its properties, BYTES when not named); or what is wrong with it."""
    parts = []
    offset = 0
    properties = dict(schema.properties)
    named = {type_name(kind): kind for kind in Schema.Type.values()} | {"BYTES": _BYTES}
    for part, property_name in _KEY_VALUE_PARTS:
        if len(schema.data) - offset < _LENGTH.size:
            return f"KEY_VALUE schema data of {len(schema.data)} bytes ends before its {part} schema's length"
        (length,) = _LENGTH.unpack_from(schema.data, offset)
        offset += _LENGTH.size
        if length > len(schema.data) - offset:
            return f"KEY_VALUE schema data of {len(schema.data)} bytes ends inside its {part} schema"
        data = schema.data[offset : offset + max(length, 0)]
        offset += max(length, 0)
        kind_name = properties.get(property_name, "BYTES")
        if kind_name not in named:
            return f"KEY_VALUE schema's {property_name} {kind_name!r} is no schema type"
        parts.append(SchemaData(named[kind_name], data))
    return parts[0], parts[1]


def _key_value_problem(latest: SchemaData, new: SchemaData, strategy: Literal["FULL", "BACKWARD"]) -> str | None:
    """Why KEY_VALUE schema ``new`` is incompatible with ``latest``: its key or value schema is of another type, or
    incompatible; None when neither is."""
    old_parts, new_parts = _key_value_parts(latest), _key_value_parts(new)
    for parts in (old_parts, new_parts):
        if isinstance(parts, str):
            return f"Incompatible schema: {parts}"
    assert not isinstance(old_parts, str) and not isinstance(new_parts, str)
    (old_key, old_value), (new_key, new_value) = old_parts, new_parts
    if old_key.kind != new_key.kind or old_value.kind != new_value.kind:
        return (
            "Key schemas or Value schemas are different schema type, from key schema type is "
            f"{type_name(old_key.kind)} and to key schema is {type_name(new_key.kind)}, from value schema is "
            f"{type_name(old_value.kind)} and to value schema is {type_name(new_value.kind)}"
        )
    for part, old, wanted in (("key", old_key, new_key), ("value", old_value, new_value)):
        problem = compatibility_problem(old, wanted, strategy)
        if problem is not None:
            return f"KEY_VALUE schema's {part} schema: {problem}"
    return None


def _root_message(schema: SchemaData) -> str | None:
    """The root message a PROTOBUF_NATIVE schema's data names (a JSON object's ``rootMessageTypeName``); None when
    it names none."""
    try:
        document = json.loads(schema.data)
    except (ValueError, UnicodeDecodeError):
        return None
    name = document.get("rootMessageTypeName") if isinstance(document, dict) else None
    return name if isinstance(name, str) else None


def _root_message_problem(latest: SchemaData, new: SchemaData) -> str | None:
    """Why PROTOBUF_NATIVE schema ``new`` is incompatible with ``latest``: it changes the root message, which
    Pulsar's ``ProtobufNativeSchemaCompatibilityCheck`` refuses for every strategy but ALWAYS_COMPATIBLE."""
    old_root, new_root = _root_message(latest), _root_message(new)
    if old_root is None or new_root is None:
        return "Incompatible schema: PROTOBUF_NATIVE schema data must be a JSON object with a rootMessageTypeName"
    if old_root != new_root:
        return f"Protobuf root message isn't allow change! (from {old_root!r} to {new_root!r})"
    return None
