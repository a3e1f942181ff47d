"""Start and stop servers on loopback for the tests: real ``keyfailover serve`` processes, or in this process.

:class:`ServerProcess` is a server in a child process, for the tests that kill, suspend or
restart it, or read its log; :class:`ServerThread` is one in this process, for the tests that
only talk to it. :class:`RawConnection` talks to either over a plain socket, frame by frame, for
the tests that send what no well-behaved client would. :func:`run_cli` runs any ``keyfailover``
command in a child process, :func:`run_main` one that starts nothing in this process;
:func:`wait_until` polls for something a process is expected to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pytest

from keyfailover.broker.server import Server, ServerConfig
from keyfailover.core.loops import new_loop
from keyfailover.integrations.console import serve_console
from keyfailover.integrations.metrics import serve_metrics
from keyfailover.tools.cli import main
from keyfailover.tools.services import PatroniGroup
from keyfailover.wire.protocol import PROTOCOL_VERSION, Connect, Connected, Decoder, Frame, encode

__all__ = ["RawConnection", "ServerProcess", "ServerThread", "run_cli", "run_main", "wait_until"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``python -m keyfailover ARGS`` in a child process: its exit code, stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "keyfailover", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_main(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``keyfailover ARGS`` run by the CLI's ``main`` in this process: what :func:`run_cli` gives, with no
    interpreter to start.

    For a command that starts nothing and changes nothing of the process, such as a usage error or
    a client command against a server. ``stdin`` is what the command reads as its standard input.
    ``SystemExit`` ends the command as it ends the interpreter: an int is the exit code, a message is
    printed on stderr with exit code 1. Any other exception comes out of the call, where
    :func:`run_cli` would have printed a traceback.
    """
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exited:
                if exited.code is None or isinstance(exited.code, int):
                    code = exited.code or 0
                else:
                    print(exited.code, file=sys.stderr)
                    code = 1
    finally:
        sys.stdin = saved
    return subprocess.CompletedProcess(["keyfailover", *args], code, out.getvalue(), err.getvalue())


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Return once ``condition()`` holds; :class:`TimeoutError` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        pause.wait(0.01)


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """:func:`wait_until` on a running event loop: polls between its turns."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.01)


class ServerProcess:
    """``keyfailover serve`` in a child process, on a free loopback port.

    ``data_dir`` None: a broker of a cluster (``extra`` then gives ``--cluster`` and ``--store``).
    """

    def __init__(self, data_dir: Path | None, *extra: str, port: int = 0) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.port = port
        self.process: subprocess.Popen[str] | None = None
        self.admin_url: str | None = None
        self.pulsar_url: str | None = None
        """``pulsar://HOST:PORT`` of the Pulsar protocol endpoint (with ``--pulsar-port`` in ``extra``)."""
        self.stderr: IO[str] | None = None

    def start(self) -> ServerProcess:
        command = [
            sys.executable,
            "-m",
            "keyfailover",
            "serve",
            *([] if self.data_dir is None else ["--data-dir", str(self.data_dir)]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # stderr goes to a file: a pipe nobody reads could fill up and stall the server.
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (lives as long as the process)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # blocks until the server accepts connections, or exits
        if not line.startswith("listening on "):
            self.process.wait(timeout=10)
            raise RuntimeError(f"server did not start: {line!r} {self.errors()}")
        self.port = int(line.rsplit(":", 1)[1])
        if "--metrics-port" in self.extra:
            admin = self.process.stdout.readline()
            if not admin.startswith("metrics on "):
                raise RuntimeError(f"server printed no metrics address: {admin!r}")
            self.admin_url = admin.split("metrics on ", 1)[1].strip()
        if "--pulsar-port" in self.extra:
            pulsar = self.process.stdout.readline()
            if not pulsar.startswith("pulsar protocol on "):
                raise RuntimeError(f"server printed no Pulsar address: {pulsar!r}")
            self.pulsar_url = pulsar.split("pulsar protocol on ", 1)[1].strip()
        return self

    @property
    def url(self) -> str:
        return f"kf://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown code runs."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)

    def suspend(self) -> None:
        """SIGSTOP: the process is alive but does nothing (a long GC pause, a frozen VM)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`suspend`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> int:
        """SIGTERM and wait for a clean exit; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode

    def errors(self) -> str:
        """What the server wrote on stderr so far.

        Read with ``pread``, which leaves the file's offset alone: the server writes at that offset (it
        shares the open file), so a seek to the start while it runs would have it overwrite its own log."""
        if self.stderr is None:
            return ""
        fd = self.stderr.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class ServerThread:
    """A :class:`Server` in this process, on an event loop of its own thread, on a free loopback port.

    It answers as :class:`ServerProcess` does: the same ``port``, ``url``, ``admin_url`` (with
    ``metrics_port`` set, ``/metrics`` and the console's ``/ui`` included) and ``pulsar_url``, without a new
    interpreter to start. :meth:`errors` is what the process would have logged on stderr: the warnings and errors
    logged on the server's thread, with their tracebacks. :meth:`call` runs code on its loop.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = 0
        self.admin_url: str | None = None
        self.pulsar_url: str | None = None
        self._loop = new_loop()
        self._thread = threading.Thread(target=self._run, name="keyfailover server", daemon=True)
        self._server: Server | None = None
        self._log = io.StringIO()
        self._handler = logging.StreamHandler(self._log)
        self._handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._handler.addFilter(lambda record: record.thread == self._thread.ident)

    def _run(self) -> None:
        """The thread: the loop until :meth:`stop`, then every task it still has cancelled."""
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        left = asyncio.all_tasks(self._loop)
        for task in left:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self._loop.close()

    def call(self, work: Callable[[Server], Any], timeout: float = 60.0) -> Any:
        """``work(server)`` on the server's loop, awaited when it returns an awaitable; its result."""

        async def run() -> Any:
            assert self._server is not None
            result = work(self._server)
            return await result if asyncio.isfuture(result) or asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def start(self) -> ServerThread:
        async def started() -> Server:
            server = Server(self.config)
            if self.config.metrics_port is not None:
                serve_metrics(server)
                serve_console(server)
            await server.start()
            return server

        logging.getLogger().addHandler(self._handler)
        self._thread.start()
        try:
            self._server = asyncio.run_coroutine_threadsafe(started(), self._loop).result(60)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            logging.getLogger().removeHandler(self._handler)
            raise
        self.port = self._server.address[1]
        if self._server.admin_address is not None:
            scheme = "https" if self.config.tls_cert is not None else "http"
            self.admin_url = "{}://{}:{}".format(scheme, *self._server.admin_address)
        if self._server.pulsar_address is not None:
            scheme = "pulsar+ssl" if self.config.tls_cert is not None else "pulsar"
            self.pulsar_url = "{}://{}:{}".format(scheme, *self._server.pulsar_address)
        return self

    @property
    def url(self) -> str:
        return f"kf://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Close the server as ``serve`` does at SIGTERM, then end its loop and thread."""
        if self._server is not None:
            self.call(lambda server: server.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        logging.getLogger().removeHandler(self._handler)

    def errors(self) -> str:
        """The warnings and errors logged on the server's thread so far, each with its traceback."""
        return self._log.getvalue()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class RawConnection:
    """A plain TCP connection to a server: send any bytes or frames, read the frames it answers.

    Every read is bounded by ``timeout`` seconds (a :class:`TimeoutError` past it). What the
    server sends is decoded with a client-side :class:`Decoder`, so a malformed server frame
    raises :class:`~keyfailover.core.errors.ProtocolError` here.
    """

    def __init__(self, port: int, *, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._decoder = Decoder(accept="client")
        self._frames: deque[Frame] = deque()
        self.eof = False

    def send(self, *items: Frame | bytes) -> None:
        """Write frames (encoded) and raw bytes, in order, in one ``sendall``."""
        self.sock.sendall(b"".join(item if isinstance(item, bytes) else encode(item) for item in items))

    def connect(self, token: str | None = None) -> Connected:
        """Send a valid ``connect``; return the server's ``connected``."""
        self.send(Connect(version=PROTOCOL_VERSION, token=token, client="tests raw connection"))
        frame = self.receive()
        assert isinstance(frame, Connected), f"expected connected, got {frame!r}"
        return frame

    def receive(self) -> Frame:
        """The next frame; raises :class:`EOFError` when the server closed the connection first."""
        while not self._frames:
            if self.eof or not self._read():
                raise EOFError("the server closed the connection")
        return self._frames.popleft()

    def receive_until(self, kind: type[Frame]) -> list[Frame]:
        """Frames up to and including the first of type ``kind``."""
        frames = [self.receive()]
        while not isinstance(frames[-1], kind):
            frames.append(self.receive())
        return frames

    def until_closed(self) -> list[Frame]:
        """Every frame still to come, once the server closed the connection."""
        while not self.eof:
            self._read()
        return self.received()

    def received(self) -> list[Frame]:
        """The frames read so far and not yet taken, without waiting for more."""
        frames = list(self._frames)
        self._frames.clear()
        return frames

    def half_close(self) -> None:
        """Send EOF: the server reads what was sent, then sees the end of the stream."""
        self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()

    def _read(self) -> bool:
        """Read once; False at the end of the stream (a reset counts as the end)."""
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        self._frames.extend(self._decoder.feed(data))
        return True

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def skip_without_patroni() -> None:
    """Skip the test, saying what is missing, when a Patroni group cannot run here."""
    missing = PatroniGroup.missing()
    if missing is not None:
        pytest.skip(missing)
