"""The ``keyfailover`` command line: one module per group of commands, each declaring its options
beside its handler (``add_*`` adds a command to the parser, with its handler as ``run``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from keyfailover.core.errors import KeyFailoverError
from keyfailover.tools.cli import _admin, _cluster, _messages, _runs, _serve
from keyfailover.tools.cli._common import Command, _UsageError

__all__ = ["main"]

_COMMANDS = (
    _runs.add_demo,
    _runs.add_evaluate,
    _runs.add_chaos,
    _serve.add_serve,
    _messages.add_produce,
    _messages.add_consume,
    _messages.add_export,
    _admin.add_ranges,
    _admin.add_admin,
    _admin.add_dlq,
    _cluster.add_topics,
    _cluster.add_cluster,
    _admin.add_stats,
    _runs.add_plot,
)
"""Each command's ``add_*``, in the order ``keyfailover --help`` lists them."""


def _parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser = argparse.ArgumentParser(prog="keyfailover", description="Key-hash-range dispatcher (PIP-34 Key_Failover)")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (2 usage, 1 failure, 130 interrupted)."""
    parser = _parser()
    args = parser.parse_args(argv)
    name = f"keyfailover {args.command}"
    run: Command = args.run
    try:
        return run(args)
    except _UsageError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`keyfailover consume | head -1`)
        _discard_stdout()
        return 0
    except KeyFailoverError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
