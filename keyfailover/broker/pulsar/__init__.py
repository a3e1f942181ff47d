"""Apache Pulsar's binary protocol (sans-IO): frames, checksums, topic names and the vendored protobuf classes.

``PulsarApi.proto`` is Apache Pulsar's own (Apache License 2.0, its notice kept in the file),
copied unchanged from apache/pulsar-client-cpp ``proto/PulsarApi.proto`` at commit 1d08b2b3
(2026-07-21; the C++ client's copy of pulsar-common/src/main/proto/PulsarApi.proto, which the
Python wheel bundles). ``PulsarApi_pb2.py`` and its typed stub ``PulsarApi_pb2.pyi`` are
generated from it by ``scripts/pulsar-proto``. The server's adapter to keyfailover's subscriptions lives in
``keyfailover.broker.server._pulsar``; docs/pulsar.md says what is supported.
"""

from keyfailover.broker.pulsar._codec import (
    MAX_FRAME_PADDING,
    PROTOCOL_VERSION,
    SERVER_NAME,
    MessageFields,
    PulsarDecoder,
    PulsarFrame,
    PulsarFrameError,
    SendFrame,
    SentMessage,
    SingleFields,
    crc32c,
    encode_command,
    encode_delivery,
    encode_message,
    parse_message,
    split_batch,
)
from keyfailover.broker.pulsar._compression import decompress
from keyfailover.broker.pulsar._properties import (
    EVENT_TIME_PROPERTY,
    NULL_VALUE_PROPERTY,
    PARTITION_KEY_B64_PROPERTY,
    PARTITION_KEY_PROPERTY,
    PULSAR_METADATA_PROPERTY,
    SCHEMA_VERSION_PROPERTY,
    PulsarMetadata,
    from_pulsar,
    to_pulsar,
)
from keyfailover.broker.pulsar._topics import TopicNameError, keyfailover_topic, pulsar_topic
from keyfailover.broker.pulsar._wire import encode_receipt

__all__ = [
    "EVENT_TIME_PROPERTY",
    "MAX_FRAME_PADDING",
    "NULL_VALUE_PROPERTY",
    "PARTITION_KEY_B64_PROPERTY",
    "PARTITION_KEY_PROPERTY",
    "PROTOCOL_VERSION",
    "PULSAR_METADATA_PROPERTY",
    "SCHEMA_VERSION_PROPERTY",
    "SERVER_NAME",
    "MessageFields",
    "PulsarDecoder",
    "PulsarFrame",
    "PulsarFrameError",
    "PulsarMetadata",
    "SendFrame",
    "SentMessage",
    "SingleFields",
    "TopicNameError",
    "crc32c",
    "decompress",
    "encode_command",
    "encode_delivery",
    "encode_message",
    "encode_receipt",
    "from_pulsar",
    "keyfailover_topic",
    "parse_message",
    "pulsar_topic",
    "split_batch",
    "to_pulsar",
]
