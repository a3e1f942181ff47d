"""Every mistake a user can make with the CLI ends in one sentence and an exit code, never a traceback.

Exit codes: 2 for usage (options that do not parse or do not go together), 1 for a runtime
failure (nothing listening, a refused token, a bad input line), 130 for Ctrl-C, 0 when the
reader of ``consume``'s output goes away (``keyfailover consume ... | head -1``).

A mistake that needs no process of its own is made in this process, by the CLI's ``main``, against
a server in this process; Ctrl-C, a closed pipe and ``serve`` failing to start run the command in
a child process, as a user would.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO
from urllib.request import urlopen

import pytest

from keyfailover.broker.server import ServerConfig
from keyfailover.client import Client
from keyfailover.tools.services import free_port
from tests.server_process import ServerProcess, ServerThread, run_cli, run_main, wait_until


def assert_clean_failure(done: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, (fragment, done.stderr)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """One server with an admin endpoint for the tests that do not restart it."""
    config = ServerConfig(data_dir=tmp_path_factory.mktemp("cli-errors") / "data", metrics_port=0)
    with ServerThread(config) as started:
        yield started


def stored_count(server: ServerThread, topic: str) -> int:
    assert server.admin_url is not None
    with urlopen(f"{server.admin_url}/stats", timeout=10) as response:
        return int(json.load(response)["topics"].get(topic, 0))


# -- nothing listening, the wrong port, the wrong token -----------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["produce", "--topic", "t"],
        ["consume", "--topic", "t", "--subscription", "s"],
    ],
)
def test_client_commands_against_a_closed_port(command: list[str]) -> None:
    done = run_main(*command, "--url", f"kf://127.0.0.1:{free_port()}", stdin="k,v\n")
    assert_clean_failure(done, 1, "cannot connect to kf://127.0.0.1:", "Connection refused", "keyfailover serve")


def test_a_host_that_does_not_resolve() -> None:
    done = run_main("produce", "--topic", "t", "--url", "kf://no-such-host.invalid:6650", stdin="k,v\n")
    assert_clean_failure(done, 1, "cannot connect to kf://no-such-host.invalid:6650 (")
    assert "Unknown error" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["ranges"],
        ["stats"],
        ["plot", "--out", "never.png", "--topic", "t", "--subscription", "s"],
        ["dlq", "list", "--topic", "t", "--subscription", "s"],
        ["dlq", "replay", "--topic", "t", "--subscription", "s"],
        ["dlq", "purge", "--topic", "t", "--subscription", "s"],
    ],
)
def test_admin_commands_against_a_closed_port(command: list[str], tmp_path: Path) -> None:
    done = run_main(*command, "--admin-url", f"http://127.0.0.1:{free_port()}")
    assert_clean_failure(done, 1, "cannot reach http://127.0.0.1:", "Connection refused", "--metrics-port")
    assert not (tmp_path / "never.png").exists()


@pytest.mark.parametrize("command", ["ranges", "stats"])
def test_admin_commands_pointed_at_the_broker_port(server: ServerThread, command: str) -> None:
    done = run_main(command, "--admin-url", f"http://127.0.0.1:{server.port}")
    assert_clean_failure(done, 1, "did not answer as an HTTP admin endpoint", "not the broker port")


def test_a_wrong_token_is_a_clear_refusal(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", token="s3cret")) as guarded:
        url = ["--url", guarded.url, "--topic", "t", "--token", "wrong"]
        produced = run_main("produce", *url, stdin="k,v\n")
        assert_clean_failure(produced, 1, f"the server at {guarded.url} refused the connection", "unauthorized")
        consumed = run_main("consume", *url, "--subscription", "s", "--idle-timeout", "1")
        assert_clean_failure(consumed, 1, "refused the connection", "unauthorized")


# -- usage errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        (["ranges", "--topic", "t"], "--topic and --subscription go together"),
        (["plot", "--out", "x.png", "--history-file", "h.jsonl", "--topic", "t"], "go with --admin-url"),
        (["plot", "--out", "x.png", "--admin-url", "http://127.0.0.1:1"], "--admin-url needs --topic"),
        (["consume", "--topic", "t", "--subscription", "s", "--idle-timeout", "inf"], "expected a finite number > 0"),
        (["consume", "--topic", "t", "--subscription", "s", "--receiver-queue", "0"], "expected an integer >= 1"),
        (["demo", "--messages", "10"], "expected an integer >= 1000"),
        (["ranges", "--admin-url", "notaurl"], "admin URL 'notaurl' is not of the form http://HOST:PORT"),
        (["stats", "--admin-url", "http://[::1"], "admin URL 'http://[::1' is malformed"),
        (["consume", "--topic", "t", "--subscription", "s", "--url", "http://x"], "is not of the form kf://HOST:PORT"),
        (["produce", "--topic", "t", "--allow-keyless"], "--allow-keyless goes with --json"),
        (["produce", "--topic", "t", "--property", "trace"], "'trace' has no '='; expected KEY=VALUE"),
        (
            ["produce", "--topic", "t", "--property", "k" * 257 + "=v"],
            "has 257 characters; expected at most 256",
        ),
        (["ranges", "--pulsar-sticky"], "--pulsar-sticky shows one subscription: give --topic and --subscription"),
        (["ranges", "--pulsar-sticky", "--json", "--topic", "t", "--subscription", "s"], "--json or --pulsar-sticky"),
        (["dlq", "list", "--topic", "t"], "the following arguments are required: --subscription"),
        (["dlq", "drop", "--topic", "t", "--subscription", "s"], "invalid choice: 'drop'"),
        (["dlq", "list", "--topic", "t", "--subscription", "s", "--limit", "0"], "expected an integer >= 1"),
        (["serve", "--data-dir", "d", "--ack-timeout", "-1"], "expected seconds from 0 (disabled) to 86400"),
        (["serve", "--data-dir", "d", "--ack-timeout", "nan"], "expected seconds from 0 (disabled) to 86400"),
        (["serve", "--data-dir", "d", "--max-redeliveries", "-1"], "--max-redeliveries"),
        (["serve", "--data-dir", "d", "--entry-cache-mb", "-1"], "expected a number of MiB from 0 to 1048576"),
        (
            ["serve", "--data-dir", "d", "--nack-backoff", "90"],
            "nack_backoff_max must be a finite number >= 90.0 (at least nack_backoff, 90), not 60.0",
        ),
        (["serve", "--data-dir", "d", "--nack-backoff-max", "-2"], "expected seconds from 0 (disabled) to 86400"),
        (["admin", "configure", "--topic", "t"], "the following arguments are required: --subscription"),
        (["admin", "configure", "--topic", "t", "--subscription", "s", "--max-redeliveries", "few"], "or none"),
        (["admin", "configure", "--topic", "t", "--subscription", "s", "--nack-backoff", "inf"], "to 86400"),
    ],
)
def test_usage_errors_exit_2(command: list[str], fragment: str) -> None:
    assert_clean_failure(run_main(*command), 2, fragment)


# -- input that must not be stored wrongly --------------------------------------------------------


def produce(server: ServerThread, topic: str, stdin: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_main("produce", "--url", server.url, "--topic", topic, *extra, stdin=stdin)


def test_produce_says_what_it_stored(server: ServerThread) -> None:
    done = produce(server, "said", "a,1\n\nb,2\nc,3\n", "--key-field", ",")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stored 3 messages in 'said', positions 1..3 from lines 1..4"


def test_a_json_line_without_its_key_stops_the_run_and_says_what_was_stored(server: ServerThread) -> None:
    lines = '{"account": "a", "n": 1}\n{"account": "b", "n": 2}\n{"n": 3}\n{"account": "c", "n": 4}\n'
    done = produce(server, "missing-key", lines, "--json", "--key-field", "account")
    assert_clean_failure(
        done,
        1,
        "line 3: no 'account' field (or it is null); pass --allow-keyless to send such lines without a key",
        "stored 2 messages in 'missing-key', positions 1..2 from lines 1..2; nothing after line 2 was sent",
    )
    assert stored_count(server, "missing-key") == 2


def test_property_options_go_with_every_message_and_consume_json_shows_them(server: ServerThread) -> None:
    done = produce(server, "tagged", "a,1\nb,2\n", "--key-field", ",", "--property", "source=cli", "--property",
                   "query=a=b&c", "--property", "source=file")  # fmt: skip
    assert done.returncode == 0, done.stderr
    consumed = run_main(
        "consume", "--url", server.url, "--topic", "tagged", "--subscription", "s", "--json", "--idle-timeout", "2"
    )
    assert consumed.returncode == 0, consumed.stderr
    lines = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert [line["properties"] for line in lines] == [{"source": "file", "query": "a=b&c"}] * 2


def test_allow_keyless_sends_such_lines_without_a_key(server: ServerThread) -> None:
    lines = '{"account": "a"}\n{"n": 2}\n{"account": null}\n'
    done = produce(server, "keyless", lines, "--json", "--key-field", "account", "--allow-keyless")
    assert done.returncode == 0, done.stderr
    with Client(server.url) as client:
        consumer = client.subscribe("keyless", "check")
        keys = [consumer.receive(timeout=10).key for _ in range(3)]
    assert keys == ["a", None, None]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('{"id": 1}', "the 'account' field is dict {\"id\": 1}; expected a string or an integer"),
        ("[1, 2]", "the 'account' field is list [1, 2]; expected a string or an integer"),
        ("1.5", "the 'account' field is float 1.5; expected a string or an integer"),
        ("true", "the 'account' field is bool true; expected a string or an integer"),
    ],
)
def test_a_key_that_is_not_a_string_is_refused(server: ServerThread, value: str, expected: str) -> None:
    done = produce(server, "typed-keys", f'{{"account": {value}}}\n', "--json", "--key-field", "account")
    assert_clean_failure(done, 1, f"line 1: {expected}", "stored 0 messages")


def test_an_integer_key_is_sent_as_its_decimal_text(server: ServerThread) -> None:
    done = produce(server, "int-keys", '{"account": 42}\n{"account": -7}\n', "--json", "--key-field", "account")
    assert done.returncode == 0, done.stderr
    with Client(server.url) as client:
        consumer = client.subscribe("int-keys", "check")
        keys = [consumer.receive(timeout=10).key for _ in range(2)]
    assert keys == ["42", "-7"]


def test_invalid_utf8_is_refused_with_the_line_number(server: ServerThread, tmp_path: Path) -> None:
    source = tmp_path / "bad.txt"
    source.write_bytes(b"a,1\nb,\xff\xfe\n")
    done = run_main("produce", "--url", server.url, "--topic", "utf8", "--key-field", ",", "--file", str(source))
    assert_clean_failure(done, 1, "line 2: not UTF-8 (invalid start byte at byte 2)", "stored 1 message")


def test_an_oversized_payload_is_refused_with_the_line_number(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", max_frame=65536)) as small:
        lines = "a,1\nb," + "x" * 70_000 + "\n"
        done = run_main("produce", "--url", small.url, "--topic", "big", "--key-field", ",", stdin=lines)
        assert_clean_failure(done, 1, "line 2: a message of", "bytes a message may have", "stored 1 message")


# -- Ctrl-C and a reader that goes away -----------------------------------------------------------


def start_cli(*args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "keyfailover", *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def fill(server: ServerThread, topic: str, count: int, payload: bytes = b"p" * 100) -> None:
    with Client(server.url) as client:
        producer = client.create_producer(topic)
        for i in range(count):
            producer.send_async(payload, key=f"k{i % 97}")
        producer.flush()


def read_positions(stream: IO[str]) -> list[int]:
    return [int(line.split("\t", 1)[0]) for line in stream]


@pytest.mark.integration
def test_ctrl_c_during_consume_exits_130_and_acknowledges_only_what_was_printed(server: ServerThread) -> None:
    fill(server, "interrupted", 20_000)
    first = start_cli("consume", "--url", server.url, "--topic", "interrupted", "--subscription", "s")
    assert first.stdout is not None and first.stderr is not None
    seen = [int(first.stdout.readline().split("\t", 1)[0]) for _ in range(10)]
    # 20,000 lines of 100-byte payloads overflow the pipe: consume is blocked mid-stream, writing.
    first.send_signal(signal.SIGINT)
    stuck = threading.Timer(60, first.kill)  # reading to the end must end even if consume does not
    stuck.start()
    try:
        seen += read_positions(first.stdout)
    finally:
        stuck.cancel()
    assert first.wait(timeout=60) == 130, "consume did not end within 60 s of Ctrl-C"
    errors = first.stderr.read()
    assert "Traceback" not in errors and "keyfailover consume: interrupted" in errors
    assert len(seen) < 20_000
    second = run_cli(
        "consume", "--url", server.url, "--topic", "interrupted", "--subscription", "s", "--idle-timeout", "2"
    )
    assert second.returncode == 0, second.stderr
    again = [int(line.split("\t", 1)[0]) for line in second.stdout.splitlines()]
    # Nothing acknowledged without being printed: every position was printed by one run or the other.
    assert set(seen) | set(again) == set(range(1, 20_001))


@pytest.mark.integration
def test_ctrl_c_during_produce_exits_130_and_says_what_was_stored(server: ServerThread) -> None:
    running = start_cli("produce", "--url", server.url, "--topic", "stopped", "--key-field", ",", stdin=subprocess.PIPE)
    assert running.stdin is not None and running.stderr is not None
    running.stdin.write("".join(f"k{i},{i}\n" for i in range(100)))
    running.stdin.flush()
    wait_until(lambda: stored_count(server, "stopped") == 100, "the first 100 lines stored")
    running.send_signal(signal.SIGINT)
    assert running.wait(timeout=60) == 130
    errors = running.stderr.read()
    assert "Traceback" not in errors
    assert "keyfailover produce: interrupted; stored 100 messages in 'stopped', positions 1..100" in errors
    running.stdin.close()
    assert stored_count(server, "stopped") == 100


@pytest.mark.integration
def test_consume_piped_into_head_exits_quietly(server: ServerThread) -> None:
    fill(server, "piped", 2_000)
    command = (
        f"{sys.executable} -m keyfailover consume --url {server.url} --topic piped --subscription s "
        "--idle-timeout 2 | head -1; exit ${PIPESTATUS[0]}"
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert len(done.stdout.splitlines()) == 1


@pytest.mark.integration
def test_consume_prints_and_acks_under_a_reader_that_keeps_up(server: ServerThread) -> None:
    fill(server, "kept-up", 3_000)
    reader = start_cli(
        "consume", "--url", server.url, "--topic", "kept-up", "--subscription", "s", "--idle-timeout", "2"
    )
    assert reader.stdout is not None
    positions: list[int] = []
    drained = threading.Thread(target=lambda: positions.extend(read_positions(reader.stdout)))  # type: ignore[arg-type]
    drained.start()
    assert reader.wait(timeout=120) == 0
    drained.join(timeout=30)
    assert sorted(positions) == list(range(1, 3_001))
    again = run_cli("consume", "--url", server.url, "--topic", "kept-up", "--subscription", "s", "--idle-timeout", "1")
    assert again.returncode == 0 and again.stdout == ""


def test_every_option_of_every_command_has_help_text() -> None:
    import argparse

    from keyfailover.tools.cli import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert missing == []
    assert {choice.dest for choice in commands._choices_actions} == set(commands.choices)
    assert all(choice.help for choice in commands._choices_actions)


# -- serve -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--session-timeout", "inf", "expected a finite number > 0"),
        ("--session-timeout", "nan", "expected a finite number > 0"),
        ("--session-timeout", "0", "expected a finite number > 0"),
        ("--session-timeout", "100000", "expected seconds from 0.1 to 86400"),
        ("--port", "70000", "expected a port number from 0 to 65535"),
        ("--port", "-1", "expected a port number from 0 to 65535"),
        ("--metrics-port", "65536", "expected a port number from 0 to 65535"),
        ("--max-frame", "10", "expected a frame size from 1024"),
        ("--max-frame", str(2**32), "expected a frame size from 1024"),
        ("--sync", "off", "invalid choice: 'off'"),
        ("--policy", "sticky", "invalid choice: 'sticky'"),
        ("--max-ranges", "0", "expected a number of ranges from 1 to 65536, got '0'"),
        ("--max-ranges", "65537", "expected a number of ranges from 1 to 65536"),
        ("--max-ranges", "two", "expected a number of ranges from 1 to 65536, got 'two'"),
    ],
)
def test_serve_options_out_of_range_exit_2(tmp_path: Path, option: str, value: str, fragment: str) -> None:
    done = run_main("serve", "--data-dir", str(tmp_path / "data"), option, value)
    assert_clean_failure(done, 2, fragment)
    assert not (tmp_path / "data").exists()


def test_serve_max_ranges_goes_with_the_multi_policy(tmp_path: Path) -> None:
    done = run_main("serve", "--data-dir", str(tmp_path / "data"), "--policy", "contiguous", "--max-ranges", "4")
    assert_clean_failure(done, 2, "--max-ranges goes with --policy multi; --policy contiguous gives each consumer one")
    assert not (tmp_path / "data").exists()


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("serve", "--port", "0", *args, timeout=60)


@pytest.mark.integration
def test_serve_with_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    done = serve(tmp_path, "--data-dir", str(tmp_path / "afile"))
    assert_clean_failure(done, 1, f"data dir {tmp_path / 'afile'} is not a directory")


@pytest.mark.integration
def test_serve_with_a_data_dir_that_cannot_be_written() -> None:
    # As root permission bits stop nothing; sysfs refuses to create a directory even to root.
    done = run_cli("serve", "--port", "0", "--data-dir", "/sys/keyfailover-test-data", timeout=60)
    assert_clean_failure(done, 1, "cannot use data dir /sys/keyfailover-test-data (", "expected a directory this")


@pytest.mark.integration
def test_serve_on_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("serve", "--data-dir", str(tmp_path / "data"), "--port", str(port), timeout=60)
        assert_clean_failure(done, 1, f"cannot listen on 127.0.0.1:{port} (address already in use)")
        metrics = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--metrics-port", str(port))
        assert_clean_failure(metrics, 1, f"cannot serve the admin endpoint on 127.0.0.1:{port} (address already")


@pytest.mark.integration
def test_serve_on_an_address_this_host_does_not_have(tmp_path: Path) -> None:
    done = serve(tmp_path, "--data-dir", str(tmp_path / "data"), "--host", "192.0.2.1")  # TEST-NET-1: never ours
    assert_clean_failure(done, 1, "cannot listen on 192.0.2.1:0 (cannot assign requested address)")


@pytest.mark.integration
def test_a_failed_start_releases_the_data_dir(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        failed = run_cli("serve", "--data-dir", str(tmp_path / "data"), "--port", port, timeout=60)
        assert failed.returncode == 1
    with ServerProcess(tmp_path / "data") as started:  # the lock was released: the dir is free
        assert started.port > 0
