"""Avro schema resolution, sans-IO: whether data written with one Avro schema can be read with another.

Apache Pulsar checks the compatibility of AVRO and JSON schemas (whose data is an Avro schema in JSON) with
Avro's ``SchemaValidator``, which asks Avro's ``Resolver`` (the resolving decoder's grammar) whether a reader
schema resolves a writer schema without an error. By the rules of the Avro specification's schema resolution,
as that resolver applies them, a reader reads a writer when

- both are the same primitive type, or the writer's is promoted to the reader's: int to long, float or
  double; long to float or double; float to double; string to bytes and bytes to string;
- both are records (of any names): each reader field is read from the writer field of its name (or of one of
  its aliases), or has a default when the writer has no such field; writer fields the reader lacks are skipped;
- both are enums of the same full name (or the writer's is an alias of the reader), and every writer symbol is
  a reader symbol, unless the reader has a default symbol;
- both are fixed of the same full name and size; arrays whose items, maps whose values are read;
- the writer is a union and the reader reads each of its branches;
- the reader is a union and its branch for the writer reads it: the first branch of the writer's type (for a
  record, enum or fixed: of its full name, else for a record the first whose fields resolve, preferring one of
  its simple name), else the first branch the writer's type is promoted to.

Logical types resolve as their underlying types, and defaults are not checked against their field's type, as
Pulsar's parser, with ``setValidateDefaults`` false, does not check them. :func:`parse` reads a schema,
:func:`read_problem` says why a reader cannot read a writer (None when it can).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "AvroArray",
    "AvroEnum",
    "AvroField",
    "AvroFixed",
    "AvroMap",
    "AvroPrimitive",
    "AvroRecord",
    "AvroSchema",
    "AvroSchemaError",
    "AvroUnion",
    "parse",
    "read_problem",
]

PRIMITIVES: Final = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
"""Avro's primitive type names."""

_PROMOTIONS: Final = {
    "long": frozenset({"int"}),
    "float": frozenset({"int", "long"}),
    "double": frozenset({"int", "long", "float"}),
    "bytes": frozenset({"string"}),
    "string": frozenset({"bytes"}),
}
"""The writer types each reader type reads besides its own."""


class AvroSchemaError(ValueError):
    """Schema data that is not an Avro schema; the text says what was wrong."""


@dataclass(frozen=True)
class AvroPrimitive:
    """A primitive type: one of :data:`PRIMITIVES`."""

    kind: str


@dataclass(eq=False)
class AvroField:
    """A record's field: its name, type, whether it has a default, and its aliases."""

    name: str
    type: AvroSchema
    has_default: bool
    aliases: frozenset[str] = frozenset()


@dataclass(eq=False)
class AvroRecord:
    """A record (or an error): its simple and full names, the full names of its aliases, and its fields."""

    name: str
    fullname: str
    aliases: frozenset[str]
    fields: list[AvroField] = field(default_factory=list)


@dataclass(eq=False)
class AvroEnum:
    """An enum: its names, aliases, symbols and default symbol (None: none)."""

    name: str
    fullname: str
    aliases: frozenset[str]
    symbols: tuple[str, ...]
    default: str | None


@dataclass(eq=False)
class AvroFixed:
    """A fixed: its names, aliases and size in bytes."""

    name: str
    fullname: str
    aliases: frozenset[str]
    size: int


@dataclass(eq=False)
class AvroArray:
    """An array of ``items``."""

    items: AvroSchema


@dataclass(eq=False)
class AvroMap:
    """A map of string keys to ``values``."""

    values: AvroSchema


@dataclass(eq=False)
class AvroUnion:
    """A union of ``branches``."""

    branches: tuple[AvroSchema, ...]


AvroSchema = AvroPrimitive | AvroRecord | AvroEnum | AvroFixed | AvroArray | AvroMap | AvroUnion
"""A parsed Avro schema."""

_Named = AvroRecord | AvroEnum | AvroFixed


def parse(data: bytes | str) -> AvroSchema:
    """The Avro schema ``data`` holds in JSON; :class:`AvroSchemaError` says why it holds none."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AvroSchemaError(f"schema data is not JSON: {exc}") from None
    return _Parser().schema(document, "")


class _Parser:
    """One schema's parse: the named types met so far, by full name."""

    def __init__(self) -> None:
        self.names: dict[str, _Named] = {}

    def schema(self, document: object, namespace: str) -> AvroSchema:
        """The schema ``document`` (parsed JSON) defines, inside ``namespace``."""
        if isinstance(document, str):
            return self.reference(document, namespace)
        if isinstance(document, list):
            return AvroUnion(tuple(self.schema(branch, namespace) for branch in document))
        if not isinstance(document, dict):
            raise AvroSchemaError(f"{_shown(document)} is no Avro schema; expected a type name, an object or a list")
        kind = document.get("type")
        if kind in ("record", "error"):
            return self.record(document, namespace)
        if kind == "enum":
            name, fullname, aliases = self.names_of(document, namespace)
            symbols = document.get("symbols")
            if not isinstance(symbols, list) or not all(isinstance(symbol, str) for symbol in symbols):
                raise AvroSchemaError(f"enum {fullname!r} has no list of string symbols")
            default = document.get("default")
            enum = AvroEnum(name, fullname, aliases, tuple(symbols), default if isinstance(default, str) else None)
            return self.define(enum)
        if kind == "fixed":
            name, fullname, aliases = self.names_of(document, namespace)
            size = document.get("size")
            if type(size) is not int or size < 0:
                raise AvroSchemaError(f"fixed {fullname!r} has no size of 0 or more bytes")
            return self.define(AvroFixed(name, fullname, aliases, size))
        if kind == "array":
            if "items" not in document:
                raise AvroSchemaError("an array has no items")
            return AvroArray(self.schema(document["items"], namespace))
        if kind == "map":
            if "values" not in document:
                raise AvroSchemaError("a map has no values")
            return AvroMap(self.schema(document["values"], namespace))
        if isinstance(kind, str) and kind in PRIMITIVES:
            return AvroPrimitive(kind)  # a logical type resolves as its underlying type
        if isinstance(kind, (dict, list)):
            return self.schema(kind, namespace)
        if isinstance(kind, str):
            return self.reference(kind, namespace)
        raise AvroSchemaError(f"{_shown(document)} has no type")

    def record(self, document: dict[str, object], namespace: str) -> AvroRecord:
        """The record ``document`` defines; it is named before its fields, which may refer to it."""
        name, fullname, aliases = self.names_of(document, namespace)
        record = AvroRecord(name, fullname, aliases)
        self.define(record)
        fields = document.get("fields")
        if not isinstance(fields, list):
            raise AvroSchemaError(f"record {fullname!r} has no list of fields")
        inner = fullname.rpartition(".")[0]
        seen: set[str] = set()
        for entry in fields:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "type" not in entry:
                raise AvroSchemaError(f"a field of record {fullname!r} has no name or no type: {_shown(entry)}")
            field_name = entry["name"]
            if field_name in seen:
                raise AvroSchemaError(f"record {fullname!r} has two fields named {field_name!r}")
            seen.add(field_name)
            field_aliases = entry.get("aliases", [])
            if not isinstance(field_aliases, list) or not all(isinstance(alias, str) for alias in field_aliases):
                raise AvroSchemaError(f"field {field_name!r} of record {fullname!r} has aliases that are no strings")
            record.fields.append(
                AvroField(field_name, self.schema(entry["type"], inner), "default" in entry, frozenset(field_aliases))
            )
        return record

    def names_of(self, document: dict[str, object], namespace: str) -> tuple[str, str, frozenset[str]]:
        """The simple name, full name and aliases' full names of the named type ``document`` defines."""
        name = document.get("name")
        if not isinstance(name, str) or not name:
            raise AvroSchemaError(f"a named type has no name: {_shown(document)}")
        space = document.get("namespace")
        if "." in name:
            fullname = name
        elif isinstance(space, str) and space:
            fullname = f"{space}.{name}"
        else:
            fullname = f"{namespace}.{name}" if namespace and space is None else name
        inner = fullname.rpartition(".")[0]
        aliases = document.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(alias, str) for alias in aliases):
            raise AvroSchemaError(f"type {fullname!r} has aliases that are no strings")
        full_aliases = frozenset(alias if "." in alias or not inner else f"{inner}.{alias}" for alias in aliases)
        return fullname.rpartition(".")[2], fullname, full_aliases

    def define(self, named: _Named) -> _Named:
        """Record ``named`` under its full name; a name defined twice is refused."""
        if named.fullname in self.names:
            raise AvroSchemaError(f"type {named.fullname!r} is defined twice")
        self.names[named.fullname] = named
        return named

    def reference(self, name: str, namespace: str) -> AvroSchema:
        """A primitive type, or a named type defined before, by its name."""
        if name in PRIMITIVES:
            return AvroPrimitive(name)
        found = self.names.get(name) if "." in name else self.names.get(f"{namespace}.{name}" if namespace else name)
        if found is None:
            found = self.names.get(name)
        if found is None:
            raise AvroSchemaError(f"type {name!r} is neither a primitive type nor a named type defined before")
        return found


def _shown(value: object) -> str:
    """``value`` as JSON, cut short for a message."""
    text = json.dumps(value) if isinstance(value, (Mapping, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_problem(reader: AvroSchema, writer: AvroSchema) -> str | None:
    """Why data written with ``writer`` cannot be read with ``reader``; None when it can."""
    return _Resolution().problem(reader, writer, "/")


class _Resolution:
    """One check: the pairs of named types being compared, taken as compatible while they are (recursion)."""

    def __init__(self) -> None:
        self.assumed: set[tuple[int, int]] = set()

    def problem(self, reader: AvroSchema, writer: AvroSchema, path: str) -> str | None:
        """Why ``reader`` cannot read ``writer`` at ``path``; None when it can."""
        if type(reader) is type(writer):
            return self.same_kind(reader, writer, path)
        if isinstance(writer, AvroUnion):
            return self.union_writer(reader, writer, path)
        if isinstance(reader, AvroUnion):
            return self.union_reader(reader, writer, path)
        return f"at {path}: the reader's {_kind(reader)} cannot read the writer's {_kind(writer)}"

    def same_kind(self, reader: AvroSchema, writer: AvroSchema, path: str) -> str | None:
        """:meth:`problem` for two schemas of one kind."""
        if isinstance(reader, AvroPrimitive):
            assert isinstance(writer, AvroPrimitive)
            if reader.kind == writer.kind or writer.kind in _PROMOTIONS.get(reader.kind, ()):
                return None
            return f"at {path}: the reader's {reader.kind} cannot read the writer's {writer.kind}"
        if isinstance(reader, AvroArray):
            assert isinstance(writer, AvroArray)
            return self.problem(reader.items, writer.items, _child(path, "items"))
        if isinstance(reader, AvroMap):
            assert isinstance(writer, AvroMap)
            return self.problem(reader.values, writer.values, _child(path, "values"))
        if isinstance(reader, AvroUnion):
            assert isinstance(writer, AvroUnion)
            return self.union_writer(reader, writer, path)
        assert isinstance(reader, (AvroRecord, AvroEnum, AvroFixed)) and isinstance(writer, type(reader))
        if not isinstance(reader, AvroRecord) and not _same_name(reader, writer):
            return f"at {path}: the reader's {_kind(reader)} cannot read the writer's {_kind(writer)}: names differ"
        if isinstance(reader, AvroFixed):
            assert isinstance(writer, AvroFixed)
            if reader.size != writer.size:
                return f"at {path}: fixed {reader.name!r} has {reader.size} bytes, the writer's {writer.size}"
            return None
        if isinstance(reader, AvroEnum):
            assert isinstance(writer, AvroEnum)
            missing = [symbol for symbol in writer.symbols if symbol not in reader.symbols]
            if missing and not (reader.default is not None and reader.default in reader.symbols):
                return (
                    f"at {path}: enum {reader.name!r} of the reader lacks the writer's symbols {missing} and has no "
                    "default symbol"
                )
            return None
        assert isinstance(reader, AvroRecord) and isinstance(writer, AvroRecord)
        pair = (id(reader), id(writer))
        if pair in self.assumed:
            return None
        self.assumed.add(pair)
        by_name = {entry.name: entry for entry in writer.fields}
        for entry in reader.fields:
            written = by_name.get(entry.name)
            if written is None:
                written = next((by_name[alias] for alias in sorted(entry.aliases) if alias in by_name), None)
            if written is None:
                if entry.has_default:
                    continue
                where = _child(path, entry.name)
                return (
                    f"at {where}: field {entry.name!r} of record {reader.name!r} has no default value, and the "
                    "writer's record has no such field"
                )
            found = self.problem(entry.type, written.type, _child(path, entry.name))
            if found is not None:
                return found
        return None

    def union_writer(self, reader: AvroSchema, writer: AvroUnion, path: str) -> str | None:
        """Every branch of the writer's union must be readable."""
        for branch in writer.branches:
            found = self.problem(reader, branch, path)
            if found is not None:
                return found
        return None

    def union_reader(self, reader: AvroUnion, writer: AvroSchema, path: str) -> str | None:
        """The reader union's branch for the writer (:meth:`branch`) must read it."""
        branch = self.branch(reader, writer, path)
        if branch is None:
            return f"at {path}: no branch of the reader's union can read the writer's {_kind(writer)}"
        return self.problem(branch, writer, path)

    def branch(self, reader: AvroUnion, writer: AvroSchema, path: str) -> AvroSchema | None:
        """The branch of ``reader`` that reads ``writer``, as Avro's resolver picks it (see the module)."""
        structural: AvroRecord | None = None
        for branch in reader.branches:
            if type(branch) is not type(writer):
                continue
            if isinstance(branch, AvroPrimitive):
                assert isinstance(writer, AvroPrimitive)
                if branch.kind == writer.kind:
                    return branch
            elif isinstance(branch, (AvroRecord, AvroEnum, AvroFixed)):
                assert isinstance(writer, (AvroRecord, AvroEnum, AvroFixed))
                if branch.fullname == writer.fullname:
                    return branch
                resolves = isinstance(branch, AvroRecord) and self.problem(branch, writer, path) is None
                if resolves and (structural is None or branch.name == writer.name):
                    structural = branch  # type: ignore[assignment]
            else:
                return branch  # an array or a map: the first one
        if structural is not None:
            return structural
        if isinstance(writer, AvroPrimitive):
            for branch in reader.branches:
                if isinstance(branch, AvroPrimitive) and writer.kind in _PROMOTIONS.get(branch.kind, ()):
                    return branch
        return None


def _same_name(reader: AvroEnum | AvroFixed, writer: AvroRecord | AvroEnum | AvroFixed) -> bool:
    """Whether the writer's named type is the reader's: the same full name, or one of the reader's aliases."""
    return reader.fullname == writer.fullname or writer.fullname in reader.aliases


def _child(path: str, name: str) -> str:
    """The path of ``name`` inside ``path``: ``/`` is the root, ``/a/items`` the items of field a."""
    return f"{path.rstrip('/')}/{name}"


def _kind(schema: AvroSchema) -> str:
    """What ``schema`` is, as a message names it."""
    if isinstance(schema, AvroPrimitive):
        return schema.kind
    if isinstance(schema, (AvroRecord, AvroEnum, AvroFixed)):
        kind = {AvroRecord: "record", AvroEnum: "enum", AvroFixed: "fixed"}[type(schema)]
        return f"{kind} {schema.fullname!r}"
    return {AvroArray: "array", AvroMap: "map", AvroUnion: "union"}[type(schema)]
