"""Tokens kept out of `ps` and compared in constant time, the admin endpoint behind the token, and TLS.

The certificates are made at test time by a throwaway CA (trustme); the server is a real
``keyfailover serve`` with ``--tls-cert``/``--tls-key``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
import trustme

from keyfailover.client import Client
from keyfailover.tools.cli._serve import _loopback
from tests.server_process import ServerProcess, run_cli, run_main

TOKEN = "tls-token-7f3a"


class Secured:
    """A TLS server with a token, and the files a client needs."""

    def __init__(self, folder: Path) -> None:
        authority = trustme.CA()
        certificate = authority.issue_cert("127.0.0.1", "localhost")
        self.ca = folder / "ca.pem"
        authority.cert_pem.write_to_path(str(self.ca))
        self.cert = folder / "server.pem"
        certificate.cert_chain_pems[0].write_to_path(str(self.cert))
        self.key = folder / "server.key"
        certificate.private_key_pem.write_to_path(str(self.key))
        self.other_ca = folder / "other-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(self.other_ca))
        self.token_file = folder / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.server = ServerProcess(
            folder / "data",
            "--tls-cert",
            str(self.cert),
            "--tls-key",
            str(self.key),
            "--token-file",
            str(self.token_file),
            "--metrics-port",
            "0",
        )

    @property
    def url(self) -> str:
        return f"kf+ssl://127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    setup = Secured(tmp_path_factory.mktemp("tls"))
    with setup.server:
        yield setup


@pytest.mark.integration
def test_produce_and_consume_over_tls_with_a_token_from_a_file(secured: Secured) -> None:
    with Client(secured.url, TOKEN, tls_ca=secured.ca) as client:
        producer = client.create_producer("secure")
        positions = [producer.send(f"m{i}".encode(), key=f"k{i % 3}") for i in range(6)]
        consumer = client.subscribe("secure", "s")
        received = sorted(consumer.receive(timeout=10).position for _ in positions)
    assert received == positions
    url = ["--url", secured.url, "--tls-ca", str(secured.ca), "--topic", "secure-cli"]
    produced = run_cli("produce", *url, "--token-file", str(secured.token_file), "--key-field", ",", stdin="a,1\n")
    assert produced.returncode == 0, produced.stderr
    consumed = run_cli(
        "consume", *url, "--token-file", str(secured.token_file), "--subscription", "s", "--idle-timeout", "1"
    )
    assert consumed.returncode == 0 and consumed.stdout == "1\ta\t1\n", consumed.stderr


@pytest.mark.integration
def test_the_token_from_the_environment(secured: Secured) -> None:
    url = ["--url", secured.url, "--tls-ca", str(secured.ca), "--topic", "env-token"]
    env = dict(os.environ, KEYFAILOVER_TOKEN=TOKEN)
    done = subprocess.run(
        [sys.executable, "-m", "keyfailover", "produce", *url, "--key-field", ","],
        input="a,1\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.integration
def test_the_admin_endpoint_needs_the_token_but_healthz(secured: Secured) -> None:
    admin = secured.server.admin_url
    assert admin is not None and admin.startswith("https://")
    done = run_cli("stats", "--admin-url", admin, "--tls-ca", str(secured.ca), "--token-file", str(secured.token_file))
    assert done.returncode == 0, done.stderr
    refused = run_cli("ranges", "--admin-url", admin, "--tls-ca", str(secured.ca))
    assert refused.returncode == 1 and "401" in refused.stderr and "Traceback" not in refused.stderr
    import ssl

    context = ssl.create_default_context(cafile=str(secured.ca))
    with urlopen(f"{admin}/healthz", timeout=10, context=context) as response:
        assert json.load(response) == {"status": "ok"}
    with pytest.raises(HTTPError) as denied:
        urlopen(Request(f"{admin}/stats", headers={"Authorization": "Bearer wrong"}), timeout=10, context=context)
    assert denied.value.code == 401


@pytest.mark.integration
def test_plain_and_untrusting_clients_fail_clearly(secured: Secured) -> None:
    port = secured.server.port
    plain = run_cli("produce", "--url", f"kf://127.0.0.1:{port}", "--topic", "t", "--token", TOKEN, stdin="a\n")
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert "kf+ssl://" in plain.stderr, plain.stderr
    other = run_cli(
        "produce",
        "--url",
        secured.url,
        "--tls-ca",
        str(secured.other_ca),
        "--topic",
        "t",
        "--token",
        TOKEN,
        stdin="a\n",
    )
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "certificate verify failed" in other.stderr, other.stderr


@pytest.mark.parametrize(
    ("arguments", "code", "fragment"),
    [
        (["--token", "a", "--token-file", "f"], 2, "give --token or --token-file, not both"),
        (["--token-file", "EMPTY"], 2, "is empty; expected a token"),
        (["--token-file", "MISSING"], 1, "cannot read the token file"),
    ],
)
def test_token_options_are_checked(tmp_path: Path, arguments: list[str], code: int, fragment: str) -> None:
    (tmp_path / "EMPTY").write_text("\n")
    resolved = [str(tmp_path / value) if value in ("EMPTY", "MISSING") else value for value in arguments]
    done = run_main("produce", "--url", "kf://127.0.0.1:1", "--topic", "t", *resolved, stdin="a\n")
    assert done.returncode == code and fragment in done.stderr, done.stderr


@pytest.mark.integration
def test_serving_beyond_loopback_without_a_token_warns(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")  # the start fails at the data dir, after the warning, before binding
    done = run_cli("serve", "--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path / "afile"))
    assert "warning: listening on 0.0.0.0 without a token" in done.stderr
    assert done.returncode == 1
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost") and _loopback("127.3.4.5")
    assert not _loopback("0.0.0.0") and not _loopback("10.1.2.3") and not _loopback("example.org")


@pytest.mark.integration
def test_tls_options_go_together(tmp_path: Path) -> None:
    done = run_cli("serve", "--data-dir", str(tmp_path / "d"), "--tls-cert", "c.pem")
    assert done.returncode == 2 and "--tls-cert and --tls-key go together" in done.stderr
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    done = run_cli(
        "serve", "--data-dir", str(tmp_path / "d"), "--port", "0", "--tls-cert", str(bad), "--tls-key", str(bad)
    )
    assert done.returncode == 1 and "cannot load the TLS certificate" in done.stderr, done.stderr
