"""The build: plain Python, or with ``KEYFAILOVER_COMPILED=1`` the hot path compiled by mypyc.

Every metadata field is in pyproject.toml; this file only adds the extension modules. Without the
switch nothing is compiled and neither a compiler nor mypy is needed. With it, each module of
``COMPILED`` becomes a C extension beside its ``.py`` source, which then stays in the package
unused. mypyc type-checks the package as mypy does, so the compiled build is made without build
isolation, in an environment that has the runtime dependencies and the dev extra's mypy and
stubs: ``scripts/setup --compiled`` does that in ``.venv-compiled`` (docs/development.md).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

SWITCH = "KEYFAILOVER_COMPILED"
"""The environment variable that asks for the compiled build when it is ``1`` at install."""

COMPILED = (
    "keyfailover/wire/_ints.py",
    "keyfailover/broker/storage/_cache.py",
    "keyfailover/broker/server/_subscription.py",
)
"""The modules the compiled build compiles: the subscription's pump, the entry cache and the batch int check."""


def compiled_requested() -> bool:
    """Whether this install asks for the compiled build; any value but ``0``, ``1`` or unset is refused."""
    value = os.environ.get(SWITCH, "0")
    if value not in ("0", "1"):
        raise SystemExit(f"{SWITCH} must be 1 (compile the hot path with mypyc) or 0 (plain Python), not {value!r}")
    return value == "1"


def extensions() -> list[Extension]:
    """The C extensions of the compiled build, or none for the plain one."""
    if not compiled_requested():
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit(
            f"{SWITCH}=1 needs mypy, which ships mypyc, in the build environment: install the dev extra "
            "first and then this package with pip's --no-build-isolation, as scripts/setup --compiled does"
        ) from None
    return mypycify(list(COMPILED), opt_level="3")


if __name__ == "__main__":
    setup(ext_modules=extensions())
