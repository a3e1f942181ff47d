"""Fixtures shared across test modules: one local SparkSession, one ZooKeeper, one PostgreSQL and one
headless Chromium for the whole run, each started by the first test that asks and stopped at the end.

The hooks here sort the tests into tiers (see tests/tiers.py): a test is marked by the fixtures it
uses, and a test outside the integration tier fails if it starts a process."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.tiers import SERVICE_FIXTURES, ProcessGuard, tiers_of

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from selenium.webdriver.chrome.webdriver import WebDriver

    from keyfailover.tools.services import PatroniGroup, PostgreSQL, ZooKeeper


def pytest_configure(config: pytest.Config) -> None:
    """No Hypothesis plugins; Ctrl-C acted on, here and in every process the tests start, even when the
    run was started with it ignored (a background job of a non-interactive shell, as CI may start it).
    An ignored SIGINT is inherited across exec and Python then leaves it ignored, so a test that sends
    one to a command would wait for nothing; a handler is reset to the default at exec, so children act
    on it again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Hypothesis loads the plugins installed packages declare, on its first import: trio's (Selenium
    # brings trio) runs ``ldconfig`` then, which would fail a unit-tier test that imports Hypothesis first.
    # The tests use no Hypothesis plugin.
    os.environ.setdefault("HYPOTHESIS_NO_PLUGINS", "1")
    # matplotlib builds its font cache on its first import in a new home, running ``fc-list``: built here,
    # before any guard, or a unit-tier test that draws a chart first (a chaos report) would fail for it.
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.font_manager  # noqa: F401


SHARED_GROUP = "shared-services"
"""The pytest-xdist group of every test file that uses a shared service (tests/tiers.py's ``SERVICE_FIXTURES``)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by the fixtures it uses, before ``-m`` deselects by the marks.

    Under pytest-xdist (``scripts/test`` runs two workers) each test file also goes whole to one worker, and every
    file that uses a shared service to the same one: so a run still starts one ZooKeeper, one PostgreSQL, one
    SparkSession and one browser, and a file's module fixtures run once."""
    shared: set[Path] = set()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        if SERVICE_FIXTURES.keys() & info.name2fixturedefs.keys():
            shared.add(item.path)
        fixtures = [(name, definition.func) for name, defs in info.name2fixturedefs.items() for definition in defs]
        marked = {mark.name for mark in item.iter_markers()}
        for tier in sorted(tiers_of(fixtures) | ({"integration"} if marked & {"cluster", "spark"} else set())):
            if tier not in marked:
                item.add_marker(tier)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(
                pytest.mark.xdist_group(SHARED_GROUP if item.path in shared else item.nodeid.split("::")[0])
            )


def _guarded(item: pytest.Item) -> Generator[None, object, object]:
    """Run one phase of ``item``, under a :class:`ProcessGuard` when it is not in the integration tier."""
    if item.get_closest_marker("integration") is not None:
        return (yield)
    guard = ProcessGuard(item.nodeid)
    with guard:
        result = yield
    if guard.violations:  # also when the test caught the error
        pytest.fail(f"{item.nodeid} started a process outside the integration tier: {guard.violations}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    """Fixtures set up for a test outside the integration tier start no process."""
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """A test outside the integration tier starts no process.

    Teardown is not guarded: the last test of a run may stop a session's service, and stopping one
    may run a command, as PostgreSQL's ``pg_ctl stop``."""
    return (yield from _guarded(item))


@pytest.fixture(scope="session")
def java() -> str:
    """The ``java`` that Spark starts; the test is skipped when there is none."""
    found = shutil.which("java")
    if found is None:
        pytest.skip("Java is required for the Spark tests (no java on PATH)")
    return found


@pytest.fixture(scope="session")
def spark(java: str) -> Iterator[SparkSession]:
    """A ``local[2,2]`` SparkSession on loopback, made by the first test that asks and stopped at the end.

    Python workers run the interpreter running the tests; ANSI mode is on, as by default in
    Spark 4. A failed task runs once more before its job fails, as on a cluster, so that the tests
    of exactly once see a task retried. Skipped only when there is no ``java`` to start Spark with.
    """
    from keyfailover.integrations.spark import local_session

    previous = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = local_session(
        "keyfailover-tests",
        task_attempts=2,
        config={"spark.sql.shuffle.partitions": "4", "spark.sql.ansi.enabled": "true"},
    )
    try:
        yield session
    finally:
        session.stop()
        if previous is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = previous


@pytest.fixture(scope="session")
def browser() -> Iterator[WebDriver]:
    """Debian's Chromium, headless, driven by Selenium through Debian's chromedriver; quit at the end.

    Skipped, naming what is missing and how to install it, only when Chromium, chromedriver or
    Selenium cannot be found (``scripts/setup-system``, which ``scripts/test`` runs, installs the first two).
    """
    from keyfailover.tools._browser import browser_missing, start_chromium

    missing = browser_missing()
    if missing is not None:
        pytest.skip(missing)
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeper]:
    """Debian's ZooKeeper 3.8 on a free loopback port, with a 100 ms tick (sessions from 200 ms)."""
    from keyfailover.tools.services import ZooKeeper

    with ZooKeeper(tmp_path_factory.mktemp("zookeeper")) as server:
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgreSQL]:
    """Debian's PostgreSQL 15 on a free loopback port, its cluster in a temporary folder."""
    from keyfailover.tools.services import PostgreSQL

    folder = Path(tempfile.mkdtemp(prefix="keyfailover-postgresql-"))  # under /tmp: open to the postgres user
    with PostgreSQL(folder) as server:
        yield server
    shutil.rmtree(folder, ignore_errors=True)  # owned by the postgres user when run as root


@pytest.fixture
def patroni(zookeeper: ZooKeeper) -> Iterator[PatroniGroup]:
    """A fresh Patroni group of two PostgreSQL members, a primary and a synchronous standby, its state in the
    session's ZooKeeper under a namespace of its own; stopped and removed afterwards. Skipped with what is
    missing when Patroni is not installed."""
    import uuid

    from keyfailover.tools.services import PatroniGroup
    from tests.server_process import skip_without_patroni

    skip_without_patroni()
    folder = Path(tempfile.mkdtemp(prefix="keyfailover-patroni-"))  # under /tmp: open to the postgres user
    try:
        with PatroniGroup(folder, zookeeper.hosts, namespace=f"/kf-store-{uuid.uuid4().hex[:8]}") as started:
            yield started
    finally:
        shutil.rmtree(folder, ignore_errors=True)
