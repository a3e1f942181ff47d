"""A raw Pulsar protocol connection for the tests: commands built by hand, for what the real client never sends.

:class:`RawPulsar` writes any bytes or commands to a server's ``--pulsar-port`` and decodes
what it answers with the same :class:`PulsarDecoder` the server uses, every read bounded by
a timeout. The ``*_command`` helpers build the few commands the tests send. :func:`client` opens the
official client the other way, quiet but for errors.
"""

from __future__ import annotations

import contextlib
import socket
from collections import deque
from collections.abc import Iterator
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import pulsar

from keyfailover.broker.pulsar import PulsarDecoder, PulsarFrame, encode_command, encode_message
from keyfailover.broker.pulsar.PulsarApi_pb2 import BaseCommand, CommandSubscribe, KeySharedMode, MessageMetadata

__all__ = [
    "QUIET",
    "RawPulsar",
    "client",
    "command",
    "connect_command",
    "producer_command",
    "send_frame",
    "subscribe_command",
]


QUIET = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)
"""The official client's logger in the tests: errors only."""


@contextlib.contextmanager
def client(url: str | None, token: str | None = None, timeout: int = 10) -> Iterator[pulsar.Client]:
    """An official Pulsar client of ``url`` (with ``token``), closed at the end."""
    assert url is not None
    auth = None if token is None else pulsar.AuthenticationToken(token)
    opened = pulsar.Client(url, authentication=auth, operation_timeout_seconds=timeout, logger=QUIET)
    try:
        yield opened
    finally:
        opened.close()


def command(kind: int, **fields: Any) -> BaseCommand:
    """A BaseCommand of ``kind`` whose body has ``fields`` (an empty body when none are given)."""
    built = BaseCommand(type=kind)  # type: ignore[arg-type]
    name = next(
        f.name
        for f in BaseCommand.DESCRIPTOR.fields
        if f.message_type is not None and f.number == kind  # a body's field number is its command type
    )
    body = getattr(built, name)
    body.SetInParent()
    for key, value in fields.items():
        setattr(body, key, value)
    return built


def connect_command(token: str | None = None, version: int = 20) -> BaseCommand:
    built = command(BaseCommand.CONNECT, client_version="tests raw", protocol_version=version)
    if token is not None:
        built.connect.auth_method_name = "token"
        built.connect.auth_data = token.encode()
    return built


def producer_command(topic: str, producer_id: int = 1, request_id: int = 1, name: str = "raw") -> BaseCommand:
    return command(
        BaseCommand.PRODUCER, topic=topic, producer_id=producer_id, request_id=request_id, producer_name=name
    )


def subscribe_command(
    topic: str, sub_type: int = CommandSubscribe.Key_Shared, request_id: int = 2, consumer: str = "raw"
) -> BaseCommand:
    return command(
        BaseCommand.SUBSCRIBE,
        topic=topic,
        subscription="raw",
        subType=sub_type,
        consumer_id=1,
        request_id=request_id,
        consumer_name=consumer,
    )


def sticky_subscribe(
    topic: str, ranges: list[tuple[int, int]], consumer: str, *, consumer_id: int = 1, request_id: int = 1
) -> BaseCommand:
    """A Key_Shared STICKY SUBSCRIBE of ``topic``'s subscription "raw" declaring ``ranges``."""
    built = subscribe_command(topic, request_id=request_id, consumer=consumer)
    built.subscribe.consumer_id = consumer_id
    built.subscribe.keySharedMeta.keySharedMode = KeySharedMode.STICKY
    for start, end in ranges:
        built.subscribe.keySharedMeta.hashRanges.add(start=start, end=end)
    return built


def send_frame(sequence_id: int, payload: bytes, key: str | None = None, *, producer_id: int = 1) -> bytes:
    """A SEND of one message with a correct checksum."""
    metadata = MessageMetadata(producer_name="raw", sequence_id=sequence_id, publish_time=1)
    if key is not None:
        metadata.partition_key = key
    send = command(BaseCommand.SEND, producer_id=producer_id, sequence_id=sequence_id)
    return encode_message(send, metadata.SerializeToString(), payload)


class RawPulsar:
    """A plain TCP connection to a Pulsar endpoint (``pulsar://HOST:PORT``)."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        address = urlsplit(url)
        assert address.hostname is not None and address.port is not None, url
        self.sock = socket.create_connection((address.hostname, address.port), timeout=timeout)
        self._decoder = PulsarDecoder(64 * 1024 * 1024)
        self._frames: deque[PulsarFrame] = deque()
        self.eof = False

    def send(self, *items: BaseCommand | bytes) -> None:
        """Write commands (framed) and raw bytes, in order, in one ``sendall``."""
        self.sock.sendall(b"".join(item if isinstance(item, bytes) else encode_command(item) for item in items))

    def receive(self) -> PulsarFrame:
        """The next frame; :class:`EOFError` when the server closed the connection first."""
        while not self._frames:
            if self.eof or not self._read():
                raise EOFError("the server closed the connection")
        return self._frames.popleft()

    def receive_type(self, kind: int) -> BaseCommand:
        """The next command of type ``kind``, skipping others (a keepalive PING)."""
        while True:
            frame = self.receive()
            if frame.command.type == kind:
                return frame.command

    def until_closed(self) -> list[PulsarFrame]:
        """Every frame still to come, once the server closed the connection."""
        while not self.eof:
            self._read()
        frames = list(self._frames)
        self._frames.clear()
        return frames

    def half_close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def _read(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        frames, error = self._decoder.feed(data)
        if error is not None:
            raise error
        for frame in frames:
            assert isinstance(frame, PulsarFrame), f"the server sent a SEND: {frame}"
            self._frames.append(frame)
        return True

    def __enter__(self) -> RawPulsar:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.sock.close()
