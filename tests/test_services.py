"""The real ZooKeeper and PostgreSQL the cluster tests share (keyfailover.tools.services)."""

from __future__ import annotations

import collections
import shutil
import socket
from pathlib import Path

import pytest

from keyfailover.tools import services
from keyfailover.tools.services import PostgreSQL, ServiceError, ZooKeeper, free_port
from tests.aio import run_async


def test_zookeeper_keeps_an_ephemeral_node_while_its_session_lives(zookeeper: ZooKeeper) -> None:
    from kazoo.client import KazooClient

    owner, watcher = KazooClient(hosts=zookeeper.hosts, timeout=2.0), KazooClient(hosts=zookeeper.hosts)
    owner.start(timeout=10)
    watcher.start(timeout=10)
    try:
        owner.ensure_path("/services-test")
        node = owner.create("/services-test/broker-", b"127.0.0.1:1", ephemeral=True, sequence=True)
        assert watcher.get(node)[0] == b"127.0.0.1:1"
        owner.stop()  # the session ends: its ephemeral node goes
        assert watcher.exists(node) is None
    finally:
        for client in (owner, watcher):
            client.stop()
            client.close()


def test_postgresql_stores_and_reads_back(postgres: PostgreSQL) -> None:
    import asyncpg

    async def roundtrip() -> list[tuple[int, bytes]]:
        connection = await asyncpg.connect(postgres.dsn)
        try:
            await connection.execute("CREATE TEMP TABLE probe (position BIGINT PRIMARY KEY, payload BYTEA)")
            await connection.executemany("INSERT INTO probe VALUES ($1, $2)", [(1, b"a"), (2, b"b")])
            rows = await connection.fetch("SELECT position, payload FROM probe ORDER BY position")
            return [(row["position"], row["payload"]) for row in rows]
        finally:
            await connection.close()

    assert run_async(roundtrip()) == [(1, b"a"), (2, b"b")]


def test_a_zookeeper_on_a_taken_port_is_refused(tmp_path: Path, zookeeper: ZooKeeper) -> None:
    """A second server on the port the shared one holds is refused before it starts."""
    clash = ZooKeeper(tmp_path / "clash", port=zookeeper.port)
    with pytest.raises(ServiceError, match=r"ZooKeeper cannot start on 127\.0\.0\.1:\d+: something else listens there"):
        clash.start()
    assert clash.pid is None


def test_free_port_is_free() -> None:
    port = free_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


class _Kernel:
    """Sockets whose ``bind`` to port 0 gets the ports of ``given`` in turn, as a kernel that repeats itself."""

    AF_INET = socket.AF_INET
    SOCK_STREAM = socket.SOCK_STREAM

    def __init__(self, given: list[int]) -> None:
        self.given = given
        self.open = 0
        self.most_open = 0

    def socket(self, *_: object) -> _Kernel._Probe:
        return _Kernel._Probe(self)

    class _Probe:
        def __init__(self, kernel: _Kernel) -> None:
            self.kernel = kernel
            self.port = 0

        def __enter__(self) -> _Kernel._Probe:
            self.kernel.open += 1
            self.kernel.most_open = max(self.kernel.most_open, self.kernel.open)
            return self

        def __exit__(self, *_: object) -> None:
            self.kernel.open -= 1

        def bind(self, _: tuple[str, int]) -> None:
            self.port = self.kernel.given.pop(0)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)


def test_free_port_never_gives_a_port_twice_though_the_kernel_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may hand out a port it just freed again: two services started on two calls' ports (a Patroni
    member's PostgreSQL and the other's REST API, once) then find one taken by the other."""
    kernel = _Kernel([41001, 41001, 41001, 41002, 41003])
    monkeypatch.setattr(services, "socket", kernel)
    monkeypatch.setattr(services, "_HANDED_OUT", collections.deque(maxlen=1024))
    assert [free_port(), free_port(), free_port()] == [41001, 41002, 41003]
    assert kernel.given == [] and kernel.open == 0
    assert kernel.most_open == 3  # the second call held both probes it refused while it bound the third


def test_free_ports_of_many_calls_all_differ() -> None:
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_a_service_not_installed_says_what_is_missing_and_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(services, "ZOOKEEPER_JAR", tmp_path / "zookeeper.jar")
    monkeypatch.setattr(services, "POSTGRESQL_BIN", tmp_path / "bin")
    with pytest.raises(
        ServiceError, match=r"^ZooKeeper is not installed \(no .*zookeeper\.jar\): run scripts/setup-system$"
    ):
        ZooKeeper(tmp_path / "zookeeper").start()
    with pytest.raises(
        ServiceError, match=r"^PostgreSQL is not installed \(no .*/bin/initdb\): run scripts/setup-system$"
    ):
        PostgreSQL(tmp_path / "postgresql").start()
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServiceError, match=r"^Java is not installed \(no java on PATH\); ZooKeeper needs it"):
        ZooKeeper.check_installed()
    assert not (tmp_path / "zookeeper").exists() and not (tmp_path / "postgresql").exists()


@pytest.mark.integration
def test_a_start_interrupted_by_ctrl_c_stops_the_server_it_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupt while ZooKeeper comes up, or once PostgreSQL is up (creating the database):
    neither server is left running, though the caller never got an object to stop."""
    import subprocess
    import tempfile

    launched: list[subprocess.Popen[bytes]] = []

    def ctrl_c_once_launched(self: ZooKeeper) -> bool:
        if self._process is None:
            return False
        launched.append(self._process)
        raise KeyboardInterrupt

    folder = Path(tempfile.mkdtemp(prefix="keyfailover-services-"))
    folder.chmod(0o711)  # the postgres user must get through to its folder inside
    try:
        with monkeypatch.context() as patch:
            patch.setattr(ZooKeeper, "_answers", ctrl_c_once_launched)
            with pytest.raises(KeyboardInterrupt):
                ZooKeeper(folder / "zookeeper").start()
        assert launched and launched[0].poll() is not None

        run = services._run_as_postgres

        def ctrl_c_at_psql(*command: str) -> subprocess.CompletedProcess[str]:
            if command[0].endswith("/psql"):
                raise KeyboardInterrupt
            return run(*command)

        server = PostgreSQL(folder / "postgresql")
        with monkeypatch.context() as patch:
            patch.setattr(services, "_run_as_postgres", ctrl_c_at_psql)
            with pytest.raises(KeyboardInterrupt):
                server.start()
        status = run(str(services.POSTGRESQL_BIN / "pg_ctl"), "-D", str(folder / "postgresql" / "data"), "status")
        assert status.returncode == 3, status.stdout  # "no server running"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
