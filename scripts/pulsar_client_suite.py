"""Run the official Pulsar Python client's own tests, unmodified, against ``keyfailover serve --pulsar-port``.

Run by ``scripts/pulsar-client-suite SUITE`` where SUITE is a checkout of apache/pulsar-client-python (the
tag matching the installed ``pulsar-client``; its ``tests`` folder is used) or that ``tests`` folder. The
suite is not part of this repository; docs/pulsar.md says where the figures it prints come from.

The suite's tests reach a broker at ``pulsar://localhost:6650`` (and ``pulsar+ssl://localhost:6651`` for the
TLS ones, with the certificates in its ``test-conf``) and, for some, Pulsar's admin REST API at
``http://localhost:8080``, which keyfailover does not serve. So this script starts two embedded servers on
127.0.0.1 with temporary data folders: one with ``--pulsar-port 6650`` and one with ``--pulsar-port 6651``
speaking TLS with the suite's broker certificate. Each test runs alone in a child process, ``python -m
unittest FILE.CLASS.TEST`` in the suite's ``tests`` folder, under a timeout, so a test that hangs fails
without stopping the others.

Each test is sorted, from its source and that of everything it calls in its file, into one kind:

- ``broker``: it speaks the binary protocol to the broker and nothing else (the issue's bar: ≥ 90 % pass);
- ``admin``: it also needs the admin REST API; not run unless ``--admin`` is given (they then fail);
- ``offline``: it starts no connection (schema encoding, argument checks); run, counted apart.

It prints a table per file and kind, then every test of kind ``broker`` that did not pass with the last
line of its error; ``--json FILE`` writes each test's kind, outcome and error.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

FILES = ("pulsar_test", "asyncio_test", "reader_test", "schema_test")
"""The suite's files whose tests speak the binary protocol, as the issue names them."""
_BROKER = re.compile(r"serviceUrl|SERVICE_URL|pulsar(\+ssl)?://localhost")
_ADMIN = re.compile(r"adminUrl|ADMIN_URL|localhost:8080|doHttp|urlopen|requests\.(get|put|post|delete)")
_ERROR = re.compile(r"^[\w.]+(Error|Exception|Timeout)\b|^[\w.]+: ")
"""The line of a failed test's output that says what went wrong: the exception it ended with."""
_SETUP = ("setUp", "asyncSetUp", "setUpClass", "tearDown", "asyncTearDown", "tearDownClass")


@dataclass
class Outcome:
    """One test of the suite: where it is, its kind, and how it ended."""

    file: str
    name: str
    """``CLASS.TEST``."""
    kind: str
    outcome: str = "not run"
    """``passed``, ``failed``, ``skipped``, ``timeout`` or ``not run``."""
    seconds: float = 0.0
    error: str = ""


def _names(node: ast.AST) -> set[str]:
    """The names and attribute names ``node`` refers to: what it may call in its file."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
    return found


def classify(source: str, file: str) -> list[Outcome]:
    """The tests of one suite file, each of its kind: see the module's docstring."""
    tree = ast.parse(source)
    text: dict[str, str] = {}  # every function and method of the file by name, with the source of its body
    calls: dict[str, set[str]] = {}
    tests: list[tuple[str, str, list[str]]] = []  # class, test, the class's set-up methods
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            text[node.name] = ast.get_source_segment(source, node) or ""
            calls[node.name] = _names(node)
        elif isinstance(node, ast.ClassDef):
            setups: list[str] = []
            for item in node.body:
                if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                text.setdefault(item.name, "")
                text[item.name] += ast.get_source_segment(source, item) or ""
                calls.setdefault(item.name, set()).update(_names(item))
                if item.name.startswith("test"):
                    tests.append((node.name, item.name, setups))
                elif item.name in _SETUP:
                    setups.append(item.name)
    outcomes = []
    for cls, test, setups in tests:
        seen: set[str] = set()
        todo = [test, *setups]
        while todo:
            name = todo.pop()
            if name in seen or name not in text:
                continue
            seen.add(name)
            todo.extend(calls[name])
        body = "".join(text[name] for name in seen)
        if _ADMIN.search(body):
            kind = "admin"
        elif _BROKER.search(body):
            kind = "broker"
        else:
            kind = "offline"
        outcomes.append(Outcome(file, f"{cls}.{test}", kind))
    return outcomes


def _tests_folder(suite: Path) -> Path:
    """The suite's ``tests`` folder, given it or the checkout holding it."""
    for folder in (suite / "tests", suite):
        if (folder / "pulsar_test.py").is_file():
            return folder
    raise SystemExit(
        f"{suite} holds no pulsar_test.py; expected a checkout of apache/pulsar-client-python or its tests"
    )


@contextmanager
def _server(data: Path, pulsar_port: int, tls: Path | None) -> Iterator[None]:
    """``keyfailover serve`` on 127.0.0.1 serving Pulsar on ``pulsar_port``, TLS with the suite's broker certificate
    from ``tls`` when given; stopped on leaving."""
    command = [sys.executable, "-m", "keyfailover", "serve", "--data-dir", str(data), "--port", "0"]
    command += ["--pulsar-port", str(pulsar_port)]
    if tls is not None:
        command += ["--tls-cert", str(tls / "broker-cert.pem"), "--tls-key", str(tls / "broker-key.pem")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline(), process.stdout.readline()]
        if not lines[-1].startswith("pulsar protocol on"):
            raise SystemExit(f"keyfailover serve --pulsar-port {pulsar_port} did not start: {lines!r}")
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def _run(folder: Path, test: Outcome, timeout: float) -> None:
    """Run one test in a child process and record how it ended."""
    started = time.monotonic()
    command = [sys.executable, "-m", "unittest", f"{test.file}.{test.name}"]
    try:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        test.outcome, test.error = "timeout", f"still running after {timeout:.0f} s"
    else:
        summary = done.stderr.strip().splitlines()
        verdict = summary[-1] if summary else ""
        if verdict.startswith("OK"):
            # unittest's own verdict: a client that then crashes on the way out still passed the test
            test.outcome = "skipped" if "skipped" in verdict else "passed"
            if done.returncode != 0:
                test.error = f"exit code {done.returncode} after the test passed"
        else:
            test.outcome = "failed"
            errors = [line for line in summary if _ERROR.match(line)]
            test.error = (errors or summary or ["(no output)"])[-1][:300]
    test.seconds = time.monotonic() - started


def _table(outcomes: list[Outcome]) -> str:
    """Passed out of run, per file and kind, then in all."""
    rows = [
        "| file | kind | tests | passed | failed | timeout | skipped | not run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for test in outcomes:
        groups.setdefault((test.file, test.kind), []).append(test)
        groups.setdefault(("all", test.kind), []).append(test)
    for (file, kind), tests in groups.items():
        counts = [
            sum(t.outcome == name for t in tests) for name in ("passed", "failed", "timeout", "skipped", "not run")
        ]
        rows.append(f"| {file} | {kind} | {len(tests)} | " + " | ".join(map(str, counts)) + " |")
    return "\n".join(rows)


def main() -> int:
    """Classify, run and report: see the module's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", type=Path, help="a checkout of apache/pulsar-client-python, or its tests folder")
    parser.add_argument("--files", default=",".join(FILES), help=f"suite files to run (default {','.join(FILES)})")
    parser.add_argument("-k", dest="pattern", default="", help="run only tests whose CLASS.TEST contains this")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds one test may take (default 150)")
    parser.add_argument("--admin", action="store_true", help="run the tests needing the admin REST API too")
    parser.add_argument("--list", action="store_true", help="print each test's kind and run nothing")
    parser.add_argument("--json", type=Path, help="write every test's kind, outcome and error here")
    args = parser.parse_args()
    folder = _tests_folder(args.suite)
    outcomes: list[Outcome] = []
    for file in args.files.split(","):
        path = folder / f"{file}.py"
        if not path.is_file():
            raise SystemExit(f"{path} does not exist; expected one of {', '.join(FILES)}")
        outcomes += [t for t in classify(path.read_text(), file) if args.pattern in t.name]
    if args.list:
        for test in outcomes:
            print(f"{test.kind:8} {test.file}.{test.name}")
        return 0
    data = Path(tempfile.mkdtemp(prefix="kf-pulsar-suite-"))
    try:
        with _server(data / "plain", 6650, None), _server(data / "tls", 6651, folder / "test-conf"):
            for index, test in enumerate(outcomes, 1):
                if test.kind == "admin" and not args.admin:
                    continue
                _run(folder, test, args.timeout)
                print(
                    f"[{index}/{len(outcomes)}] {test.outcome:7} {test.seconds:6.1f} s  {test.file}.{test.name}",
                    flush=True,
                )
    finally:
        shutil.rmtree(data, ignore_errors=True)
    print()
    print(_table(outcomes))
    broker = [t for t in outcomes if t.kind == "broker"]
    passed = sum(t.outcome == "passed" for t in broker)
    print(f"\nbinary-protocol tests: {passed} of {len(broker)} passed ({100 * passed / max(len(broker), 1):.1f} %)")
    for test in broker:
        if test.outcome != "passed":
            print(f"  {test.outcome:7} {test.file}.{test.name}: {test.error}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(t) for t in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
