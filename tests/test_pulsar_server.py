"""The Pulsar endpoint of a real server, command by command, over a raw connection (what the client never sends)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

from keyfailover.broker.pulsar import PROTOCOL_VERSION, encode_message
from keyfailover.broker.pulsar.PulsarApi_pb2 import (
    LZ4,
    BaseCommand,
    ChecksumError,
    CommandLookupTopicResponse,
    CommandPartitionedTopicMetadataResponse,
    CommandSubscribe,
    ConsumerAssignError,
    ConsumerBusy,
    ConsumerNotFound,
    MessageMetadata,
    NotAllowedError,
    ServiceNotReady,
    UnknownError,
)
from keyfailover.broker.server._pulsar_errors import server_error as _server_error
from keyfailover.broker.storage._store import NotServedError
from keyfailover.core.errors import ConsumerError, ErrorCode, KeyFailoverError, ProtocolError
from keyfailover.core.hashing import key_hash
from keyfailover.core.partitions import partition_slots
from tests.pulsar_wire import RawPulsar, command, connect_command, producer_command, send_frame, subscribe_command
from tests.server_process import ServerProcess
from tests.tiers import starts_processes


@pytest.fixture(scope="module")
@starts_processes
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data: Path = tmp_path_factory.mktemp("pulsar-raw") / "data"
    with ServerProcess(data, "--metrics-port", "0", "--pulsar-port", "0", "--max-frame", "65536") as server:
        yield server


def connected(server: ServerProcess, version: int = 20) -> RawPulsar:
    raw = RawPulsar(server.pulsar_url or "")
    raw.send(connect_command(version=version))
    raw.receive_type(BaseCommand.CONNECTED)
    return raw


def stats(server: ServerProcess) -> dict[str, int]:
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        topics: dict[str, int] = json.loads(response.read())["topics"]
        return topics


@pytest.mark.parametrize(("client", "agreed"), [(13, 13), (20, 20), (99, PROTOCOL_VERSION)])
def test_the_protocol_version_is_the_lower_of_both(server: ServerProcess, client: int, agreed: int) -> None:
    with RawPulsar(server.pulsar_url or "") as raw:
        raw.send(connect_command(version=client))
        answer = raw.receive_type(BaseCommand.CONNECTED).connected
    assert (answer.protocol_version, answer.server_version) == (agreed, "keyfailover")
    assert answer.max_message_size == 65536 - 10 * 1024


def test_a_command_before_connect_closes_the_connection(server: ServerProcess) -> None:
    with RawPulsar(server.pulsar_url or "") as raw:
        raw.send(command(BaseCommand.PING), connect_command())
        assert raw.until_closed() == []


def test_a_frame_over_the_limit_closes_the_connection_before_its_body(server: ServerProcess) -> None:
    with connected(server) as raw:
        raw.send(struct.pack(">I", 65537))
        assert [frame.command.type for frame in raw.until_closed()] in ([], [BaseCommand.PING])


def test_ping_and_partitioned_metadata_and_lookup(server: ServerProcess) -> None:
    created = Request(f"{server.admin_url}/topics?topic=split&partitions=3", method="POST")
    with urlopen(created, timeout=10) as response:
        assert json.loads(response.read())["partitions"] == 3
    with connected(server) as raw:
        raw.send(command(BaseCommand.PING))
        raw.receive_type(BaseCommand.PONG)
        answers = []
        for request_id, topic in enumerate(["persistent://public/default/plain", "persistent://public/default/split"]):
            raw.send(command(BaseCommand.PARTITIONED_METADATA, topic=topic, request_id=request_id))
            answers.append(raw.receive_type(BaseCommand.PARTITIONED_METADATA_RESPONSE).partitionMetadataResponse)
        assert [(a.response, a.partitions) for a in answers] == [
            (CommandPartitionedTopicMetadataResponse.Success, 0),
            (CommandPartitionedTopicMetadataResponse.Success, 3),
        ]
        raw.send(command(BaseCommand.PARTITIONED_METADATA, topic="non-persistent://public/default/t", request_id=9))
        refused = raw.receive_type(BaseCommand.PARTITIONED_METADATA_RESPONSE).partitionMetadataResponse
        assert (refused.response, refused.error) == (CommandPartitionedTopicMetadataResponse.Failed, NotAllowedError)
        raw.send(command(BaseCommand.LOOKUP, topic="persistent://public/default/split-partition-1", request_id=3))
        lookup = raw.receive_type(BaseCommand.LOOKUP_RESPONSE).lookupTopicResponse
        plain = "persistent://public/default/plain"
        raw.send(command(BaseCommand.LOOKUP, topic=plain, request_id=4, advertised_listener_name="external"))
        unnamed = raw.receive_type(BaseCommand.LOOKUP_RESPONSE).lookupTopicResponse
    assert (unnamed.response, unnamed.error) == (CommandLookupTopicResponse.Failed, NotAllowedError)
    assert "no advertised listener 'external'" in unnamed.message
    assert (lookup.response, lookup.authoritative) == (CommandLookupTopicResponse.Connect, True)
    assert lookup.brokerServiceUrl == server.pulsar_url


def test_the_topics_of_a_namespace_are_listed_with_each_partition(server: ServerProcess) -> None:
    """GET_TOPICS_OF_NAMESPACE (a pattern consumer's question): the namespace's topics by their Pulsar names,
    a partitioned topic's partitions each by its own, nothing of other namespaces, none non-persistent."""
    created = Request(f"{server.admin_url}/topics?topic=listed-split&partitions=2", method="POST")
    urlopen(created, timeout=10).close()
    with connected(server) as raw:
        raw.send(producer_command("persistent://public/default/listed", name="lister"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(send_frame(0, b"x", "k"))
        raw.receive_type(BaseCommand.SEND_RECEIPT)
        raw.send(producer_command("persistent://acme/app/listed", producer_id=2, request_id=2, name="lister"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(send_frame(0, b"x", "k", producer_id=2))
        raw.receive_type(BaseCommand.SEND_RECEIPT)
        answers = []
        for request_id, (namespace, mode) in enumerate([("public/default", 0), ("acme/app", 2), ("acme/app", 1)]):
            raw.send(
                command(BaseCommand.GET_TOPICS_OF_NAMESPACE, request_id=request_id, namespace=namespace, mode=mode)
            )
            answer = raw.receive_type(BaseCommand.GET_TOPICS_OF_NAMESPACE_RESPONSE).getTopicsOfNamespaceResponse
            answers.append((answer.request_id, list(answer.topics)))
    default = answers[0][1]
    assert {
        "persistent://public/default/listed",
        "persistent://public/default/listed-split-partition-0",
        "persistent://public/default/listed-split-partition-1",
    } <= set(default)
    assert not [name for name in default if not name.startswith("persistent://public/default/")]
    assert answers[1:] == [(1, ["persistent://acme/app/listed"]), (2, [])]


def test_a_bad_checksum_is_refused_and_stores_nothing(server: ServerProcess) -> None:
    with connected(server) as raw:
        raw.send(producer_command("persistent://public/default/checked", name="checker"))
        assert raw.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success.last_sequence_id == -1
        corrupt = bytearray(send_frame(0, b"payload", "k"))
        corrupt[-1] ^= 0x40
        raw.send(bytes(corrupt))
        error = raw.receive_type(BaseCommand.SEND_ERROR).send_error
        assert (error.error, error.sequence_id) == (ChecksumError, 0)
        assert "nothing was stored" in error.message
        assert "checked" not in stats(server)
        raw.send(send_frame(1, b"payload", "k"))
        receipt = raw.receive_type(BaseCommand.SEND_RECEIPT).send_receipt
    assert (receipt.sequence_id, receipt.message_id.entryId) == (1, 1)
    assert stats(server)["checked"] == 1


def test_a_resent_message_is_stored_once_and_last_sequence_id_comes_back(server: ServerProcess) -> None:
    with connected(server) as raw:
        raw.send(producer_command("persistent://acme/app/dedup", name="resender"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(send_frame(5, b"once", "k"), send_frame(5, b"once", "k"))
        receipts = [raw.receive_type(BaseCommand.SEND_RECEIPT).send_receipt for _ in range(2)]
        assert [r.message_id.entryId for r in receipts] == [1, 1]
    with connected(server) as raw:
        raw.send(producer_command("persistent://acme/app/dedup", name="resender"))
        assert raw.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success.last_sequence_id == 5
    assert stats(server)["acme/app/dedup"] == 1


def test_sends_written_together_are_each_stored_once_in_each_producers_order(server: ServerProcess) -> None:
    """SENDs that arrive in one read are stored in few requests (a producer's SENDs in a row while their
    sequence ids rise); one whose id is below the last (as key-based batching sends them) starts another.
    Each SEND gets its own receipt with the position its message got, and each producer's messages are
    stored in the order it sent them."""
    topic = "persistent://acme/app/together"
    sent = [(1, 10), (2, 1), (1, 11), (1, 5), (2, 2), (1, 12)]  # (producer id, sequence id)
    with connected(server) as raw:
        raw.send(producer_command(topic, producer_id=1, request_id=1, name="one"))
        raw.send(producer_command(topic, producer_id=2, request_id=2, name="two"))
        for _ in range(2):
            raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(
            *(send_frame(seq, f"{producer}/{seq}".encode(), f"k{seq}", producer_id=producer) for producer, seq in sent)
        )
        receipts = [raw.receive_type(BaseCommand.SEND_RECEIPT).send_receipt for _ in sent]
        raw.send(send_frame(11, b"again", "k11", producer_id=1))
        again = raw.receive_type(BaseCommand.SEND_RECEIPT).send_receipt
    position = {(r.producer_id, r.sequence_id): r.message_id.entryId for r in receipts}
    assert sorted(position) == sorted(sent)
    assert sorted(position.values()) == list(range(1, len(sent) + 1))
    for producer in (1, 2):
        mine = [position[producer, seq] for p, seq in sent if p == producer]
        assert mine == sorted(mine), f"producer {producer}'s messages stored out of its order"
    assert again.message_id.entryId == position[1, 11]
    assert stats(server)["acme/app/together"] == len(sent)


def test_a_key_of_another_partition_fails_its_send_only(server: ServerProcess) -> None:
    """SENDs checked together (one read, one producer): when one message's key belongs to another
    partition, that SEND alone is refused for good with why, between the receipts of the SENDs before and
    after it, and the others are stored."""
    created = Request(f"{server.admin_url}/topics?topic=halves&partitions=2", method="POST")
    with urlopen(created, timeout=10):
        pass
    first, last = partition_slots(0, 2)
    keys = [f"k{i}" for i in range(100)]
    mine = [key for key in keys if first <= key_hash(key) <= last][:2]
    other = next(key for key in keys if not first <= key_hash(key) <= last)
    with connected(server) as raw:
        raw.send(producer_command("persistent://public/default/halves-partition-0", name="halves"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(send_frame(0, b"a", mine[0]), send_frame(1, b"b", other), send_frame(2, b"c", mine[1]))
        answers = [raw.receive() for _ in range(3)]
    assert [frame.command.type for frame in answers] == [
        BaseCommand.SEND_RECEIPT,
        BaseCommand.SEND_ERROR,
        BaseCommand.SEND_RECEIPT,
    ]
    refused = [frame.command.send_error for frame in answers if frame.command.type == BaseCommand.SEND_ERROR]
    receipts = [frame.command.send_receipt for frame in answers if frame.command.type == BaseCommand.SEND_RECEIPT]
    assert [(error.sequence_id, error.error) for error in refused] == [(1, ChecksumError)]  # final: not resent
    assert "message 0's key" in refused[0].message and "nothing was stored" in refused[0].message
    assert [(r.sequence_id, r.message_id.entryId, r.message_id.partition) for r in receipts] == [(0, 1, 0), (2, 2, 0)]
    assert stats(server)["halves-partition-0"] == 2


def test_a_connection_may_open_a_thousand_producers_and_no_more(server: ServerProcess) -> None:
    with connected(server) as raw:
        topic = "persistent://public/default/crowded"
        raw.send(*(producer_command(topic, producer_id=i, request_id=i, name=f"p{i}") for i in range(1000)))
        for _ in range(1000):
            raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(producer_command(topic, producer_id=1000, request_id=1000, name="one-more"))
        error = raw.receive_type(BaseCommand.ERROR).error
        assert error.request_id == 1000 and error.error == NotAllowedError
        assert "1000 producers open" in error.message
        raw.send(command(BaseCommand.PING))
        raw.receive_type(BaseCommand.PONG)  # the connection goes on


def test_a_consumer_id_open_as_a_reader_is_busy_for_a_durable_subscription(server: ServerProcess) -> None:
    topic = "persistent://public/default/idclash"
    with connected(server) as raw:
        reader = subscribe_command(topic, request_id=1, consumer="reader")
        reader.subscribe.durable = False
        reader.subscribe.subType = CommandSubscribe.Exclusive
        raw.send(reader)
        assert raw.receive_type(BaseCommand.SUCCESS).success.request_id == 1
        raw.send(subscribe_command(topic, request_id=2, consumer="durable"))  # the same consumer id, 1
        busy = raw.receive_type(BaseCommand.ERROR).error
    assert (busy.request_id, busy.error) == (2, ConsumerBusy)
    assert "as a reader" in busy.message


def test_unsubscribe_ends_a_reader_and_an_unknown_consumer_is_not_found(server: ServerProcess) -> None:
    with connected(server) as raw:
        reader = subscribe_command("persistent://public/default/readgone", request_id=1, consumer="reader")
        reader.subscribe.durable = False
        reader.subscribe.subType = CommandSubscribe.Exclusive
        raw.send(reader)
        raw.receive_type(BaseCommand.SUCCESS)
        raw.send(command(BaseCommand.UNSUBSCRIBE, consumer_id=1, request_id=2))
        assert raw.receive_type(BaseCommand.SUCCESS).success.request_id == 2
        raw.send(command(BaseCommand.UNSUBSCRIBE, consumer_id=1, request_id=3))
        error = raw.receive_type(BaseCommand.ERROR).error
    assert (error.request_id, error.error) == (3, ConsumerNotFound)


def test_a_payload_that_does_not_decompress_is_refused_for_good_after_the_receipts_before_it(
    server: ServerProcess,
) -> None:
    """A corrupt LZ4 payload is refused with ChecksumError (the client fails that send, where any other SEND_ERROR
    makes it resend for ever), answered after the receipt of the SEND before it (the client matches answers to
    its oldest pending message), and nothing of it is stored."""
    corrupt = MessageMetadata(producer_name="z", sequence_id=1, publish_time=1, compression=LZ4, uncompressed_size=9)
    with connected(server) as raw:
        raw.send(producer_command("persistent://public/default/zipped", name="zipper"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        send = command(BaseCommand.SEND, producer_id=1, sequence_id=1)
        raw.send(send_frame(0, b"plain", "k"), encode_message(send, corrupt.SerializeToString(), b"\xf0lz4?"))
        first, second = raw.receive(), raw.receive()
    assert (first.command.type, first.command.send_receipt.sequence_id) == (BaseCommand.SEND_RECEIPT, 0)
    error = second.command.send_error
    assert (second.command.type, error.sequence_id, error.error) == (BaseCommand.SEND_ERROR, 1, ChecksumError)
    assert "is not valid LZ4 data" in error.message and "nothing was stored" in error.message
    assert stats(server)["zipped"] == 1


def chunk_frame(chunk_id: int, chunks: int = 2) -> bytes:
    """A SEND of chunk ``chunk_id`` of message 0 of producer ``c``, as a client sends it."""
    metadata = MessageMetadata(
        producer_name="c", sequence_id=0, publish_time=1, uuid="c-0", chunk_id=chunk_id, num_chunks_from_msg=chunks
    )
    send = command(BaseCommand.SEND, producer_id=1, sequence_id=0, is_chunk=True)
    return encode_message(send, metadata.SerializeToString(), f"part {chunk_id}".encode())


def test_chunks_are_stored_as_they_came_and_a_resent_last_chunk_once(server: ServerProcess) -> None:
    """Every chunk of a message carries its sequence id: the last one is stored under it (its resend is a
    duplicate), the others without it; a SEND flagged as a chunk of a one-chunk message is refused for good."""
    with connected(server) as raw:
        raw.send(producer_command("persistent://public/default/chunks", name="c"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(chunk_frame(0), chunk_frame(1), chunk_frame(1))
        receipts = [raw.receive_type(BaseCommand.SEND_RECEIPT).send_receipt for _ in range(3)]
        raw.send(chunk_frame(0, chunks=1))
        error = raw.receive_type(BaseCommand.SEND_ERROR).send_error
    assert [(r.sequence_id, r.message_id.entryId) for r in receipts] == [(0, 1), (0, 2), (0, 2)]
    assert (error.error, error.sequence_id) == (ChecksumError, 0)
    assert "flagged as a chunk" in error.message
    assert stats(server)["chunks"] == 2


def test_properties_over_the_limits_are_refused_and_store_nothing(server: ServerProcess) -> None:
    """One message of a SEND with too many properties: the SEND is refused whole, for good (ChecksumError: the
    client fails that send); a SEND with properties within the limits beside it is stored."""
    too_many = MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    for index in range(129):
        too_many.properties.add(key=f"k{index}", value="v")
    within = MessageMetadata(producer_name="p", sequence_id=1, publish_time=1, event_time=7)
    within.properties.add(key="k", value="v")
    with connected(server) as raw:
        raw.send(producer_command("persistent://public/default/tagged", name="tagger"))
        raw.receive_type(BaseCommand.PRODUCER_SUCCESS)
        raw.send(
            encode_message(command(BaseCommand.SEND, producer_id=1, sequence_id=0), too_many.SerializeToString(), b"x"),
            encode_message(command(BaseCommand.SEND, producer_id=1, sequence_id=1), within.SerializeToString(), b"y"),
        )
        error = raw.receive_type(BaseCommand.SEND_ERROR).send_error
        receipt = raw.receive_type(BaseCommand.SEND_RECEIPT).send_receipt
    assert (error.sequence_id, error.error) == (0, ChecksumError)
    assert "129 properties are over the limit of 128 per message; nothing was stored" in error.message
    assert (receipt.sequence_id, receipt.message_id.entryId) == (1, 1)
    assert stats(server)["tagged"] == 1


def test_an_unsupported_command_is_answered_and_the_connection_goes_on(server: ServerProcess) -> None:
    with connected(server) as raw:
        raw.send(command(BaseCommand.NEW_TXN, request_id=77), command(BaseCommand.PING))
        error = raw.receive_type(BaseCommand.ERROR).error
        raw.receive_type(BaseCommand.PONG)
    assert (error.request_id, error.error) == (77, NotAllowedError)
    assert "NEW_TXN is not supported" in error.message


def test_no_traceback_in_the_server_log(server: ServerProcess) -> None:
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.errors(), server.errors()


@pytest.mark.integration
def test_a_silent_consumer_times_out_and_is_told_and_one_that_answers_pings_stays(tmp_path: Path) -> None:
    """The server PINGs a quiet client; one that answers keeps its session, one that does not is closed."""
    with (
        ServerProcess(tmp_path / "data", "--pulsar-port", "0", "--session-timeout", "1") as short,
        connected(short) as answering,
        connected(short) as silent,
    ):
        for raw, name in ((answering, "answering"), (silent, "silent")):
            raw.send(subscribe_command("persistent://public/default/quiet", consumer=name))
            assert raw.receive().command.type == BaseCommand.SUCCESS
        for _ in range(6):  # two session timeouts' worth of keepalives, each answered at once
            frame = answering.receive()
            assert frame.command.type == BaseCommand.PING, frame.command
            answering.send(command(BaseCommand.PONG))
        closed = silent.receive_type(BaseCommand.CLOSE_CONSUMER).close_consumer
        assert closed.consumer_id == 1


@pytest.mark.integration
def test_a_repeated_producer_or_subscribe_is_answered_as_the_first_and_a_taken_consumer_name_is_busy(
    server: ServerProcess,
) -> None:
    topic = "persistent://public/default/repeats"
    with connected(server) as raw, connected(server) as other:
        raw.send(
            producer_command(topic, request_id=1, name="again"), producer_command(topic, request_id=2, name="again")
        )
        answers = [raw.receive_type(BaseCommand.PRODUCER_SUCCESS).producer_success for _ in range(2)]
        assert [(a.request_id, a.producer_name) for a in answers] == [(1, "again"), (2, "again")]
        raw.send(subscribe_command(topic, request_id=3, consumer="one"))
        assert raw.receive_type(BaseCommand.SUCCESS).success.request_id == 3
        raw.send(subscribe_command(topic, request_id=4, consumer="one"))
        assert raw.receive_type(BaseCommand.SUCCESS).success.request_id == 4
        other.send(subscribe_command(topic, request_id=5, consumer="one"))
        busy = other.receive_type(BaseCommand.ERROR).error
    assert (busy.request_id, busy.error) == (5, ConsumerBusy)
    assert "has a live session" in busy.message


def test_each_refusal_is_the_pulsar_error_a_client_acts_on() -> None:
    """A partition that moved away while a request was served (the store fenced the write) is
    ServiceNotReady, on which the client looks the topic up again, as for a broker not serving it."""
    assert _server_error(NotServedError("moved")) == (ServiceNotReady, "moved")
    assert _server_error(ProtocolError(ErrorCode.NOT_OWNER, "elsewhere")) == (ServiceNotReady, "elsewhere")
    assert _server_error(ConsumerError("overlap")) == (ConsumerAssignError, "overlap")
    assert _server_error(KeyFailoverError("other")) == (UnknownError, "other")
