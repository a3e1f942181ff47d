"""Start the real parts a cluster needs on loopback: Debian's ZooKeeper, PostgreSQL and Patroni.

For tests, benchmarks and the cluster demo: each service runs in a folder of its own (config,
data and log), listens on 127.0.0.1 only, on a free port unless one is given, and is stopped
(its process and every child gone) when the context ends; the folder is the caller's to
remove. ``scripts/setup-system`` installs them (``zookeeper``, ``postgresql``, ``patroni`` with
``python3-kazoo``).

:class:`PatroniGroup` is a replicated store: PostgreSQL servers managed by Patroni, which keeps
its state in ZooKeeper, elects the primary, promotes a standby when the primary dies and, in
synchronous mode, acknowledges a commit only once a synchronous standby has it. keyfailover
only follows the primary: :attr:`PatroniGroup.dsn` names every member.

PostgreSQL refuses to run as root: as root the server runs as the ``postgres`` system user
(the folder is handed to it, and the folders above it must let that user through), otherwise
as the calling user.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from keyfailover.core.errors import KeyFailoverError

__all__ = ["PatroniGroup", "PostgreSQL", "ServiceError", "ZooKeeper", "free_port", "stop_process"]

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
ZOOKEEPER_CONF = Path("/etc/zookeeper/conf")
POSTGRESQL_BIN = Path("/usr/lib/postgresql/15/bin")
PATRONI = Path("/usr/bin/patroni")
PATRONI_KAZOO = Path("/usr/lib/python3/dist-packages/kazoo")
"""Debian's kazoo, with which Debian's Patroni reaches ZooKeeper: its package names it only as one of several stores."""
START_TIMEOUT = 60.0


class ServiceError(KeyFailoverError, RuntimeError):
    """A service is not installed, or did not start or stop as expected."""


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=1024)
"""The last ports :func:`free_port` gave this process, none of which it gives again."""


def free_port() -> int:
    """A loopback port nothing listens on now, and one this process was not given lately: the kernel may hand the
    same free port out again at once (one in about 200 calls here), and a service started on ports of two calls
    (a Patroni member's PostgreSQL and another's REST API) would then find one taken by the other."""
    with contextlib.ExitStack() as probes:
        while True:
            probe = probes.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            probe.bind(("127.0.0.1", 0))  # a port given before stays bound meanwhile: the next bind gets another
            port = int(probe.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port


def stop_process(process: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within ``timeout`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ZooKeeper:
    """A standalone ZooKeeper server (``ZooKeeperServerMain``) in ``folder``.

    ``tick_ms`` is ZooKeeper's tick: sessions may be as short as two ticks, so tests can use
    short session timeouts. ``hosts`` is the connect string for kazoo.
    """

    def __init__(self, folder: Path, *, port: int | None = None, tick_ms: int = 100) -> None:
        self.folder = Path(folder)
        self.port = port or free_port()
        self.tick_ms = tick_ms
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def hosts(self) -> str:
        """The connect string for kazoo."""
        return f"127.0.0.1:{self.port}"

    @staticmethod
    def check_installed() -> None:
        """:class:`ServiceError` saying what is missing unless Java and ZooKeeper are installed."""
        _java()
        if not ZOOKEEPER_JAR.exists():
            raise ServiceError(f"ZooKeeper is not installed (no {ZOOKEEPER_JAR}): run scripts/setup-system")

    def start(self) -> ZooKeeper:
        """Start the server and wait until it answers; a ServiceError saying why when it cannot."""
        self.check_installed()
        java = _java()
        if self._answers() or not self._port_free():
            raise ServiceError(f"ZooKeeper cannot start on {self.hosts}: something else listens there")
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.folder / "zoo.cfg"
        config.write_text(
            f"tickTime={self.tick_ms}\n"
            f"dataDir={data}\n"
            f"clientPort={self.port}\n"
            "clientPortAddress=127.0.0.1\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=ruok\n"
            f"minSessionTimeout={2 * self.tick_ms}\n"
            "maxSessionTimeout=60000\n"  # a broker's session timeout as asked, up to a minute: its lease relies on it
            "maxClientCnxns=0\n"
        )
        log = (self.folder / "zookeeper.log").open("ab")
        classpath = f"{ZOOKEEPER_CONF}:{ZOOKEEPER_JAR}"
        command = [java, "-Xmx256m", "-cp", classpath, "org.apache.zookeeper.server.ZooKeeperServerMain", str(config)]
        # A session of its own, as pg_ctl gives PostgreSQL: Ctrl-C in a terminal interrupts the caller, which
        # stops the server after what uses it, not the server under its clients.
        self._process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        try:  # stopped again when it does not start, or the wait is interrupted (Ctrl-C)
            deadline = time.monotonic() + START_TIMEOUT
            while not (self._answers() and self._process.poll() is None):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log_path = self.folder / "zookeeper.log"
                    raise ServiceError(f"ZooKeeper did not start on {self.hosts}; its log: {log_path}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _port_free(self) -> bool:
        """Whether nothing listens on the port (connections of an earlier server in TIME_WAIT do not count:
        ZooKeeper binds with SO_REUSEADDR too, so a restart on its port works at once)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", self.port))
            except OSError:
                return False
        return True

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"ruok")
                return connection.recv(4) == b"imok"
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server, if it runs."""
        if self._process is not None:
            stop_process(self._process)
            self._process = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        return None if self._process is None else self._process.pid

    def __enter__(self) -> ZooKeeper:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _as_postgres() -> list[str]:
    """The prefix that runs a command as the ``postgres`` user when this process is root: PostgreSQL refuses root."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _run_as_postgres(*command: str) -> subprocess.CompletedProcess[str]:
    """Run one of PostgreSQL's programs, as the ``postgres`` user when this process is root."""
    return subprocess.run(
        [*_as_postgres(), *command], capture_output=True, text=True, check=False, timeout=START_TIMEOUT, cwd="/"
    )


def _create_database(port: int, database: str) -> None:
    """Create ``database`` on the server at ``port`` as the superuser ``kf``, unless it exists; a
    :class:`ServiceError` says why it could not."""
    created = _run_as_postgres(
        str(POSTGRESQL_BIN / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "kf", "-d", "postgres",
        "-v", "ON_ERROR_STOP=1", "-c", f'CREATE DATABASE "{database}"',
    )  # fmt: skip
    if created.returncode and "already exists" not in created.stderr:
        raise ServiceError(f"cannot create database {database!r}: {created.stderr.strip()}")


class PostgreSQL:
    """A PostgreSQL 15 server with its own cluster in ``folder``: superuser ``kf``, trust auth on loopback.

    ``dsn`` connects to database ``database`` (created at start).
    """

    def __init__(self, folder: Path, *, port: int | None = None, database: str = "keyfailover") -> None:
        self.folder = Path(folder)
        self.port = port or free_port()
        self.database = database
        self._started = False

    @property
    def dsn(self) -> str:
        """The URL of database ``database`` as the superuser ``kf``."""
        return f"postgresql://kf@127.0.0.1:{self.port}/{self.database}"

    @staticmethod
    def check_installed() -> None:
        """:class:`ServiceError` saying what is missing when PostgreSQL 15 is not installed."""
        initdb = POSTGRESQL_BIN / "initdb"
        if not initdb.exists():
            raise ServiceError(f"PostgreSQL is not installed (no {initdb}): run scripts/setup-system")

    def start(self) -> PostgreSQL:
        """Create the cluster if it is new, start the server and create the database.

        A ServiceError says why when it cannot.
        """
        self.check_installed()
        initdb, pg_ctl = POSTGRESQL_BIN / "initdb", POSTGRESQL_BIN / "pg_ctl"
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            if _run_as_postgres("test", "-w", str(self.folder)).returncode:
                raise ServiceError(
                    f"the postgres user cannot write {self.folder}: every folder above it must be open to it "
                    "(a folder made by tempfile.mkdtemp() under /tmp is)"
                )
        data = self.folder / "data"
        if not data.exists():
            done = _run_as_postgres(str(initdb), "-D", str(data), "-A", "trust", "-U", "kf", "-E", "UTF8", "--no-sync")
            if done.returncode:
                raise ServiceError(f"initdb failed in {data}: {done.stderr.strip() or done.stdout.strip()}")
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        log = self.folder / "postgresql.log"
        self._started = True  # from here on: stopped again when it does not start, or start is interrupted (Ctrl-C)
        try:
            done = _run_as_postgres(
                str(pg_ctl), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start"
            )
            if done.returncode:
                raise ServiceError(
                    f"PostgreSQL did not start on port {self.port}: {done.stderr.strip()}; its log: {log}"
                )
            _create_database(self.port, self.database)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server, if it runs."""
        if self._started:
            _run_as_postgres(
                str(POSTGRESQL_BIN / "pg_ctl"), "-D", str(self.folder / "data"), "-m", "fast", "-w", "stop"
            )
            self._started = False

    def __enter__(self) -> PostgreSQL:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _java() -> str:
    """The ``java`` on PATH; :class:`ServiceError` saying so when there is none."""
    java = shutil.which("java")
    if java is None:
        raise ServiceError("Java is not installed (no java on PATH); ZooKeeper needs it: run scripts/setup-system")
    return java


def _children(parent: int) -> list[int]:
    """The pids of ``parent``'s child processes now, from ``/proc``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


class PatroniGroup:
    """PostgreSQL servers under Patroni in ``folder``: one primary and synchronous standbys, on loopback.

    Each member has a folder, a PostgreSQL port and a REST port of its own; Patroni keeps the
    group's state in ZooKeeper at ``hosts``, under ``namespace``. ``ttl`` is Patroni's leader key
    lifetime: a primary that stops renewing it is replaced within about that long. The superuser
    ``kf`` connects with trust auth on loopback, and database ``database`` is created once a
    primary runs. Synchronous mode is on: a commit returns only once a synchronous standby has it.
    """

    def __init__(
        self,
        folder: Path,
        hosts: str,
        *,
        members: int = 2,
        namespace: str = "/keyfailover-store",
        scope: str = "kf",
        ttl: int = 10,
        database: str = "keyfailover",
    ) -> None:
        if members < 2:
            raise ServiceError(f"a Patroni group needs at least 2 members for a synchronous standby, not {members}")
        self.folder = Path(folder)
        self.hosts = hosts
        self.namespace = namespace
        self.scope = scope
        self.ttl = ttl
        self.database = database
        self.names = [f"member{index}" for index in range(members)]
        self.ports = {name: free_port() for name in self.names}
        self.rest_ports = {name: free_port() for name in self.names}
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._zookeeper_hosts: dict[str, str] = {}  # a member's own way to ZooKeeper (see reach_through)
        self._connect_ports: dict[str, int] = {}  # the port the others reach a member's PostgreSQL at

    @property
    def dsn(self) -> str:
        """The URL of database ``database`` naming every member, for a connection to whichever is the primary."""
        members = ",".join(f"127.0.0.1:{self.ports[name]}" for name in self.names)
        return f"postgresql://kf@{members}/{self.database}?target_session_attrs=read-write"

    @staticmethod
    def check_installed() -> None:
        """:class:`ServiceError` saying what is missing when Patroni or PostgreSQL 15 is not installed."""
        PostgreSQL.check_installed()
        if not PATRONI.exists():
            raise ServiceError(f"Patroni is not installed (no {PATRONI}): run scripts/setup-system")
        if not PATRONI_KAZOO.exists():
            raise ServiceError(
                f"Patroni cannot reach ZooKeeper without Debian's python3-kazoo (no {PATRONI_KAZOO}): "
                "run scripts/setup-system"
            )

    @classmethod
    def missing(cls) -> str | None:
        """What is missing to run a group here, and where to get it (:meth:`check_installed`'s message); None
        when nothing is."""
        try:
            cls.check_installed()
        except ServiceError as missing:
            return str(missing)
        return None

    def reach_through(self, name: str, *, zookeeper: str, postgresql: int) -> None:
        """Member ``name``'s own links go through ``zookeeper`` (the hosts its Patroni reaches ZooKeeper at) and
        loopback port ``postgresql`` (where the other members reach its PostgreSQL: streaming replication from
        it and pg_rewind against it), a fault proxy's each, so that a fault can cut that member's links alone.
        From its next start on; by default a member reaches ZooKeeper at ``hosts`` and is reached at its port."""
        if name not in self.ports:
            raise ServiceError(f"the Patroni group {self.scope!r} has no member {name!r}; its members: {self.names}")
        self._zookeeper_hosts[name] = zookeeper
        self._connect_ports[name] = postgresql

    def _config(self, name: str) -> dict[str, Any]:
        """Patroni's configuration of member ``name``."""
        home = self.folder / name
        port, rest = self.ports[name], self.rest_ports[name]
        reached_at = self._connect_ports.get(name, port)
        return {
            "scope": self.scope,
            "namespace": self.namespace,
            "name": name,
            "log": {"dir": str(home), "level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{rest}", "connect_address": f"127.0.0.1:{rest}"},
            "zookeeper": {"hosts": self._zookeeper_hosts.get(name, self.hosts).split(",")},
            "bootstrap": {
                "dcs": {
                    "ttl": self.ttl,
                    "loop_wait": 1,
                    "retry_timeout": max(1, (self.ttl - 1) // 2),
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "remove_data_directory_on_rewind_failure": True,
                        "remove_data_directory_on_diverged_timelines": True,
                        "parameters": {"max_wal_senders": 10, "wal_log_hints": "on"},
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{port}",
                "connect_address": f"127.0.0.1:{reached_at}",
                "data_dir": str(home / "data"),
                "bin_dir": str(POSTGRESQL_BIN),
                "pgpass": str(home / "pgpass"),
                "authentication": {"superuser": {"username": "kf"}, "replication": {"username": "kf"}},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "parameters": {"unix_socket_directories": str(home)},
            },
        }

    def start(self) -> PatroniGroup:
        """Start every member, wait for a primary and a synchronous standby, and create the database.

        A ServiceError says why when the group does not come up within the start timeout.
        """
        self.check_installed()
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            for name in self.names:
                self._start_member(name)
            _create_database(self.ports[self.wait_until_ready()], self.database)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_member(self, name: str) -> None:
        """Write member ``name``'s configuration and start its Patroni, which starts its PostgreSQL."""
        home = self.folder / name
        home.mkdir(parents=True, exist_ok=True)
        config = home / "patroni.json"  # JSON is YAML: Patroni reads it as its YAML configuration
        config.write_text(json.dumps(self._config(name), indent=2))
        if os.geteuid() == 0:
            for path in (self.folder, home, config):
                shutil.chown(path, "postgres", "postgres")
        home.chmod(0o700)
        with (home / "patroni.out").open("ab") as out:
            self._processes[name] = subprocess.Popen(
                [*_as_postgres(), str(PATRONI), str(config)], stdout=out, stderr=subprocess.STDOUT,
                cwd="/", start_new_session=True,
            )  # fmt: skip

    def members(self) -> list[dict[str, Any]]:
        """The group's members as Patroni's REST API lists them: name, role, state, lag; [] when none answers."""
        for name in self.names:
            process = self._processes.get(name)
            if process is None or process.poll() is not None:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.rest_ports[name]}/cluster", timeout=1.0) as got:
                    found: list[dict[str, Any]] = json.loads(got.read())["members"]
                    return found
            except (OSError, ValueError, KeyError):
                continue
        return []

    def primary(self) -> str:
        """The member Patroni runs as the primary; a ServiceError when there is none."""
        for member in self.members():
            if member.get("role") == "leader" and member.get("state") == "running":
                return str(member["name"])
        raise ServiceError(f"the Patroni group {self.scope!r} has no running primary now")

    def wait_until_ready(self, timeout: float = START_TIMEOUT) -> str:
        """Wait until a primary runs and a synchronous standby streams from it; the primary's name."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.members()
            roles = {member.get("role") for member in found if member.get("state") in ("running", "streaming")}
            if {"leader", "sync_standby"} <= roles:
                return self.primary()
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"the Patroni group {self.scope!r} has no primary with a synchronous standby after {timeout:g} s: "
                    f"{found or 'no member answers'}; logs under {self.folder}"
                )
            time.sleep(0.2)

    def kill(self, name: str) -> float:
        """SIGKILL member ``name``: its Patroni and its PostgreSQL, as a machine that dies. Every process of it is
        frozen (SIGSTOP) first, then killed; returns the ``time.monotonic()`` at which all were frozen, from which
        on the member answers nothing: a write begun after it is acknowledged by another primary or not at all."""
        self._signal(name, signal.SIGSTOP)
        frozen = time.monotonic()
        process = self._processes.get(name)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._kill_postmaster(name)
        return frozen

    def restart(self, name: str) -> None:
        """Start member ``name`` again after :meth:`kill`, on its folder and ports: Patroni makes it a standby
        of the primary now, rewinding its data, or copying the primary's afresh when it cannot rewind."""
        process = self._processes.get(name)
        if process is not None and process.poll() is None:
            raise ServiceError(f"member {name!r} of the Patroni group {self.scope!r} still runs; kill it first")
        self._start_member(name)

    def suspend(self, name: str) -> None:
        """SIGSTOP member ``name``: its Patroni and every PostgreSQL process of it, as a machine that freezes."""
        self._signal(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """SIGCONT member ``name`` after :meth:`suspend`."""
        self._signal(name, signal.SIGCONT)

    def _signal(self, name: str, number: signal.Signals) -> None:
        """Send ``number`` to member ``name``'s Patroni, then to its postmaster and after it to each of the
        postmaster's children, listed once the postmaster has the signal (a stopped postmaster forks no more):
        PostgreSQL puts every child in a session of its own, so no process group holds them all."""
        process = self._processes.get(name)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, number)
        postmaster = self._postmaster(name)
        if postmaster is None:
            return
        try:
            os.kill(postmaster, number)
        except ProcessLookupError:
            return
        for child in _children(postmaster):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, number)

    def _postmaster(self, name: str) -> int | None:
        """The pid of member ``name``'s postmaster, from its ``postmaster.pid``; None when it has none."""
        try:
            return int((self.folder / name / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _kill_postmaster(self, name: str) -> None:
        """SIGKILL member ``name``'s postmaster, which Patroni runs in a session of its own, and each of its
        children: a running backend would follow the postmaster by itself, a frozen one (:meth:`suspend`) never."""
        pid = self._postmaster(name)
        if pid is None:
            return
        children = _children(pid)  # listed first: once the postmaster is dead they are init's
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every member: Patroni stops its PostgreSQL; what is left after the timeout is killed. A Patroni
        of this group started but not recorded, when a signal interrupted its start, is killed too."""
        recorded = {process.pid for process in self._processes.values()}
        for pid in self._unrecorded(recorded):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for process in self._processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name, process in self._processes.items():
            try:
                process.wait(timeout=20.0)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            self._kill_postmaster(name)
        self._processes.clear()

    def _unrecorded(self, recorded: set[int]) -> list[int]:
        """The pids of processes running a configuration of this group other than ``recorded``: leaders of
        sessions that Popen started before a signal kept it from returning."""
        configs = {str(self.folder / name / "patroni.json").encode() for name in self.names}
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            pid = int(cmdline.parent.name)
            try:
                if set(cmdline.read_bytes().split(b"\0")) & configs and pid not in recorded and os.getpgid(pid) == pid:
                    found.append(pid)
            except OSError:
                continue  # ended meanwhile
        return found

    def __enter__(self) -> PatroniGroup:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
