"""metrics/: the Grafana dashboard, the alert rules and the example Prometheus config.

Every PromQL expression may name only series the collector exports (``METRIC_NAMES``, which
tests/test_metrics.py pins to the real exposition) or series the rules record; rate-like
functions take counters and deriv-like ones gauges; the dashboard shows what issues 4 and 12
list. With promtool installed (Debian's prometheus package; scripts/setup-system installs it)
the rules, their unit tests, the config and every dashboard expression are checked by
Prometheus's own parser, and the range panels are evaluated by it on a real scrape.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from keyfailover.core.dispatcher import Dispatcher
from keyfailover.core.hashing import HASH_RANGE_SIZE
from keyfailover.integrations.metrics import (
    METRIC_NAMES,
    ClusterView,
    KeyFailoverCollector,
    ServedPartition,
    ServerView,
    SubscriptionView,
)

METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"
DASHBOARD = METRICS_DIR / "grafana-dashboard.json"
ALERTS = METRICS_DIR / "alerts.yml"
ALERTS_TEST = METRICS_DIR / "alerts_test.yml"
PROMETHEUS_YML = METRICS_DIR / "prometheus.yml"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[\w$]+")
_NAME = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "group_left", "group_right"}
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*\w+\s*\)\s*$", re.DOTALL)
_COUNTER_FUNCTIONS = re.compile(r"\b(rate|irate|increase|resets)\s*\(\s*([A-Za-z_:][\w:]*)")
_GAUGE_FUNCTIONS = re.compile(r"\b(deriv|delta|idelta|predict_linear)\s*\(\s*([A-Za-z_:][\w:]*)")
_GRAFANA_INTERVALS = re.compile(r"\$__(?:rate_interval|interval|range)\b|\$\{__(?:rate_interval|interval|range)\}")
_GRAFANA_VARIABLES = re.compile(r"\$\{?\w+\}?")
_COUNTER_SERIES = ("_total", "_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and label names left out)."""
    rest = _STRING.sub('""', expr)
    rest = _MATCHERS.sub(" ", rest)
    rest = _RANGE.sub(" ", rest)
    rest = _LABEL_LIST.sub(" ", rest)
    rest = _OFFSET.sub(" ", rest)
    names = set()
    for match in _NAME.finditer(rest):
        called = rest[match.end() :].lstrip().startswith("(")
        if not called and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def panels(node: Any) -> Iterator[dict[str, Any]]:
    """Every panel of the dashboard, inside rows too."""
    for panel in node.get("panels", []):
        yield panel
        yield from panels(panel)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def dashboard_exprs(node: Any, where: str = "dashboard") -> Iterator[tuple[str, str]]:
    """``(where, expr)`` for every ``expr`` anywhere in the dashboard (targets, annotations)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield where, value
            else:
                name = node.get("title") or node.get("name") or where
                yield from dashboard_exprs(value, f"{where} / {name}" if name != where else where)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item, where)


def template_selectors(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(variable, selector)`` of every ``label_values(selector, label)`` template variable."""
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        found = _LABEL_VALUES.match(query)
        assert found is not None, f"template variable {variable['name']}: {query!r} is not label_values(...)"
        if found.group(1) is not None:
            yield variable["name"], found.group(1)


def for_prometheus(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced, so Prometheus can parse it."""
    return _GRAFANA_VARIABLES.sub("x", _GRAFANA_INTERVALS.sub("1m", expr))


def alert_rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in alert_rules() if "record" in rule}


def misused_functions(expr: str) -> list[str]:
    """Rate-like functions over non-counters and deriv-like ones over counters."""
    wrong = [f"{f}({name})" for f, name in _COUNTER_FUNCTIONS.findall(expr) if not name.endswith(_COUNTER_SERIES)]
    return wrong + [f"{f}({name})" for f, name in _GAUGE_FUNCTIONS.findall(expr) if name.endswith(_COUNTER_SERIES)]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/setup-system installs it)")
    return found


def run_promtool(*arguments: str) -> str:
    done = subprocess.run(
        [promtool(), *arguments], cwd=METRICS_DIR, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(arguments)} failed:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


# -- the name extractor itself ------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('a_total{topic="$topic", x=~"b{1}|c"}', {"a_total"}),
        ("sum by (consumer) (rate(a_total[$__rate_interval]))", {"a_total"}),
        ("histogram_quantile(0.9, sum by (le, instance) (rate(h_bucket[5m])))", {"h_bucket"}),
        ("x > 0 and increase(y_total[10m]) == 0 and y_total offset 10m", {"x", "y_total"}),
        ("60 * -sum without (consumer) (g) / on (topic) group_left (z) k", {"g", "k"}),
        ("count_over_time(up[1m]) > 1e3 or vector(0)", {"up"}),
        ("sum(rate(s_sum[5m])) / sum(rate(s_count[5m]))", {"s_sum", "s_count"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
    ],
)
def test_metric_names_are_found_wherever_promql_puts_them(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_misused_functions_are_found() -> None:
    assert misused_functions("rate(g[5m]) + deriv(c_total[5m]) + rate(c_total[5m]) + deriv(g[5m])") == [
        "rate(g)",
        "deriv(c_total)",
    ]


# -- the Grafana dashboard ------------------------------------------------------------------


def test_dashboard_names_only_exported_metrics() -> None:
    board = dashboard()
    known = METRIC_NAMES | recorded_names()
    exprs = [*dashboard_exprs(board), *template_selectors(board)]
    assert len(exprs) > 20
    used: set[str] = set()
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: {expr!r} names no metric"
        assert names <= known, f"{where}: {expr!r} names {sorted(names - known)}, which the collector does not export"
        assert not misused_functions(expr), f"{where}: {expr!r}: {misused_functions(expr)}"
        used |= names
    # Every family the collector exports is on the dashboard somewhere.
    assert {_family(name) for name in METRIC_NAMES} - {_family(name) for name in used} == set()


def _family(sample: str) -> str:
    return re.sub(r"_(?:total|bucket|sum|count)$", "", sample)


@pytest.mark.parametrize(
    ("metric", "per_consumer"),
    [
        ("keyfailover_range_share", True),
        ("keyfailover_traffic_share", True),
        ("keyfailover_messages_dispatched_total", True),
        ("keyfailover_dispatch_rate", True),
        ("keyfailover_unacked_messages", True),
        ("keyfailover_replay_messages", True),
        ("keyfailover_draining_hashes", True),
        ("keyfailover_consumer_ranges", True),
        ("keyfailover_rebalances_total", False),
        ("keyfailover_rebalance_duration_seconds_bucket", False),
        ("keyfailover_load_imbalance", False),
        ("keyfailover_log_commit_seconds_bucket", False),
        ("keyfailover_consumer_stuck", True),
        ("keyfailover_leases_expired_total", True),
        ("keyfailover_dead_lettered_total", False),
        ("keyfailover_backoff_messages", False),
    ],
)
def test_dashboard_has_the_time_series_panels_the_issue_lists(metric: str, per_consumer: bool) -> None:
    graphs = [
        (panel, target)
        for panel in panels(dashboard())
        if panel["type"] == "timeseries"
        for target in panel.get("targets", [])
        if metric in metric_names(target["expr"])
    ]
    assert graphs, f"no time-series panel shows {metric}"
    if per_consumer:
        legends = [target.get("legendFormat", "") for _, target in graphs]
        assert any("{{consumer}}" in legend for legend in legends), f"{metric} is not drawn per consumer: {legends}"


def test_range_ownership_is_a_stacked_chart_of_range_share() -> None:
    (ownership,) = [p for p in panels(dashboard()) if p.get("title") == "Range ownership" and p["type"] == "timeseries"]
    target, unassigned = ownership["targets"]
    assert metric_names(target["expr"]) == {"keyfailover_range_share"}
    assert target["legendFormat"] == "{{consumer}}"
    assert metric_names(unassigned["expr"]) == {"keyfailover_unassigned_share"}, "a sticky subscription's gaps"
    defaults = ownership["fieldConfig"]["defaults"]
    assert defaults["custom"]["stacking"]["mode"] == "normal", "the shares must stack up to the whole hash space"
    assert (defaults["min"], defaults["max"]) == (0, 1), "the axis must show the whole hash space, 0 to 1"


def exposition_series(text: str, **target: str) -> list[dict[str, str]]:
    """Every sample of a Prometheus text exposition as a promtool input series holding its value for 5 minutes;
    ``target`` labels (job, instance) added as Prometheus adds them to what it scrapes."""
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ", ".join(
                f"{name}={json.dumps(value)}" for name, value in sorted((sample.labels | target).items())
            )
            found.append({"series": f"{sample.name}{{{labels}}}", "values": f"{sample.value!r}x5"})
    return found


def expected_samples(found: dict[tuple[tuple[str, str], ...], float]) -> list[dict[str, Any]]:
    """promtool's ``exp_samples`` for ``labels -> value``."""
    return [
        {"labels": "{" + ", ".join(f"{name}={json.dumps(value)}" for name, value in labels) + "}", "value": value}
        for labels, value in sorted(found.items())
    ]


@pytest.mark.integration
def test_range_panels_evaluate_to_the_range_map_with_a_consumer_owning_several_ranges(tmp_path: Path) -> None:
    """The range table, the Ranges, Policy and Ranges per consumer panels, evaluated by promtool on a real scrape
    (the policy panel shows the consume mode too)."""
    now = [0.0]
    dispatcher = Dispatcher(clock=lambda: now[0], max_ranges=4)
    for index in range(5):
        dispatcher.add_consumer(f"c{index}")
    for position in range(2_000):
        dispatcher.publish(position, f"k{position}")
    now[0] = 2.0
    dispatcher.poll()  # measures the traffic, so each consumer has a traffic share
    ranges = dispatcher.ranges()
    owners = [consumer for _, _, consumer in ranges]
    assert max(owners.count(consumer) for consumer in owners) >= 3, "the scenario needs a consumer with 3 ranges"
    registry = CollectorRegistry()
    registry.register(KeyFailoverCollector(lambda: [SubscriptionView("orders", "billing", dispatcher)]))
    text = generate_latest(registry).decode()
    (scraped,) = [f for f in text_string_to_metric_families(text) if f.name == "keyfailover_traffic_share"]
    traffic = {sample.labels["consumer"]: sample.value for sample in scraped.samples}
    assert min(traffic.values()) > 0 and sum(traffic.values()) == pytest.approx(1.0)

    sub = (("subscription", "billing"), ("topic", "orders"))
    per_range: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    widths: dict[str, int] = defaultdict(int)
    for start, end, consumer in ranges:
        widths[consumer] += end - start + 1
    ordinal: dict[str, int] = defaultdict(int)
    for start, end, consumer in ranges:
        labels = (("consumer", consumer), ("range", str(ordinal[consumer])), *sub)
        ordinal[consumer] += 1
        per_range["start"][(("__name__", "keyfailover_range_start"), *labels)] = start
        per_range["end"][(("__name__", "keyfailover_range_end"), *labels)] = end
        per_range["width"][labels] = (end - start + 1) / HASH_RANGE_SIZE
        per_range["consumer"][labels] = widths[consumer] / HASH_RANGE_SIZE
        per_range["traffic"][labels] = traffic[consumer]
    expected: dict[str, dict[str, dict[tuple[tuple[str, str], ...], float]]] = {
        "Ranges now": per_range,
        "Ranges": {"A": {(): len(ranges)}},
        "Policy and consume mode": {
            "A": {
                (
                    ("__name__", "keyfailover_rebalance_policy_info"),
                    ("max_ranges", "4"),
                    ("policy", "multi"),
                    *sub,
                ): 1.0
            },
            "B": {(("__name__", "keyfailover_consume_mode_info"), ("mode", "ordered"), *sub): 1.0},
        },
        "Ranges per consumer": {
            "A": {
                (("__name__", "keyfailover_consumer_ranges"), ("consumer", consumer), *sub): owners.count(consumer)
                for consumer in set(owners)
            }
        },
    }
    evaluate_panels(tmp_path, exposition_series(text), expected)


Expected = dict[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]
"""Panel title -> target refId -> the labels -> value its expression must evaluate to."""


def evaluate_panels(tmp_path: Path, series: list[dict[str, str]], expected: Expected) -> None:
    """promtool evaluates every target of the panels ``expected`` names on ``series`` ($topic: orders,
    $subscription: billing) and finds what ``expected`` says."""
    checks = []
    for panel in panels(dashboard()):
        for target in panel.get("targets", []) if panel.get("title") in expected else []:
            expr = target["expr"].replace("$topic", "orders").replace("$subscription", "billing")
            samples = expected_samples(expected[panel["title"]].pop(target["refId"]))
            checks.append({"expr": expr, "eval_time": "2m", "exp_samples": samples})
    assert all(not left for left in expected.values()), f"panels or targets not found: {expected}"
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": checks}],
    }
    unit_tests = tmp_path / "panels_test.yml"
    unit_tests.write_text(yaml.safe_dump(tests), encoding="utf-8")
    assert "SUCCESS" in run_promtool("test", "rules", str(unit_tests))


@pytest.mark.integration
def test_cluster_panels_evaluate_to_what_the_brokers_of_a_cluster_report(tmp_path: Path) -> None:
    """Partitions per broker, Coordinator and Partitions now, evaluated by promtool on the scrapes of two brokers
    of one cluster: the coordinator b1 serves 2 of orders' 3 partitions, b2 the third and audit (one partition)."""
    views = {
        "b1": ClusterView(
            coordinator=True,
            epoch=2,
            generation=5,
            assigned=4,
            brokers=2,
            served=[ServedPartition("orders", 0, 3), ServedPartition("orders", 1, 1)],
        ),
        "b2": ClusterView(
            coordinator=False,
            epoch=2,
            generation=5,
            assigned=4,
            brokers=2,
            served=[ServedPartition("orders", 2, 2), ServedPartition("audit", None, 1)],
        ),
    }
    series = []
    for instance, view in views.items():
        registry = CollectorRegistry()
        registry.register(KeyFailoverCollector(list, partial(ServerView, cluster=view)))
        series += exposition_series(generate_latest(registry).decode(), job="kf", instance=instance)
    epoch = "keyfailover_cluster_partition_owner_epoch"
    expected: Expected = {
        "Partitions per broker": {
            "A": {(("instance", "b1"),): 2, (("instance", "b2"),): 2},
            "B": {(("job", "kf"),): 4},
        },
        "Coordinator": {
            "A": {
                (("__name__", "keyfailover_cluster_coordinator"), ("instance", b), ("job", "kf")): float(b == "b1")
                for b in views
            }
        },
        "Partitions now": {
            "A": {
                (("__name__", epoch), ("instance", "b1"), ("job", "kf"), ("partition", "0"), ("topic", "orders")): 3,
                (("__name__", epoch), ("instance", "b1"), ("job", "kf"), ("partition", "1"), ("topic", "orders")): 1,
                (("__name__", epoch), ("instance", "b2"), ("job", "kf"), ("partition", "2"), ("topic", "orders")): 2,
                (("__name__", epoch), ("instance", "b2"), ("job", "kf"), ("topic", "audit")): 1,
            }
        },
    }
    evaluate_panels(tmp_path, series, expected)


def cluster_row() -> list[dict[str, Any]]:
    """The panels of the Cluster row: below its row panel, above the next row."""
    top = dashboard()["panels"]
    (row,) = [p for p in top if p["type"] == "row" and p["title"].startswith("Cluster")]
    below = [p for p in top if p["gridPos"]["y"] > row["gridPos"]["y"]]
    end = min((p["gridPos"]["y"] for p in below if p["type"] == "row"), default=float("inf"))
    return [p for p in below if p["gridPos"]["y"] < end]


@pytest.mark.parametrize(
    ("what", "metrics"),
    [
        ("partitions per broker", {"keyfailover_cluster_partition_served", "keyfailover_cluster_assigned_partitions"}),
        ("the coordinator", {"keyfailover_cluster_coordinator"}),
        ("epoch and generation", {"keyfailover_cluster_epoch", "keyfailover_cluster_generation"}),
        (
            "acquisitions and releases over time",
            {"keyfailover_cluster_partitions_acquired_total", "keyfailover_cluster_partitions_released_total"},
        ),
        ("acquire-time quantiles", {"keyfailover_cluster_partition_acquire_seconds_bucket"}),
    ],
)
def test_the_cluster_row_has_the_panels_issue_14_lists(what: str, metrics: set[str]) -> None:
    graphs = [
        panel
        for panel in cluster_row()
        if panel["type"] == "timeseries"
        and metrics <= set().union(*(metric_names(target["expr"]) for target in panel["targets"]))
    ]
    assert graphs, f"no time-series panel of the Cluster row shows {what} ({sorted(metrics)})"


def test_the_cluster_row_draws_acquire_time_quantiles_and_each_broker_on_its_own() -> None:
    (acquire,) = [p for p in cluster_row() if p["title"] == "Partition acquire time"]
    exprs = [target["expr"] for target in acquire["targets"]]
    assert [e.split(",")[0] for e in exprs if e.startswith("histogram_quantile")] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.9",
        "histogram_quantile(0.99",
    ]
    for panel in cluster_row():
        if panel["type"] == "timeseries" and panel["title"] != acquire["title"]:
            legends = [target["legendFormat"] for target in panel["targets"]]
            assert any("{{instance}}" in legend for legend in legends), f"{panel['title']} is not drawn per broker"


def test_dashboard_panels_are_unique_and_use_the_data_source_variable() -> None:
    board = dashboard()
    all_panels = list(panels(board))
    ids = [panel["id"] for panel in all_panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    names = {variable["name"] for variable in board["templating"]["list"]}
    assert {"datasource", "topic", "subscription"} <= names
    for panel in all_panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel.get("description"), f"panel {panel['title']!r} has no description"


@pytest.mark.integration
def test_dashboard_expressions_parse_in_prometheus(tmp_path: Path) -> None:
    board = dashboard()
    exprs = [expr for _, expr in dashboard_exprs(board)]
    rules = [{"record": f"dashboard:expr_{index}", "expr": for_prometheus(expr)} for index, expr in enumerate(exprs)]
    assert all("$" not in rule["expr"] for rule in rules)
    checked = tmp_path / "dashboard-rules.yml"
    checked.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    assert f"SUCCESS: {len(rules)} rules found" in run_promtool("check", "rules", str(checked))


# -- alert rules -----------------------------------------------------------------------------


def test_alert_rules_name_only_exported_metrics() -> None:
    known = METRIC_NAMES | recorded_names()
    rules = alert_rules()
    assert rules
    for rule in rules:
        name = rule.get("alert") or rule["record"]
        names = metric_names(rule["expr"])
        assert names, f"{name} names no metric"
        assert names <= known, f"{name} names {sorted(names - known)}, which the collector does not export"
        assert not misused_functions(rule["expr"]), f"{name}: {misused_functions(rule['expr'])}"


@pytest.mark.parametrize(
    ("what", "metrics"),
    [
        (
            "a consumer with unacked messages and no acks",
            {"keyfailover_unacked_messages", "keyfailover_messages_acked_total"},
        ),
        ("replay growing", {"keyfailover_replay_messages"}),
        ("backlog growing", {"keyfailover_backlog_messages"}),
        ("imbalance above a threshold", {"keyfailover_load_imbalance"}),
        ("a subscription with no consumers", {"keyfailover_consumers"}),
        ("a stuck consumer", {"keyfailover_consumer_stuck"}),
        ("dead-letter growth", {"keyfailover_dead_lettered_total"}),
        (
            "assigned partitions that no broker serves",
            {"keyfailover_cluster_assigned_partitions", "keyfailover_cluster_partition_served"},
        ),
        ("a cluster without a coordinator", {"keyfailover_cluster_coordinator"}),
    ],
)
def test_alert_rules_cover_what_the_issue_lists(what: str, metrics: set[str]) -> None:
    matching = [rule for rule in alert_rules() if "alert" in rule and metrics <= metric_names(rule["expr"])]
    assert matching, f"no alert rule for {what} (one naming {sorted(metrics)})"
    for rule in matching:
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{rule['alert']}: fires at once, without 'for'"
        assert rule["labels"]["severity"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_unit_tests_use_exported_series_and_show_every_alert_firing() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text(encoding="utf-8"))
    assert tests["rule_files"] == [ALERTS.name]
    series = {item["series"].split("{", 1)[0] for case in tests["tests"] for item in case["input_series"]}
    assert series <= METRIC_NAMES, f"unit tests feed series the collector does not export: {series - METRIC_NAMES}"
    firing = {
        check["alertname"] for case in tests["tests"] for check in case["alert_rule_test"] if check.get("exp_alerts")
    }
    quiet = {
        check["alertname"]
        for case in tests["tests"]
        for check in case["alert_rule_test"]
        if not check.get("exp_alerts")
    }
    alerts = {rule["alert"] for rule in alert_rules() if "alert" in rule}
    assert firing == alerts, f"alerts never shown firing: {alerts - firing}"
    assert quiet == alerts, f"alerts never shown quiet: {alerts - quiet}"


@pytest.mark.integration
def test_promtool_checks_the_alert_rules() -> None:
    count = len(alert_rules())
    assert f"SUCCESS: {count} rules found" in run_promtool("check", "rules", str(ALERTS))


@pytest.mark.integration
def test_promtool_runs_the_alert_unit_tests() -> None:
    assert "SUCCESS" in run_promtool("test", "rules", str(ALERTS_TEST))


# -- the example Prometheus config -----------------------------------------------------------


@pytest.mark.integration
def test_example_prometheus_config_scrapes_the_admin_endpoint_and_loads_the_rules() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    assert config["rule_files"] == [ALERTS.name]
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"]
    output = run_promtool("check", "config", str(PROMETHEUS_YML))
    assert "is valid prometheus config file syntax" in output
    assert f"SUCCESS: {len(alert_rules())} rules found" in output
