"""The replicated store: a Patroni group that keyfailover only follows.

Two PostgreSQL servers under Debian's Patroni, which keeps its state in the test run's ZooKeeper:
one primary and a synchronous standby. A commit acknowledged by the primary is on the standby
too, so when the primary dies (Patroni and PostgreSQL SIGKILLed together, as a machine that dies)
the promoted standby still has it, and a client of the URL naming every member writes again. The
killed member comes back as a standby; when the primary then freezes, it is promoted in turn.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import asyncpg
import pytest

from keyfailover.broker.storage._postgresql_members import connect_writable
from keyfailover.tools.chaos._proxy import FaultProxy
from keyfailover.tools.services import PatroniGroup, ServiceError, ZooKeeper, _children
from tests.aio import run_async
from tests.server_process import skip_without_patroni, wait_until


async def _write(dsn: str, value: int) -> tuple[list[int], str]:
    """Insert ``value`` through ``dsn``: every value stored then, and the standbys the primary waits for."""
    connection = await connect_writable(dsn, timeout=5.0)  # every member at once: a frozen one costs nothing
    try:
        await connection.execute("CREATE TABLE IF NOT EXISTS acked (value int)")
        await connection.execute("INSERT INTO acked VALUES ($1)", value)
        stored = [row["value"] for row in await connection.fetch("SELECT value FROM acked ORDER BY value")]
        standbys = await connection.fetchval("SHOW synchronous_standby_names")
        return stored, str(standbys)
    finally:
        await connection.close()


def _writes(dsn: str, value: int) -> tuple[list[int], str] | None:
    """:func:`_write`, or None while no primary accepts it."""
    try:
        return run_async(_write(dsn, value))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return None


def _promoted(group: PatroniGroup, member: str) -> bool:
    """Whether Patroni runs ``member`` as the primary now."""
    try:
        return group.primary() == member
    except ServiceError:  # no primary yet
        return False


def _stored_after(dsn: str, value: int, into: list[list[int]]) -> bool:
    """Write ``value`` through ``dsn`` and put every value stored then into ``into``; False while no primary
    accepts it."""
    done = _writes(dsn, value)
    if done is not None:
        into.append(done[0])
    return done is not None


_COMMITTER = """
import asyncio, sys, time
import asyncpg

async def main(url: str) -> None:
    connection = await asyncpg.connect(url, timeout=5.0)
    await connection.execute("CREATE TABLE IF NOT EXISTS committed (value int)")
    try:
        while True:
            began = time.monotonic()
            await connection.execute("INSERT INTO committed VALUES (1)", timeout=30.0)
            print(began, time.monotonic(), flush=True)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        connection.terminate()

asyncio.run(main(sys.argv[1]))
"""


class _Committer:
    """A process committing one row after another on member ``name``'s own port (not the group's URL), printing
    when each commit began and when it returned (monotonic seconds, the clock every process reads), until the
    member stops answering. A process of its own: a thread would wait for the GIL while the test kills."""

    def __init__(self, group: PatroniGroup, name: str, folder: Path) -> None:
        self._url = f"postgresql://kf@127.0.0.1:{group.ports[name]}/{group.database}"
        self._out = folder / "commits"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def commits(self) -> list[tuple[float, float]]:
        """The commits that returned so far: (began, returned)."""
        lines = self._out.read_text().splitlines() if self._out.exists() else []
        return [(float(began), float(returned)) for began, returned in (line.split() for line in lines)]

    def __enter__(self) -> _Committer:
        with self._out.open("wb") as out:
            self._process = subprocess.Popen([sys.executable, "-c", _COMMITTER, self._url], stdout=out)
        process = self._process
        wait_until(lambda: len(self.commits) > 100 or process.poll() is not None, "commits on the member")
        assert process.poll() is None, f"the committer could not commit on the member (exit code {process.poll()})"
        return self

    def __exit__(self, *_: object) -> None:
        assert self._process is not None
        try:
            self._process.wait(timeout=60.0)
        finally:
            self._process.kill()
            self._process.wait()


@pytest.mark.slow
def test_a_commit_survives_the_primary_s_kill_which_comes_back_as_a_standby_then_a_frozen_one_is_replaced(
    patroni: PatroniGroup, tmp_path: Path
) -> None:
    first = patroni.primary()
    second = next(name for name in patroni.names if name != first)
    before_kill = _writes(patroni.dsn, 1)
    assert before_kill is not None
    assert second in before_kill[1]  # the commit returned only once this standby had it
    with _Committer(patroni, first, tmp_path) as committer:
        killed = patroni.kill(first)
    assert [commit for commit in committer.commits if commit[0] >= killed] == []
    wait_until(lambda: _promoted(patroni, second), "the standby promoted", timeout=60)
    wait_until(lambda: _writes(patroni.dsn, 2) is not None, "a write on the promoted standby")  # the old one lacks it
    patroni.restart(first)
    assert patroni.wait_until_ready() == second  # the old primary rejoined as the synchronous standby
    patroni.suspend(second)
    wait_until(lambda: _promoted(patroni, first), "the rejoined member promoted while the primary froze", timeout=60)
    written: list[list[int]] = []
    wait_until(lambda: _stored_after(patroni.dsn, 3, written), "a write on the member promoted second")
    assert written[0] == [1, 2, 3]
    patroni.resume(second)
    assert patroni.wait_until_ready() == first  # the frozen primary woke, stepped down and follows
    with pytest.raises(ServiceError, match=f"member {first!r} .* still runs; kill it first"):
        patroni.restart(first)
    postmaster = patroni._postmaster(first)
    assert postmaster is not None
    frozen = [postmaster, *_children(postmaster)]
    patroni.suspend(first)  # stopped while frozen: none of its processes may be left behind
    patroni.stop()
    assert [pid for pid in frozen if Path(f"/proc/{pid}").exists()] == []


def test_a_group_needs_a_standby() -> None:
    with pytest.raises(ServiceError, match="at least 2 members for a synchronous standby, not 1"):
        PatroniGroup(Path("/nonexistent"), "127.0.0.1:1", members=1)


@pytest.mark.integration
def test_stop_kills_a_member_s_process_that_a_signal_kept_from_being_recorded(tmp_path: Path) -> None:
    """A process started for a member's configuration, as Popen leaves one a signal interrupted before it
    returned: stop() finds it by its command line and kills it."""
    group = PatroniGroup(tmp_path, "127.0.0.1:1")
    config = tmp_path / "member1" / "patroni.json"
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", str(config)], start_new_session=True
    )
    try:
        # Until the child execs, its command line is still this interpreter's: stop() could not know it.
        cmdline = Path(f"/proc/{stray.pid}/cmdline")
        wait_until(lambda: str(config).encode() in cmdline.read_bytes(), "the stray process runs its command")
        group.stop()
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


@pytest.mark.slow
def test_each_member_s_own_links_go_through_the_proxies_it_is_given(zookeeper: ZooKeeper) -> None:
    """A fault on a member must reach its own links: its Patroni's session with ZooKeeper goes through its proxy, and
    the standby streams from the primary through the primary's proxy (so a commit, synchronous, crosses it)."""
    skip_without_patroni()
    folder = Path(tempfile.mkdtemp(prefix="keyfailover-patroni-"))  # under /tmp: open to the postgres user
    group = PatroniGroup(folder, zookeeper.hosts, namespace=f"/kf-store-{uuid.uuid4().hex[:8]}")
    links: dict[str, tuple[FaultProxy, FaultProxy]] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        for name in group.names:
            to_zookeeper = FaultProxy(("127.0.0.1", zookeeper.port)).start()
            stack.callback(to_zookeeper.close)
            to_postgresql = FaultProxy(("127.0.0.1", group.ports[name])).start()
            stack.callback(to_postgresql.close)
            group.reach_through(name, zookeeper=f"127.0.0.1:{to_zookeeper.port}", postgresql=to_postgresql.port)
            links[name] = (to_zookeeper, to_postgresql)
        with pytest.raises(ServiceError, match="has no member 'member9'; its members: \\['member0', 'member1'\\]"):
            group.reach_through("member9", zookeeper=zookeeper.hosts, postgresql=1)
        stack.enter_context(group)
        primary = group.wait_until_ready()
        streamed = links[primary][1].stats().bytes_down
        assert _writes(group.dsn, 1) is not None
        assert all(to_zookeeper.stats().active >= 1 for to_zookeeper, _ in links.values())
        assert links[primary][1].stats().active >= 1 and links[primary][1].stats().bytes_down > streamed
