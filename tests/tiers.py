"""The test tiers: which tests start real processes, and a guard that holds every other test to that.

Markers, registered in pyproject.toml and checked with ``--strict-markers``:

- ``integration``: the test starts real processes, such as ``keyfailover serve``, a CLI interpreter,
  ZooKeeper, PostgreSQL, Spark's JVM or a headless Chromium.
- ``cluster``: it needs ZooKeeper or PostgreSQL; always integration too.
- ``spark``: it needs a local Spark session; always integration too.
- ``slow``: it takes seconds without starting anything, such as a long property search.

``./scripts/test --fast`` runs what carries none of them: the unit tier.

A test gets its markers three ways: by hand, ``@pytest.mark.integration`` or a module's
``pytestmark``; from the shared fixtures it uses, by :data:`SERVICE_FIXTURES`; from a fixture of its
module that starts processes and says so with :func:`starts_processes`. :class:`ProcessGuard` then
holds the marks to the truth: while a test outside the integration tier sets up or runs, starting a
process fails it, even when the test catches the error.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

__all__ = [
    "SERVICE_FIXTURES",
    "TIERS",
    "ProcessGuard",
    "ProcessOutsideIntegrationTierError",
    "starts_processes",
    "tiers_of",
]

TIERS = ("integration", "cluster", "spark", "slow")
"""Every marker that takes a test out of the unit tier."""

SERVICE_FIXTURES: dict[str, tuple[str, ...]] = {
    "zookeeper": ("integration", "cluster"),
    "postgres": ("integration", "cluster"),
    "patroni": ("integration", "cluster"),
    "java": ("integration", "spark"),
    "spark": ("integration", "spark"),
    "browser": ("integration",),
}
"""The markers a test gets for using a shared fixture of tests/conftest.py that starts a service."""

_STARTS_PROCESSES = "__starts_processes__"

_F = TypeVar("_F", bound=Callable[..., Any])


def starts_processes(fixture: _F) -> _F:
    """Mark a fixture function as starting processes: every test that uses it is in the integration tier.

    Put it under ``@pytest.fixture``, so that it marks the function itself."""
    setattr(fixture, _STARTS_PROCESSES, True)
    return fixture


def tiers_of(fixtures: Iterable[tuple[str, object]]) -> set[str]:
    """The markers a test gets from the fixtures it uses: pairs of a fixture's name and its function."""
    tiers: set[str] = set()
    for name, function in fixtures:
        tiers.update(SERVICE_FIXTURES.get(name, ()))
        if getattr(function, _STARTS_PROCESSES, False):
            tiers.add("integration")
    return tiers


class ProcessOutsideIntegrationTierError(RuntimeError):
    """A test outside the integration tier tried to start a process."""


class ProcessGuard:
    """While entered, starting a process raises :class:`ProcessOutsideIntegrationTierError` and is recorded.

    It covers what starts processes in Python: :class:`subprocess.Popen`, which ``subprocess.run``,
    asyncio's subprocesses and Spark's gateway go through, ``os.fork``, ``os.system``,
    ``os.posix_spawn``, and uvloop's subprocesses, which libuv starts. A process started by another
    program, such as Spark's Python workers started by its JVM, is not seen.
    """

    def __init__(self, test: str) -> None:
        self.test = test
        self.violations: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def _refuse(self, what: str) -> ProcessOutsideIntegrationTierError:
        """Record that ``what`` was started; the error to raise in its place."""
        self.violations.append(what)
        return ProcessOutsideIntegrationTierError(
            f"{self.test} started a process ({what}) but is not in the integration tier: "
            "mark it @pytest.mark.integration, or have a fixture that starts it use @starts_processes"
        )

    def _replace(self, owner: object, name: str, replacement: object) -> None:
        """Set ``owner.name`` to ``replacement`` until exit."""
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def __enter__(self) -> ProcessGuard:
        guard = self

        def execute_child(popen: subprocess.Popen[Any], args: object, *_rest: object, **_options: object) -> None:
            raise guard._refuse(f"subprocess.Popen {args!r}")

        def refused(name: str) -> Callable[..., Any]:
            def refuse(*args: object, **_options: object) -> Any:
                raise guard._refuse(f"os.{name} {args[:1]!r}")

            return refuse

        def loop_refused(name: str) -> Callable[..., Any]:
            async def refuse(_loop: object, _protocol: object, *args: object, **_options: object) -> Any:
                raise guard._refuse(f"uvloop {name} {args[:1]!r}")

            return refuse

        self._replace(subprocess.Popen, "_execute_child", execute_child)
        for name in ("fork", "system", "posix_spawn", "posix_spawnp"):
            self._replace(os, name, refused(name))
        try:
            import uvloop
        except ImportError:
            pass
        else:  # uvloop starts asyncio's subprocesses with libuv, not through subprocess.Popen
            for name in ("subprocess_exec", "subprocess_shell"):
                self._replace(uvloop.Loop, name, loop_refused(name))
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
