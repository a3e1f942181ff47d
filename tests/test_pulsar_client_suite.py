"""scripts/pulsar_client_suite.py, which runs the official Pulsar client's own tests: its sorting of tests into
kinds, and its verdicts, each shown on a small suite of planted tests (the real suite is not in the
repository)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pulsar_client_suite.py"

PLANTED = textwrap.dedent(
    """
    import threading
    from unittest import TestCase

    ADMIN_URL = "http://localhost:8080"
    SERVICE_URL = "pulsar://localhost:6650"


    def _make_partitioned(name):
        return ADMIN_URL + "/admin/v2/persistent/" + name


    class Planted(TestCase):
        serviceUrl = SERVICE_URL

        def _client(self):
            return self.serviceUrl

        def test_broker(self):
            self.assertTrue(self._client())

        def test_admin_through_a_helper(self):
            self._client()
            _make_partitioned("t")

        def test_offline(self):
            self.assertEqual(1 + 1, 2)

        def test_fails(self):
            raise ValueError("planted failure")

        def test_hangs(self):
            threading.Event().wait()


    class WithSetUp(TestCase):
        def setUp(self):
            self.url = "pulsar://localhost:6650"

        def test_broker_by_its_set_up(self):
            self.assertTrue(self.url)
    """
)


@cache
def _script() -> ModuleType:
    """The script, loaded as a module."""
    spec = importlib.util.spec_from_file_location("pulsar_client_suite", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_each_test_is_sorted_by_what_it_and_what_it_calls_reach() -> None:
    kinds = {test.name: test.kind for test in _script().classify(PLANTED, "planted_test")}
    assert kinds == {
        "Planted.test_broker": "broker",
        "Planted.test_admin_through_a_helper": "admin",
        "Planted.test_offline": "offline",
        "Planted.test_fails": "offline",
        "Planted.test_hangs": "offline",
        "WithSetUp.test_broker_by_its_set_up": "broker",
    }


@pytest.mark.integration  # each planted test runs in an interpreter of its own
def test_a_pass_a_failure_and_a_hang_are_told_apart(tmp_path: Path) -> None:
    (tmp_path / "planted_test.py").write_text(PLANTED)
    script = _script()
    tests = {test.name: test for test in script.classify(PLANTED, "planted_test")}
    for name, timeout in (("Planted.test_offline", 60.0), ("Planted.test_fails", 60.0), ("Planted.test_hangs", 0.5)):
        script._run(tmp_path, tests[name], timeout)
    assert tests["Planted.test_offline"].outcome == "passed"
    failed = tests["Planted.test_fails"]
    assert (failed.outcome, failed.error) == ("failed", "ValueError: planted failure")
    assert tests["Planted.test_hangs"].outcome == "timeout"
