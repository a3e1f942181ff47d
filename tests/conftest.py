"""Fixtures shared across test modules: one local SparkSession for the whole run."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def java() -> str:
    """The ``java`` that Spark starts; the test is skipped when there is none."""
    found = shutil.which("java")
    if found is None:
        pytest.skip("Java is required for the Spark tests (no java on PATH)")
    return found


@pytest.fixture(scope="session")
def spark(java: str) -> Iterator[SparkSession]:
    """A ``local[2]`` SparkSession on loopback, made by the first test that asks and stopped at the end.

    Python workers run the interpreter running the tests; ANSI mode is on, as by default in
    Spark 4. Skipped only when there is no ``java`` to start Spark with.
    """
    from keyfailover.integrations.spark import local_session

    previous = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = local_session(
        "keyfailover-tests", config={"spark.sql.shuffle.partitions": "4", "spark.sql.ansi.enabled": "true"}
    )
    try:
        yield session
    finally:
        session.stop()
        if previous is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = previous
