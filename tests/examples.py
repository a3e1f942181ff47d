"""The scripts of examples/ as modules, for the tests that run them on the shared SparkSession."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
from pyspark import cloudpickle

__all__ = ["EXAMPLES", "example_module"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@contextmanager
def example_module(name: str) -> Iterator[ModuleType]:
    """The example ``name`` as a module, importing its neighbours as it does when run as a script; its functions
    go to Spark's workers by value, as a script's do, since the workers cannot import it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))
        module = importlib.import_module(name)
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
        try:
            yield module
        finally:
            cloudpickle.unregister_pickle_by_value(module)  # type: ignore[no-untyped-call]
