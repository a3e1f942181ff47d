"""Link faults in the kernel: a process in a network namespace of its own, reached over a veth pair.

The other way to "random-loss" besides :mod:`._proxy`: the harness runs a process inside a
:class:`Namespace` and shapes the veth's queues with ``tc``. A zero-length ``pfifo`` drops
every packet (a partition that TCP sees as loss: it retransmits, and the connection carries on
when the queue is healed before TCP gives up); ``tbf`` limits the rate; ``netem`` (delay and a
loss probability) only where the kernel has it. Each side of the pair shapes what leaves it,
so ``"out"`` faults what the process sends and ``"in"`` what it receives.

It needs root, ``ip`` and ``tc``: :func:`support` says whether this machine has them and a
kernel that lets them work, and whether ``netem`` is there. The process inside has its own
loopback: it reaches the host at :attr:`Namespace.host_address` only, so what it talks to
must listen there (or on every address), not on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from keyfailover.core.errors import ConfigError, KeyFailoverError

__all__ = ["Namespace", "NamespaceError", "NetnsSupport", "support"]

Side = Literal["in", "out"]
_SIDES: dict[str, tuple[Side, ...]] = {"in": ("in",), "out": ("out",), "both": ("in", "out")}
_NETWORK = ipaddress.ip_network("10.213.0.0/16")  # carved into /30s, one per namespace
_numbers = itertools.count()


class NamespaceError(KeyFailoverError, RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and what it printed."""


@dataclass(frozen=True)
class NetnsSupport:
    """Whether :class:`Namespace` works here (else ``reason`` says why), and whether ``netem`` does."""

    available: bool
    netem: bool
    reason: str = ""


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise NamespaceError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@functools.cache
def support() -> NetnsSupport:
    """Try it once (a throwaway namespace, then a ``netem`` qdisc on its veth) and remember the answer."""
    if os.geteuid() != 0:
        return NetnsSupport(False, False, "network namespaces need root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return NetnsSupport(False, False, f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)")
    try:
        with Namespace() as probe:
            try:
                probe.netem(0.001, direction="out")
            except NamespaceError:
                return NetnsSupport(True, False)
            return NetnsSupport(True, True)
    except NamespaceError as exc:
        return NetnsSupport(False, False, str(exc))


def _unused_subnet(subnets: int) -> int:
    """The index of a /30 of the network no address of the host lies in."""
    listed = _run("ip", "-o", "-4", "addr", "show")
    addresses = (ipaddress.ip_address(found) for found in re.findall(r"inet ([0-9.]+)/", listed))
    used = {(int(address) - int(_NETWORK.network_address)) // 4 for address in addresses if address in _NETWORK}
    start = os.getpid() * 16 + next(_numbers)
    for index in range(start, start + subnets):
        if index % subnets not in used:
            return index % subnets
    raise NamespaceError(f"every /30 of {_NETWORK} is in use")


class Namespace:
    """A network namespace joined to the host by a veth pair on a /30 of 10.213.0.0/16.

    Made on :meth:`open` (or entering the context), with loopback up inside; :meth:`close`
    kills whatever still runs inside and deletes the namespace, which deletes the pair too.
    ``index`` picks the /30; by default the first one no interface of the host has an address
    in, from a place that depends on the process id (so that test runs side by side do not race
    for the same one).
    """

    def __init__(self, index: int | None = None) -> None:
        subnets = 2 ** (30 - _NETWORK.prefixlen)
        number = _unused_subnet(subnets) if index is None else index
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < subnets:
            raise ConfigError(f"index must be an int from 0 to {subnets - 1}, got {number!r}")
        base = _NETWORK.network_address + 4 * number
        self.host_address = str(base + 1)
        """The host's end: what a process inside connects to."""
        self.address = str(base + 2)
        """The namespace's end: where a process inside can be reached from the host."""
        tag = f"{os.getpid() % 100000}x{number}"
        self.name = f"kf{tag}"
        self.host_interface = f"kfh{tag}"[:15]
        """The host's end of the veth pair."""
        self._inside_link = f"kfn{tag}"[:15]
        self._open = False

    def open(self) -> Namespace:
        """Create the namespace and its veth pair, addressed and up; on a failure, what was made is removed again."""
        _run("ip", "netns", "add", self.name)
        self._open = True
        try:
            _run("ip", "link", "add", self.host_interface, "type", "veth", "peer", "name", self._inside_link)
            _run("ip", "link", "set", self._inside_link, "netns", self.name)
            _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self.host_interface)
            _run("ip", "link", "set", self.host_interface, "up")
            self._inside("ip", "addr", "add", f"{self.address}/30", "dev", self._inside_link)
            self._inside("ip", "link", "set", self._inside_link, "up")
            self._inside("ip", "link", "set", "lo", "up")
        except NamespaceError:
            self.close()
            raise
        return self

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the namespace (``options`` as for :class:`subprocess.Popen`)."""
        return subprocess.Popen(self.command(argv), **options)

    # -- faults ----------------------------------------------------------------------

    def drop_all(self, *, direction: str = "both") -> None:
        """Drop every packet (a zero-length ``pfifo``) until :meth:`heal`."""
        self._qdisc(direction, "pfifo", "limit", "0")

    def slow(self, bytes_per_second: int, *, direction: str = "both") -> None:
        """Limit the rate with a token bucket (``tbf``) until :meth:`heal`."""
        if isinstance(bytes_per_second, bool) or not isinstance(bytes_per_second, int) or bytes_per_second < 1:
            raise ConfigError(f"bytes_per_second must be an int of at least 1, got {bytes_per_second!r}")
        burst = max(bytes_per_second // 10, 3000)  # at least two full-size frames, or nothing passes
        self._qdisc(direction, "tbf", "rate", f"{bytes_per_second * 8}bit", "burst", str(burst), "latency", "1s")

    def netem(self, delay: float, loss: float = 0.0, *, direction: str = "both") -> None:
        """Delay every packet ``delay`` seconds and lose each with probability ``loss`` (kernels with netem)."""
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < 3600:
            raise ConfigError(f"delay must be a number of seconds from 0 to 3600, got {delay!r}")
        if isinstance(loss, bool) or not isinstance(loss, int | float) or not 0 <= loss <= 1:
            raise ConfigError(f"loss must be a probability from 0 to 1, got {loss!r}")
        self._qdisc(direction, "netem", "delay", f"{delay * 1e6:.0f}us", "loss", f"{loss * 100:g}%")

    def heal(self, *, direction: str = "both") -> None:
        """Back to a plain queue: every fault off."""
        self._qdisc(direction, "pfifo_fast")

    def _qdisc(self, direction: str, *qdisc: str) -> None:
        for side in self._sides(direction):
            tc = ["tc", "qdisc", "replace", "dev", self._link(side), "root", *qdisc]
            if side == "out":
                self._inside(*tc)
            else:
                _run(*tc)

    def _sides(self, direction: str) -> tuple[Side, ...]:
        if direction not in _SIDES:
            raise ConfigError(f"direction must be 'in', 'out' or 'both', got {direction!r}")
        if not self._open:
            raise NamespaceError(f"namespace {self.name} is not open")
        return _SIDES[direction]

    def _link(self, side: Side) -> str:
        # A queue shapes what leaves its interface: the process's packets leave the inside end.
        return self._inside_link if side == "out" else self.host_interface

    def _inside(self, *command: str) -> str:
        return _run(*self.command(command))

    # -- life cycle ------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs inside, delete the namespace (and with it the veth pair); idempotent."""
        if not self._open:
            return
        self._open = False
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _run("ip", "netns", "del", self.name)
        # The pair goes with the namespace once the last process inside is gone; do not wait for
        # that. Deleting the host's end deletes both, unless they went meanwhile.
        subprocess.run(["ip", "link", "del", self.host_interface], capture_output=True, check=False)

    def __enter__(self) -> Namespace:
        return self.open()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
