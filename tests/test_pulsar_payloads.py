"""What a Pulsar payload carries, through a real ``keyfailover serve --pulsar-port`` and the real ``pulsar-client``:
compressed messages and batches of every codec, encrypted ones end to end, chunked ones reassembled by the
consumer, and a refusal the client takes as final (its ``send()`` raises instead of resending for ever)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pulsar
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from keyfailover.broker.pulsar import PULSAR_METADATA_PROPERTY
from keyfailover.client import Client
from tests.pulsar_wire import client
from tests.server_process import ServerProcess, wait_until
from tests.test_pulsar_client import stored

pytestmark = pytest.mark.integration  # a server in a process of its own

MAX_FRAME = 256 * 1024
"""The server's ``--max-frame``: its max message size is this less 10 KiB, so a chunk or a large message is cheap."""
MAX_MESSAGE = MAX_FRAME - 10 * 1024
CODECS = ["LZ4", "ZLib", "ZSTD", "SNAPPY"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("pulsar-payloads") / "data"
    with ServerProcess(data, "--metrics-port", "0", "--pulsar-port", "0", "--max-frame", str(MAX_FRAME)) as server:
        yield server


def received(
    consumer: pulsar.Consumer, count: int, names: set[str] | None = None
) -> list[tuple[str, bytes, dict[str, str]]]:
    """``count`` messages of ``consumer`` (acked): each one's key, payload and properties, in delivery order; their
    producer names added to ``names`` when given."""
    got = []
    for _ in range(count):
        message = consumer.receive(timeout_millis=10_000)
        got.append((message.partition_key(), message.data(), message.properties()))
        if names is not None:
            names.add(message.producer_name())
        consumer.acknowledge(message)
    return got


def in_key_order(got: list[tuple[str, bytes, dict[str, str]]]) -> dict[str, list[bytes]]:
    """Each key's payloads in the order they came."""
    keys: dict[str, list[bytes]] = {}
    for key, payload, _ in got:
        keys.setdefault(key, []).append(payload)
    return keys


@pytest.mark.parametrize("batching", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("codec", CODECS)
def test_compressed_messages_come_back_as_sent_each_key_in_order(
    server: ServerProcess, codec: str, batching: bool
) -> None:
    """A compressed message or batch is decompressed and split on arrival: a Key_Shared consumer gets each
    message with its key and properties, each key in order, and a native consumer reads the same payloads."""
    topic = f"compressed-{codec}-{batching}"
    sent = {f"k{key}": [f"{codec} {index} ".encode() * (1 + index % 50) for index in range(12)] for key in range(5)}
    with client(server.pulsar_url) as pc, Client(server.url, connect_timeout=5.0) as kc:
        consumer = pc.subscribe(topic, "check", consumer_type=pulsar.ConsumerType.KeyShared)
        native = kc.subscribe(topic, "native", "native")
        producer = pc.create_producer(
            topic, compression_type=getattr(pulsar.CompressionType, codec), batching_enabled=batching
        )
        for index in range(12):
            for key, payloads in sent.items():
                producer.send_async(payloads[index], None, partition_key=key, properties={"i": str(index)})
        producer.flush()
        got = received(consumer, 60)
        natively = [native.receive(timeout=10) for _ in range(60)]
    assert in_key_order(got) == sent
    assert all(properties == {"i": str(sent[key].index(payload))} for key, payload, properties in got)
    assert sorted(message.payload for message in natively) == sorted(p for payloads in sent.values() for p in payloads)


def test_a_compressed_message_larger_than_the_max_message_size_uncompressed_fails_its_send(
    server: ServerProcess,
) -> None:
    """Consumers get messages uncompressed, so one must fit uncompressed: between two that fit, the client's
    send of it fails at once (ChecksumError, the one refusal it does not resend, answered after the receipt
    before it), and the producer goes on."""
    topic = "too-large-uncompressed"
    results: list[pulsar.Result] = []
    with client(server.pulsar_url) as pc:
        producer = pc.create_producer(topic, compression_type=pulsar.CompressionType.LZ4)
        for payload in (b"before", b"\0" * (MAX_MESSAGE + 1), b"after"):
            producer.send_async(payload, lambda result, _: results.append(result), partition_key="k")
        wait_until(lambda: len(results) == 3, "the three sends' results")
        with pytest.raises(pulsar.ChecksumError):
            producer.send(b"\0" * (MAX_MESSAGE + 1), partition_key="k")
        reader = pc.create_reader(topic, pulsar.MessageId.earliest)
        read = [reader.read_next(timeout_millis=10_000).data() for _ in range(2)]
    assert results == [pulsar.Result.Ok, pulsar.Result.ChecksumError, pulsar.Result.Ok]
    assert read == [b"before", b"after"]
    assert stored(server, topic) == 2


@pytest.fixture(scope="module")
def rsa_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """An RSA key pair made for the test, as PEM files: the public key's path and the private key's."""
    folder = tmp_path_factory.mktemp("keys")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public, private = folder / "public.pem", folder / "private.pem"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    return str(public), str(private)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("single", {}),
        ("zstd", {"compression_type": pulsar.CompressionType.ZSTD}),
        ("key-based-batches", {"batching_enabled": True, "batching_type": pulsar.BatchingType.KeyBased}),
        ("lz4-batches", {"batching_enabled": True, "compression_type": pulsar.CompressionType.LZ4}),
    ],
)
def test_an_encrypted_message_is_carried_to_a_consumer_that_decrypts_it(
    server: ServerProcess, rsa_keys: tuple[str, str], name: str, options: dict[str, object]
) -> None:
    """End to end encryption: the server stores the ciphertext and the producer's encryption keys untouched and
    gives both back, so a consumer with the private key reads every message, each key in order; the log holds
    no plaintext."""
    topic = f"encrypted-{name}"
    reader = pulsar.CryptoKeyReader(*rsa_keys)
    sent = {f"k{key}": [f"secret {key}/{index}".encode() for index in range(10)] for key in range(3)}
    with client(server.pulsar_url) as pc, Client(server.url, connect_timeout=5.0) as kc:
        consumer = pc.subscribe(topic, "check", consumer_type=pulsar.ConsumerType.KeyShared, crypto_key_reader=reader)
        native = kc.subscribe(topic, "native", "native")
        producer = pc.create_producer(topic, encryption_key="test-key", crypto_key_reader=reader, **options)
        for index in range(10):
            for key, payloads in sent.items():
                producer.send_async(payloads[index], None, partition_key=key, properties={"plain": "yes"})
        producer.flush()
        got = received(consumer, 30)
        stored = native.receive(timeout=10)
    assert in_key_order(got) == sent
    assert all(properties == {"plain": "yes"} for _, _, properties in got)
    assert b"secret" not in stored.payload
    assert PULSAR_METADATA_PROPERTY in stored.properties  # a batch's own properties are inside its ciphertext


@pytest.mark.parametrize("name", ["plain", "lz4", "encrypted"])
def test_chunked_messages_are_reassembled_by_the_consumer_each_key_in_order(
    server: ServerProcess, rsa_keys: tuple[str, str], name: str
) -> None:
    """Messages over the max message size go in chunks: each chunk is stored as it came (compressed or encrypted
    as the client made it) under the message's key, or its uuid when it has none, so a Key_Shared consumer
    gets every chunk of a message in order and reassembles it; a keyless one comes back keyless. The message comes
    back under its producer's name, which its last chunk carries (a keyless message's other chunks are stored
    without it)."""
    topic = f"chunked-{name}"
    keys = ["a", None, "b", "a"]
    payloads = [bytes([index]) * 7 + os.urandom(MAX_MESSAGE * 2 + index) for index in range(len(keys))]
    crypto = pulsar.CryptoKeyReader(*rsa_keys) if name == "encrypted" else None
    options: dict[str, object] = {"chunking_enabled": True, "batching_enabled": False}
    if name == "lz4":
        options["compression_type"] = pulsar.CompressionType.LZ4
    if crypto is not None:
        options |= {"encryption_key": "test-key", "crypto_key_reader": crypto}
    with client(server.pulsar_url) as pc:
        consumer = pc.subscribe(topic, "check", consumer_type=pulsar.ConsumerType.KeyShared, crypto_key_reader=crypto)
        producer = pc.create_producer(topic, producer_name="billing", **options)
        for key, payload in zip(keys, payloads, strict=True):
            producer.send(payload, partition_key=key)
        names: set[str] = set()
        got = received(consumer, len(keys), names)
    assert names == {"billing"}
    assert sorted(got) == sorted(zip([key or "" for key in keys], payloads, [{}] * len(keys), strict=True))
    assert [payload for key, payload, _ in got if key == "a"] == [payloads[0], payloads[3]]
    assert stored(server, topic) > 2 * len(keys)  # in chunks
