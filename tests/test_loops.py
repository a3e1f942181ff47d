"""The event loop choice: uvloop when installed, asyncio's own otherwise; ``serve --loop`` and $KEYFAILOVER_LOOP."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyfailover.client import Client
from keyfailover.core import loops
from keyfailover.core.errors import ConfigError
from keyfailover.core.loops import LOOP_ENV, chosen_loop, loop_class, loop_name, new_loop, set_loop_factory
from tests.aio import run_async
from tests.server_process import ServerProcess

uvloop = pytest.importorskip("uvloop")


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop as if it were not installed: importing it fails."""
    monkeypatch.setitem(sys.modules, "uvloop", None)


@pytest.fixture
def default_policy() -> Iterator[None]:
    """The standard event loop policy for the test and after it, whatever was set before."""
    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(None)
    yield
    asyncio.set_event_loop_policy(before)


def test_auto_takes_uvloop_when_installed_and_the_environment_decides_without_a_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(LOOP_ENV, raising=False)
    assert chosen_loop("auto") == "uvloop"
    assert chosen_loop() == "uvloop"
    assert chosen_loop("asyncio") == "asyncio"
    monkeypatch.setenv(LOOP_ENV, "asyncio")
    assert chosen_loop() == "asyncio"
    assert chosen_loop("uvloop") == "uvloop"  # an explicit choice wins over the environment

    class Subclassed(loop_class("uvloop")):  # type: ignore[misc]
        """A subclass of uvloop's loop, as the chaos worker's lossy consumers make."""

    subclassed = Subclassed()
    subclassed.close()
    assert loop_name(subclassed) == "uvloop"
    monkeypatch.setenv(LOOP_ENV, "")
    assert chosen_loop() == "uvloop"
    assert loop_class("uvloop") is uvloop.Loop
    assert loop_class("asyncio") is asyncio.SelectorEventLoop


@pytest.mark.usefixtures("no_uvloop")
def test_without_uvloop_auto_falls_back_and_asking_for_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen_loop("auto") == "asyncio"
    with pytest.raises(ConfigError, match=r"loop 'uvloop' needs the uvloop package.*keyfailover\[fast\]"):
        chosen_loop("uvloop")
    monkeypatch.setenv(LOOP_ENV, "uvloop")
    with pytest.raises(ConfigError, match=r"^\$KEYFAILOVER_LOOP 'uvloop' needs the uvloop package"):
        chosen_loop()


def test_an_unknown_name_is_refused_naming_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^loop 'libev' is not one of auto, asyncio, uvloop$"):
        chosen_loop("libev")
    monkeypatch.setenv(LOOP_ENV, "Uvloop")
    with pytest.raises(ConfigError, match=r"^\$KEYFAILOVER_LOOP 'Uvloop' is not one of auto, asyncio, uvloop$"):
        new_loop()


@pytest.mark.usefixtures("default_policy")
def test_new_loops_are_of_the_chosen_kind_and_run() -> None:
    for choice, kind in (("uvloop", uvloop.Loop), ("asyncio", asyncio.SelectorEventLoop)):
        loop = new_loop(choice)
        try:
            assert type(loop) is kind
            assert loop_name(loop) == choice
            assert loop.run_until_complete(asyncio.sleep(0, choice)) == choice
        finally:
            loop.close()


@pytest.mark.parametrize("choice", ["uvloop", "asyncio"])
def test_the_tests_own_loops_are_of_the_kind_their_processes_run_on(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    async def running() -> str:
        return loop_name(asyncio.get_running_loop())

    monkeypatch.setenv(LOOP_ENV, choice)
    assert run_async(running()) == choice


class _Mine(asyncio.SelectorEventLoop):
    """A loop of a program's own making."""


@pytest.mark.usefixtures("default_policy")
def test_a_policy_the_program_set_makes_the_loops() -> None:
    """A program's own policy decides, before Python 3.14."""

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            return _Mine()

    asyncio.set_event_loop_policy(Policy())
    loop = new_loop("uvloop")
    loop.close()
    assert type(loop) is _Mine
    assert loop_name(loop) == "asyncio"
    with pytest.raises(ConfigError, match="'bad' is not one of"):  # the choice is still checked
        new_loop("bad")


@pytest.fixture
def no_factory() -> Iterator[None]:
    """No loop factory before and after the test."""
    set_loop_factory(None)
    yield
    set_loop_factory(None)


@pytest.mark.usefixtures("default_policy", "no_factory")
def test_a_loop_factory_makes_every_loop_whatever_the_choice_until_unset() -> None:
    """How a program shapes each loop keyfailover makes (the chaos worker routes connections through its
    proxies), as a policy did before Python 3.14 deprecated them."""
    set_loop_factory(_Mine)
    for choice in ("uvloop", "asyncio", None):
        loop = new_loop(choice)
        loop.close()
        assert type(loop) is _Mine
    with pytest.raises(ConfigError, match="'bad' is not one of"):  # the choice is still checked
        new_loop("bad")
    set_loop_factory(None)
    loop = new_loop("uvloop")
    loop.close()
    assert type(loop) is uvloop.Loop


@pytest.mark.usefixtures("default_policy", "no_factory")
def test_a_loop_factory_that_is_not_callable_is_refused_and_the_one_set_stays() -> None:
    set_loop_factory(_Mine)
    with pytest.raises(TypeError, match=r"^a loop factory must be callable or None, not str$"):
        set_loop_factory("uvloop")  # type: ignore[arg-type]
    loop = new_loop("asyncio")
    loop.close()
    assert type(loop) is _Mine


class _PolicyReadError(Exception):
    """Raised by a planted ``asyncio.get_event_loop_policy``: the policy was read."""


@pytest.mark.usefixtures("no_factory")
def test_from_python_3_14_the_policy_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.14 deprecates event loop policies (reading one warns): there the choice alone decides."""

    def planted() -> asyncio.AbstractEventLoopPolicy:
        raise _PolicyReadError

    monkeypatch.setattr(asyncio, "get_event_loop_policy", planted)
    monkeypatch.setattr(loops, "_READS_POLICY", True)  # before 3.14
    with pytest.raises(_PolicyReadError):
        new_loop("asyncio")
    monkeypatch.setattr(loops, "_READS_POLICY", False)  # 3.14 and later
    loop = new_loop("asyncio")
    loop.close()
    assert type(loop) is asyncio.SelectorEventLoop


@pytest.mark.integration
@pytest.mark.usefixtures("default_policy")
@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_serve_runs_on_the_loop_asked_for_and_the_client_on_the_chosen_one(
    tmp_path: Path, choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "uvloop" if choice == "asyncio" else "asyncio"
    monkeypatch.setenv(LOOP_ENV, other)  # --loop wins over the environment
    with ServerProcess(tmp_path, "--loop", choice, "--log-level", "info") as server:
        monkeypatch.setenv(LOOP_ENV, choice)
        with Client(server.url) as client:
            assert type(client._loop) is loop_class(choice)
            producer = client.create_producer("t")
            producer.send(b"x", key="k")
            consumer = client.subscribe("t", "s")
            assert consumer.receive(timeout=10).payload == b"x"
    assert f"serving on the {choice} event loop" in server.errors()


@pytest.mark.integration
def test_serve_asked_for_uvloop_without_it_is_a_usage_error(tmp_path: Path) -> None:
    planted = tmp_path / "site"
    planted.mkdir()
    (planted / "uvloop.py").write_text('raise ImportError("planted: uvloop is not installed")\n')
    done = subprocess.run(
        [sys.executable, "-m", "keyfailover", "serve", "--data-dir", str(tmp_path / "data"), "--loop", "uvloop"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(planted), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 2
    assert "keyfailover serve: loop 'uvloop' needs the uvloop package" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made
