"""A ``keyfailover serve`` of the examples: an embedded server on free loopback ports, in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import TracebackType


class LocalServer:
    """``keyfailover serve --data-dir`` with its admin endpoint, on free loopback ports, in a child process."""

    def __init__(self, data_dir: Path) -> None:
        command = [sys.executable, "-m", "keyfailover", "serve", "--data-dir", str(data_dir)]
        command += ["--port", "0", "--metrics-port", "0"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        listening = self.process.stdout.readline()
        metrics = self.process.stdout.readline()
        if not listening.startswith("listening on ") or not metrics.startswith("metrics on "):
            self.stop()
            raise SystemExit(f"keyfailover serve did not start: {listening!r} {metrics!r}")
        self.url = "kf://" + listening.removeprefix("listening on ").strip()
        self.admin_url = metrics.removeprefix("metrics on ").strip()

    def stop(self) -> None:
        """Stop the server and wait for it."""
        self.process.terminate()
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
