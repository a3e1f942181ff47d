"""The replicated store: a Patroni group that keyfailover only follows.

Two PostgreSQL servers under Debian's Patroni, which keeps its state in the test run's ZooKeeper:
one primary and a synchronous standby. A commit acknowledged by the primary is on the standby
too, so when the primary dies (Patroni and PostgreSQL SIGKILLed together, as a machine that dies)
the promoted standby still has it, and a client of the URL naming every member writes again. The
killed member comes back as a standby; when the primary then freezes, it is promoted in turn.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from keyfailover.broker.storage._postgresql_members import connect_writable
from keyfailover.tools.services import PatroniGroup, ServiceError, _children
from tests.server_process import wait_until


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
        return asyncio.run(_write(dsn, value))
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


@pytest.mark.slow
def test_a_commit_survives_the_primary_s_kill_which_comes_back_as_a_standby_then_a_frozen_one_is_replaced(
    patroni: PatroniGroup,
) -> None:
    first = patroni.primary()
    second = next(name for name in patroni.names if name != first)
    before_kill = _writes(patroni.dsn, 1)
    assert before_kill is not None
    assert second in before_kill[1]  # the commit returned only once this standby had it
    patroni.kill(first)
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
        group.stop()
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
