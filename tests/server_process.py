"""Start and stop real ``keyfailover serve`` processes on loopback for the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = ["ServerProcess"]


class ServerProcess:
    """``keyfailover serve`` in a child process, on a free loopback port."""

    def __init__(self, data_dir: Path, *extra: str, port: int = 0) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.port = port
        self.process: subprocess.Popen[str] | None = None
        self.admin_url: str | None = None
        self.stderr: IO[str] | None = None

    def start(self) -> ServerProcess:
        command = [
            sys.executable,
            "-m",
            "keyfailover",
            "serve",
            "--data-dir",
            str(self.data_dir),
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
        return self

    @property
    def url(self) -> str:
        return f"kf://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown code runs."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)

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
        """What the server wrote on stderr so far."""
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        return self.stderr.read()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
