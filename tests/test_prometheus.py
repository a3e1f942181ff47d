"""A real Prometheus scrapes a real ``keyfailover serve`` and agrees with its ``/ranges``.

The scrape config is metrics/prometheus.yml pointed at the test server, scraping every
second, with metrics/alerts.yml loaded; Prometheus (Debian's prometheus package;
scripts/setup-system installs it) runs on a free loopback port with a temporary TSDB. The
test polls Prometheus's HTTP API until two scrapes of the server are stored and every alert
rule was evaluated, then reads the range metrics back through PromQL: one series per range
(a consumer may own several), shares and range counts per consumer, the policy per
subscription. Prometheus applies a
new target list about 5 s after it starts, so the test takes about 7 s.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.error import URLError
from urllib.parse import urlencode, urlsplit
from urllib.request import urlopen

import pytest
import yaml

from keyfailover.client import Client
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.tools.services import free_port, stop_process
from tests.server_process import ServerProcess

PROMETHEUS = shutil.which("prometheus")
METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"
DEADLINE = 30.0  # seconds; a healthy run needs about 3

pytestmark = [
    pytest.mark.integration,  # a server and Prometheus in processes of their own
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not installed (Debian package prometheus; scripts/setup-system installs it)",
    ),
]

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], log: Path | None = None) -> T:
    """Poll ``check`` until it returns something other than None; fail after ``DEADLINE`` seconds."""
    deadline = time.monotonic() + DEADLINE
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            shown = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log is not None else ""
            pytest.fail(f"gave up after {DEADLINE:.0f} s waiting for {what}\n{shown}")
        time.sleep(0.1)


def get_json(url: str) -> Any:
    with urlopen(url, timeout=10) as response:
        return json.load(response)


@contextmanager
def prometheus(tmp_path: Path, target: str) -> Iterator[str]:
    """A Prometheus scraping ``target`` (host:port) every second; yields its base URL."""
    assert PROMETHEUS is not None
    config = yaml.safe_load((METRICS_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(METRICS_DIR / rules) for rules in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    log = tmp_path / "prometheus.log"
    port = free_port()
    command = [
        PROMETHEUS,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with log.open("w", encoding="utf-8") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool | None:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited with {process.returncode}:\n{log.read_text(encoding='utf-8')}")
            try:
                with urlopen(f"{url}/-/ready", timeout=2) as response:
                    return True if response.status == 200 else None
            except (URLError, ConnectionError):
                return None

        wait_for("prometheus to be ready", ready, log)
        yield url
    finally:
        stop_process(process)


def query(url: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's vector result."""
    answer = get_json(f"{url}/api/v1/query?{urlencode({'query': promql})}")
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def by_labels(result: list[dict[str, Any]], *names: str) -> dict[tuple[str, ...], float]:
    return {tuple(item["metric"][name] for name in names): float(item["value"][1]) for item in result}


def test_prometheus_scrapes_range_shares_that_match_the_servers_ranges(tmp_path: Path) -> None:
    with ExitStack() as stack:
        server = stack.enter_context(ServerProcess(tmp_path / "data", "--metrics-port", "0"))
        assert server.admin_url is not None
        client = stack.enter_context(Client(server.url))
        producer = client.create_producer("orders")
        for i in range(300):
            producer.send_async(b"x", key=f"account-{i}")
        producer.flush()
        consumers = {
            name: client.subscribe("orders", "billing", consumer_name=name) for name in ("b1", "b2", "b3", "b4")
        }
        consumers |= {name: client.subscribe("orders", "audit", consumer_name=name) for name in ("a1", "a2")}
        consumers["b2"].close()  # its range merges into a neighbour's
        ranges_before = get_json(f"{server.admin_url}/ranges")

        url = stack.enter_context(prometheus(tmp_path, urlsplit(server.admin_url).netloc))
        log = tmp_path / "prometheus.log"

        def scraped_twice() -> list[dict[str, Any]] | None:
            result = query(url, 'count_over_time(keyfailover_range_map_epoch{job="keyfailover"}[1m])')
            return result if len(result) == 2 and all(float(r["value"][1]) >= 2 for r in result) else None

        wait_for("two scrapes of both subscriptions", scraped_twice, log)

        def rules_evaluated() -> list[dict[str, Any]] | None:
            groups = get_json(f"{url}/api/v1/rules")["data"]["groups"]
            rules: list[dict[str, Any]] = [rule for group in groups for rule in group["rules"]]
            return rules if rules and all(rule["health"] != "unknown" for rule in rules) else None

        rules = wait_for("every alert rule to be evaluated", rules_evaluated, log)
        assert {rule["name"]: rule["health"] for rule in rules} == {rule["name"]: "ok" for rule in rules}, rules
        assert by_labels(query(url, 'up{job="keyfailover"}'), "job") == {("keyfailover",): 1.0}

        totals = by_labels(
            query(url, "sum by (topic, subscription) (keyfailover_range_share)"), "topic", "subscription"
        )
        per_range = ("topic", "subscription", "consumer", "range")
        starts = by_labels(query(url, "keyfailover_range_start"), *per_range)
        ends = by_labels(query(url, "keyfailover_range_end"), *per_range)
        shares = by_labels(query(url, "keyfailover_range_share"), "topic", "subscription", "consumer")
        counts = by_labels(query(url, "keyfailover_consumer_ranges"), "topic", "subscription", "consumer")
        policies = by_labels(query(url, "keyfailover_rebalance_policy_info"), "subscription", "policy", "max_ranges")
        ranges_after = get_json(f"{server.admin_url}/ranges")

    assert ranges_after == ranges_before, "the ranges changed while Prometheus scraped; nothing should move them"
    assert totals == {("orders", "audit"): pytest.approx(1.0), ("orders", "billing"): pytest.approx(1.0)}
    # The n-th range of a consumer (in hash order) is the series with range="n".
    expected: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for listed in ranges_after["subscriptions"]:
        assert listed["ranges"]["version"] == 2
        seen: Counter[str] = Counter()
        for owned in listed["ranges"]["ranges"]:
            consumer = owned["consumer"]
            key = (listed["topic"], listed["subscription"], consumer, str(seen[consumer]))
            expected[key] = (owned["start"], owned["end"])
            seen[consumer] += 1
    assert {key[2] for key in expected if key[1] == "billing"} == {"b1", "b3", "b4"}
    assert {key: (starts[key], ends[key]) for key in starts} == expected
    assert set(ends) == set(expected)
    widths: Counter[tuple[str, str, str]] = Counter()
    for (topic, subscription, consumer, _), (start, end) in expected.items():
        widths[(topic, subscription, consumer)] += end - start + 1
    assert shares == {key: width / HASH_RANGE_SIZE for key, width in widths.items()}
    assert counts == dict(Counter(key[:3] for key in expected))
    assert policies == {("audit", "multi", "16"): 1.0, ("billing", "multi", "16"): 1.0}
