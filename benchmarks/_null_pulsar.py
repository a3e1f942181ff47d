"""A Pulsar endpoint that stores nothing: the ceiling of what a Pulsar client can produce here.

Run: ``python benchmarks/_null_pulsar.py``; it prints ``pulsar protocol on pulsar://HOST:PORT``
and serves until killed. It answers what a producer needs (CONNECT, PARTITIONED_METADATA,
LOOKUP, PRODUCER, PING, CLOSE_PRODUCER) and each SEND at once with its receipt, with the same
frame decoder and receipt encoder as ``keyfailover serve --pulsar-port``, checking nothing and
keeping nothing. ``bench_pulsar.py`` produces to it in the same run as to keyfailover, so that the
client's own cost per message is measured beside what the broker adds.
"""

from __future__ import annotations

import asyncio
import itertools

from keyfailover.broker.pulsar import (
    PROTOCOL_VERSION,
    PulsarDecoder,
    PulsarFrame,
    SendFrame,
    encode_command,
    encode_receipt,
)
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    BaseCommand,
    CommandLookupTopicResponse,
    CommandPartitionedTopicMetadataResponse,
)

MAX_FRAME = 5 * 1024 * 1024


class NullPulsar(asyncio.Protocol):
    """One client connection: every SEND answered at once, nothing stored."""

    def __init__(self) -> None:
        self._decoder = PulsarDecoder(MAX_FRAME)
        self._entries = itertools.count()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        frames, error = self._decoder.feed(data)
        out = bytearray()
        for frame in frames:
            if isinstance(frame, SendFrame):
                out += encode_receipt(
                    frame.producer_id, frame.sequence_id, frame.highest_sequence_id, next(self._entries), -1
                )
            else:
                reply = self._reply(frame)
                if reply is not None:
                    out += encode_command(reply)
        if out:
            self._transport.write(bytes(out))
        if error is not None:
            self._transport.close()

    def _reply(self, frame: PulsarFrame) -> BaseCommand | None:
        command = frame.command
        kind = command.type
        if kind == BaseCommand.CONNECT:
            reply = BaseCommand(type=BaseCommand.CONNECTED)
            reply.connected.server_version = "null-pulsar"
            reply.connected.protocol_version = min(command.connect.protocol_version, PROTOCOL_VERSION)
            reply.connected.max_message_size = MAX_FRAME - 10 * 1024
            return reply
        if kind == BaseCommand.PING:
            reply = BaseCommand(type=BaseCommand.PONG)
            reply.pong.SetInParent()
            return reply
        if kind == BaseCommand.PARTITIONED_METADATA:
            reply = BaseCommand(type=BaseCommand.PARTITIONED_METADATA_RESPONSE)
            reply.partitionMetadataResponse.request_id = command.partitionMetadata.request_id
            reply.partitionMetadataResponse.response = CommandPartitionedTopicMetadataResponse.Success
            reply.partitionMetadataResponse.partitions = 0
            return reply
        if kind == BaseCommand.LOOKUP:
            assert self._transport is not None
            host, port = self._transport.get_extra_info("sockname")[:2]
            reply = BaseCommand(type=BaseCommand.LOOKUP_RESPONSE)
            reply.lookupTopicResponse.request_id = command.lookupTopic.request_id
            reply.lookupTopicResponse.response = CommandLookupTopicResponse.Connect
            reply.lookupTopicResponse.brokerServiceUrl = f"pulsar://{host}:{port}"
            reply.lookupTopicResponse.authoritative = True
            return reply
        if kind == BaseCommand.PRODUCER:
            reply = BaseCommand(type=BaseCommand.PRODUCER_SUCCESS)
            reply.producer_success.request_id = command.producer.request_id
            reply.producer_success.producer_name = command.producer.producer_name or "null"
            reply.producer_success.last_sequence_id = -1
            reply.producer_success.producer_ready = True
            return reply
        if kind == BaseCommand.CLOSE_PRODUCER:
            reply = BaseCommand(type=BaseCommand.SUCCESS)
            reply.success.request_id = command.close_producer.request_id
            return reply
        return None


async def serve() -> None:
    server = await asyncio.get_running_loop().create_server(NullPulsar, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"pulsar protocol on pulsar://{host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve())
