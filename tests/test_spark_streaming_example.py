"""The streaming example of examples/spark_streaming.py: its checker against planted faults, and the pipeline
itself on the shared SparkSession against a server in this process, stopped mid-stream and restarted."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from pyspark.sql import SparkSession

from keyfailover.broker.server import ServerConfig
from keyfailover.spark import register
from tests.examples import example_module
from tests.server_process import ServerThread

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """examples/spark_streaming.py as a module."""
    with example_module("spark_streaming") as module:
        yield module


EXPECTED = {"a": [(0, 1, 5), (0, 4, 2), (0, 9, 10)], "b": [(1, 2, -1), (1, 3, -3)]}


@pytest.mark.parametrize(
    ("stored", "counts"),
    [
        (EXPECTED, (0, 0, 0, 0)),
        ({"a": EXPECTED["a"], "b": EXPECTED["b"][:1]}, (1, 0, 0, 0)),
        ({"a": EXPECTED["a"] + [(0, 9, 10)], "b": EXPECTED["b"]}, (0, 1, 0, 0)),
        ({"a": [EXPECTED["a"][1], EXPECTED["a"][0], EXPECTED["a"][2]], "b": EXPECTED["b"]}, (0, 0, 1, 0)),
        ({"a": EXPECTED["a"], "b": [(1, 2, -1), (1, 3, -4)]}, (0, 0, 0, 1)),
        ({"a": EXPECTED["a"], "b": EXPECTED["b"], "c": [(0, 5, 1)]}, (0, 0, 0, 1)),
    ],
    ids=["equal", "missing", "stored-twice", "out-of-order", "wrong-balance", "unknown-account"],
)
def test_the_check_catches_each_planted_fault(
    example: ModuleType, stored: dict[str, list[tuple[int, int, int]]], counts: tuple[int, int, int, int]
) -> None:
    found = example.check(EXPECTED, stored)
    assert (found.missing, found.duplicated, found.out_of_order, found.wrong) == counts
    assert found.passed is (counts == (0, 0, 0, 0))


def test_the_pipeline_stores_every_balance_once_in_order_across_a_restart(
    spark: SparkSession, example: ModuleType, tmp_path: Path
) -> None:
    register(spark)
    args = argparse.Namespace(count=2_400, accounts=60, per_trigger=400, seed=11)
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server:
        assert server.admin_url is not None
        demo = example.demo_run(spark, server.url, server.admin_url, tmp_path / "checkpoint", args)
    assert demo.first == example.Run(batches=[0], events=400, stopped=True)  # 800 of the first 1,200 left
    # Run 2 starts with batch 0 again, its commit lost, its 400 balances stored already; then 2,000 events more.
    assert demo.replayed == 0 and demo.second.batches == [0, 1, 2, 3, 4, 5]
    assert demo.second.events == 2_400
    assert demo.check.accounts == 60
    assert (demo.check.expected, demo.check.stored) == (2_400, 2_400)
    assert demo.check.passed, demo.check.describe()
