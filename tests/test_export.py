"""``keyfailover export``: a topic of a real server's log to Parquet and JSON lines, while it runs and after."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from keyfailover.broker.storage.records import publish_clock
from keyfailover.broker.storage.sqlite import Log, LogSnapshot
from keyfailover.client import Client
from keyfailover.core.errors import InvalidKeyError, LogError, LogFileError
from keyfailover.integrations.export import export_topic
from keyfailover.tools.cli import main
from tests.server_process import ServerProcess
from tests.tiers import starts_processes

Sent = dict[int, tuple[str | bytes | None, bytes, str, dict[str, str]]]
"""position -> (key, payload, producer name, properties)."""
Windows = dict[int, tuple[int, int]]
"""position -> the broker clock (µs since the epoch) just before its send and just after its receipt."""
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def micros(moment: dt.datetime) -> int:
    return (moment - EPOCH) // dt.timedelta(microseconds=1)


def in_window(windows: Windows, position: int, publish_time: int | None) -> bool:
    """Whether a message's publish time lies between its send and its receipt (the same machine's clock)."""
    before, after = windows[position]
    return publish_time is not None and before <= publish_time <= after


def produce(url: str, windows: Windows) -> Sent:
    """Messages with text, binary (UTF-8 and not) and no keys, from two named producers, on topic ``orders``,
    every third with properties; each one's send window goes in ``windows``."""
    sent: Sent = {}
    with Client(url) as client:
        other = client.create_producer("other-topic", "p-other")
        other.send(b"elsewhere", key="k")
        producers = [client.create_producer("orders", name) for name in ("p-1", "p-2")]
        keys: list[str | bytes | None] = ["acct-7", "ünïcode-键", None, b"raw-bytes", "", "acct-7"]
        for index in range(60):
            producer = producers[index % 2]
            key = keys[index % len(keys)]
            payload = f"payload {index}".encode() + bytes([index, 0, 255])
            properties = {"trace": f"t-{index}", "ünï": "cödé\x00"} if index % 3 == 0 else {}
            before = publish_clock()
            position = producer.send(payload, key=key, properties=properties)
            windows[position] = (before, publish_clock())
            sent[position] = (key, payload, producer.producer_name, properties)
    return sent


def text(key: str | bytes | None) -> str | None:
    return key.decode() if isinstance(key, bytes) else key


@pytest.fixture(scope="module")
@starts_processes
def server_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Sent, ServerProcess, Windows]]:
    """A running server with messages on ``orders``; the tests below run in order and the last one stops it."""
    data = tmp_path_factory.mktemp("export") / "data"
    server = ServerProcess(data).start()
    windows: Windows = {}
    try:
        yield data, produce(server.url, windows), server, windows
    finally:
        server.stop()


def test_parquet_export_while_the_server_runs(
    server_data: tuple[Path, Sent, ServerProcess, Windows], tmp_path: Path
) -> None:
    data, sent, server, windows = server_data
    assert server.process is not None and server.process.poll() is None
    result = export_topic(data, "orders", tmp_path / "out", "parquet")
    assert result.files == [tmp_path / "out" / "part-00000.parquet"]
    assert (result.messages, result.first_position, result.last_position) == (60, min(sent), max(sent))
    table = pq.read_table(tmp_path / "out")
    assert table.schema.names == ["position", "key", "payload", "producer", "seq", "publish_time", "properties"]
    assert str(table.schema.field("publish_time").type) == "timestamp[us, tz=UTC]"
    map_type = table.schema.field("properties").type  # Spark's map<string, string>
    assert (str(map_type.key_type), str(map_type.item_type)) == ("string", "string")
    assert not table.schema.field("properties").nullable  # a message without properties has an empty map
    rows = table.to_pylist()
    assert all(in_window(windows, row["position"], micros(row["publish_time"])) for row in rows)
    assert [row["position"] for row in rows] == sorted(sent)
    assert {
        row["position"]: (row["key"], row["payload"], row["producer"], dict(row["properties"])) for row in rows
    } == {
        position: (text(key), payload, producer, properties)
        for position, (key, payload, producer, properties) in sent.items()
    }
    for name in ("p-1", "p-2"):
        seqs = [row["seq"] for row in rows if row["producer"] == name]
        assert len(seqs) == 30 and seqs == sorted(set(seqs))


def test_jsonl_export_with_binary_keys_in_files_of_a_given_size(
    server_data: tuple[Path, Sent, ServerProcess, Windows], tmp_path: Path
) -> None:
    data, sent, _, windows = server_data
    result = export_topic(data, "orders", tmp_path / "out", "jsonl", binary_keys=True, rows_per_file=25)
    assert [path.name for path in result.files] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    lines = [json.loads(line) for path in result.files for line in path.read_text(encoding="utf-8").splitlines()]
    assert [len(path.read_text(encoding="utf-8").splitlines()) for path in result.files] == [25, 25, 10]
    got = {
        line["position"]: (
            None if line["key"] is None else base64.b64decode(line["key"]),
            base64.b64decode(line["payload"]),
            line["producer"],
            line["properties"],
        )
        for line in lines
    }
    assert got == {
        position: (key.encode() if isinstance(key, str) else key, payload, producer, properties)
        for position, (key, payload, producer, properties) in sent.items()
    }
    # ISO 8601 UTC to the microsecond: the same instant as the Parquet column
    assert all(line["publish_time"].endswith("Z") for line in lines)
    stamps = {line["position"]: micros(dt.datetime.fromisoformat(line["publish_time"])) for line in lines}
    assert all(in_window(windows, position, at) for position, at in stamps.items())


@pytest.mark.integration
def test_cli_export_after_the_server_stopped(
    server_data: tuple[Path, Sent, ServerProcess, Windows], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, sent, server, _ = server_data
    assert server.stop() == 0
    assert not (data / "keyfailover.db-wal").exists()  # closed cleanly: a reader must cope without the WAL files
    log_bytes = (data / "keyfailover.db").read_bytes()
    out = tmp_path / "out"
    assert main(["export", "--data-dir", str(data), "--topic", "orders", "--format", "jsonl", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"exported 60 messages of 'orders' (positions {min(sent)}..{max(sent)}): 1 file(s)" in printed
    lines = [json.loads(line) for line in (out / "part-00000.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(line["position"], line["key"]) for line in lines] == [
        (position, text(key)) for position, (key, _, _, _) in sorted(sent.items())
    ]
    assert (data / "keyfailover.db").read_bytes() == log_bytes  # read only: the log is unchanged
    assert (data / "keyfailover.db-wal").stat().st_size == 0


@pytest.mark.integration
def test_export_errors_say_what_was_expected(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with pytest.raises(LogFileError, match="no keyfailover log"):
        export_topic(data, "orders", tmp_path / "out")
    with ServerProcess(data) as server, Client(server.url) as client:
        producer = client.create_producer("orders", "p")
        producer.send(b"x", key="text")
        producer.send(b"y", key=b"\xff\xfe")
    with pytest.raises(LogError, match=r"topic 'nope' is not in the log; expected one of \['orders'\]"):
        export_topic(data, "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidKeyError, match="at position 2 is not UTF-8 text; export with binary keys"):
        export_topic(data, "orders", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written is left
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(LogFileError, match="is not empty"):
        export_topic(data, "orders", busy)
    with pytest.raises(LogError, match="format must be 'parquet' or 'jsonl'"):
        export_topic(data, "orders", tmp_path / "csv", "csv")  # type: ignore[arg-type]
    assert export_topic(data, "orders", tmp_path / "binary", binary_keys=True).messages == 2


def test_a_snapshot_reads_what_was_committed_when_it_was_made(tmp_path: Path) -> None:
    """Later appends stay out, however the reads are cut into chunks and transactions."""
    path = tmp_path / "log.db"
    with Log(path) as log:
        log.append([("t", "p", [(seq, f"k{seq % 3}", b"x%d" % seq) for seq in range(10)])], publish_time=42)
        with LogSnapshot(path) as snapshot:
            late = [(seq, "late", b"late") for seq in range(10, 15)]
            log.append([("t", "p", late), ("u", None, [(None, None, b"")])])
            assert snapshot.topics() == ["t"]
            rows = list(snapshot.messages("t", chunk=3))
            with pytest.raises(LogError, match=r"topic 'u' is not in the log; expected one of \['t'\]"):
                list(snapshot.messages("u"))
    assert rows == [(seq + 1, f"k{seq % 3}", b"x%d" % seq, "p", seq, 42, None) for seq in range(10)]
