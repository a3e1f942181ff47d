"""The ``keyfailover`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keyfailover.demo import run_demo

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keyfailover", description="Key-hash-range dispatcher (PIP-34 Key_Failover)")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the dispatcher through joins, leaves and a stalled consumer")
    demo.add_argument("--messages", type=int, default=60_000, help="messages to publish (default 60000)")
    demo.add_argument("--keys", type=int, default=5_000, help="distinct Zipf(1.1) keys (default 5000)")
    demo.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        report = run_demo(messages=args.messages, keys=args.keys, seed=args.seed)
        return 1 if report.problems else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
