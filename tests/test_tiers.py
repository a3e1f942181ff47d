"""The test tiers hold: a test outside the integration tier that starts a process fails, and ``-m`` sorts by
the fixtures a test uses.

The planted tests run in a pytest of their own, in this process, with this project's configuration
and the hooks of tests/conftest.py: what they would do in the suite, they do there.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiers import SERVICE_FIXTURES, TIERS, ProcessGuard, ProcessOutsideIntegrationTierError, tiers_of

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

PLANTED = """
import subprocess
import sys

import pytest

from tests.tiers import starts_processes


@pytest.fixture
def child():
    return subprocess.run([sys.executable, "-c", "pass"], check=False)


@pytest.fixture
@starts_processes
def declared():
    raise AssertionError("a fixture that starts processes set up outside the integration tier")


def test_starts_a_process_in_its_body():
    subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_starts_one_and_swallows_the_error():
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    except Exception:
        pass


def test_starts_one_in_a_fixture(child):
    pass


def test_uses_a_declared_fixture(declared):
    pass


def test_uses_zookeeper(zookeeper):
    raise AssertionError("ZooKeeper started outside the integration tier")


def test_starts_nothing():
    assert sum(range(4)) == 6
"""


@pytest.fixture
def planted(pytester: pytest.Pytester) -> pytest.Pytester:
    """A folder with this project's pytest configuration, tests/conftest.py's hooks and :data:`PLANTED`."""
    pytester.makepyprojecttoml((ROOT / "pyproject.toml").read_text())
    pytester.makeconftest("from tests.conftest import *  # noqa: F403")
    pytester.makepyfile(test_planted=PLANTED)
    return pytester


def test_the_unit_tier_fails_a_test_that_starts_a_process_and_deselects_what_needs_one(
    planted: pytest.Pytester,
) -> None:
    result = planted.runpytest_inprocess(
        "test_planted.py",
        "-m",
        "not integration and not cluster and not spark and not slow",
        "-p",
        "no:cacheprovider",
        "-rA",
    )
    result.assert_outcomes(passed=1, failed=2, errors=1, deselected=2)
    result.stdout.fnmatch_lines_random([
        "PASSED test_planted.py::test_starts_nothing",
        "FAILED test_planted.py::test_starts_a_process_in_its_body*",
        "FAILED test_planted.py::test_starts_one_and_swallows_the_error*",
        "ERROR test_planted.py::test_starts_one_in_a_fixture*",
        "E * test_planted.py::test_starts_a_process_in_its_body started a process (subprocess.Popen *) but is not in "
        "the integration tier: mark it @pytest.mark.integration*",
        "E * test_planted.py::test_starts_one_and_swallows_the_error started a process outside the integration tier*",
        "E * test_planted.py::test_starts_one_in_a_fixture started a process (subprocess.Popen *) but is not in*",
    ])  # fmt: skip


def test_the_fixtures_a_test_uses_put_it_in_its_tiers(planted: pytest.Pytester) -> None:
    for expression, selected in (
        ("integration", ["test_uses_a_declared_fixture", "test_uses_zookeeper"]),
        ("cluster", ["test_uses_zookeeper"]),
        ("spark or slow", []),
    ):
        result = planted.runpytest_inprocess(
            "test_planted.py", "--collect-only", "-q", "-m", expression, "-p", "no:cacheprovider"
        )
        names = sorted(line.split("::")[1] for line in result.outlines if "::" in line)
        assert names == selected, (expression, result.outlines)


def _planted_file(fixture: str | None) -> str:
    """A test file of four tests, the first using ``fixture`` (a stand-in of that name: nothing is started)."""
    stand_in = "" if fixture is None else f"@pytest.fixture\ndef {fixture}():\n    return 'stand-in'\n\n\n"
    first = "" if fixture is None else fixture
    tests = "".join(f"def test_{index}({first if index == 0 else ''}):\n    pass\n\n\n" for index in range(4))
    return f"import pytest\n\n\n{stand_in}{tests}"


@pytest.mark.integration
def test_on_two_workers_a_file_runs_whole_on_one_and_every_file_of_the_shared_services_on_the_same_one(
    planted: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How scripts/test runs the suite: every file that uses ZooKeeper, PostgreSQL, Spark or the browser on the worker
    that started it, so a run starts one of each."""
    planted.makepyfile(
        test_zookeeper=_planted_file("zookeeper"),
        test_spark=_planted_file("spark"),
        test_plain=_planted_file(None),
        test_other=_planted_file(None),
    )
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = planted.runpytest_subprocess(
        "test_zookeeper.py", "test_plain.py", "test_spark.py", "test_other.py",
        "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(passed=16)
    workers: dict[str, set[str]] = {}
    for line in result.outlines:
        if line.startswith("[gw") and " PASSED " in line:
            workers.setdefault(line.split(" PASSED ")[1].split("::")[0], set()).add(line[1 : line.index("]")])
    assert sorted(workers) == ["test_other.py", "test_plain.py", "test_spark.py", "test_zookeeper.py"], result.outlines
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers
    assert workers["test_spark.py"] == workers["test_zookeeper.py"], workers


def test_an_unregistered_marker_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml((ROOT / "pyproject.toml").read_text())
    pytester.makepyfile(test_typo="import pytest\n\n@pytest.mark.integraton\ndef test_typo():\n    pass\n")
    result = pytester.runpytest_inprocess("test_typo.py", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*'integraton' not found in `markers` configuration option*"])


def test_every_tier_is_registered_and_strict() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert sorted(line.split(":", 1)[0] for line in options["markers"]) == sorted(TIERS)
    assert "--strict-markers" in options["addopts"].split()


def test_service_fixtures_bring_integration_and_their_own_tier() -> None:
    assert tiers_of([("zookeeper", None), ("tmp_path", None)]) == {"integration", "cluster"}
    assert tiers_of([("spark", None)]) == {"integration", "spark"}
    assert tiers_of([("tmp_path", None), ("capsys", None)]) == set()
    assert all("integration" in tiers for tiers in SERVICE_FIXTURES.values())


def _popen() -> object:
    return subprocess.run([sys.executable, "-c", "pass"], check=False)


def _system() -> object:
    return os.system("true")


def _spawn() -> object:
    return os.posix_spawn("/bin/true", ["true"], {})


async def _child() -> int:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    return await process.wait()


def _asyncio() -> object:
    return asyncio.run(_child())


def _uvloop() -> object:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_child())


@pytest.mark.parametrize(
    "start", [_popen, _system, _spawn, _asyncio, _uvloop], ids=["popen", "system", "spawn", "asyncio", "uvloop"]
)
def test_the_guard_refuses_every_way_to_start_a_process(start: Callable[[], object]) -> None:
    with ProcessGuard("planted") as guard, pytest.raises(ProcessOutsideIntegrationTierError, match="planted started"):
        start()
    assert len(guard.violations) == 1


@pytest.mark.integration
def test_an_integration_test_starts_processes_unguarded() -> None:
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0
