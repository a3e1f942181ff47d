"""The console (``/ui`` on the admin endpoint) in a real browser: Debian's headless Chromium, through Selenium.

Each test starts a real ``keyfailover serve`` (a cluster of two for the cluster page) and opens the console's
page in the session's one browser (the ``browser`` fixture of tests/conftest.py, which skips these tests,
saying what is missing, only when Chromium, chromedriver or Selenium cannot be found). The pages are read
through the attributes issue 39 gives them: ``#status[data-state]``, ``#range-bar .segment[data-consumer]
[data-start][data-end]``, ``#consumers tbody tr[data-consumer]``, ``#history .change[data-epoch][data-reason]``,
``#dead-letters tbody tr[data-topic][data-subscription]``, ``#brokers tbody tr[data-broker][data-reachable]`` and
``#partitions tbody tr[data-topic][data-partition][data-broker]``. A page polls about every second, so what the
server changes shows within :data:`SHOWN_WITHIN` seconds: that is the bar, and the waits' bound.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.error import HTTPError

import pytest

from keyfailover.client import Client, Consumer, Timeout
from keyfailover.tools._browser import _missing
from keyfailover.tools.services import PostgreSQL, ZooKeeper
from tests.server_process import ServerProcess, wait_until
from tests.test_cluster_failover import running, served_by
from tests.tiers import starts_processes

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

T = TypeVar("T")

SHOWN_WITHIN = 5.0
"""Seconds within which the page shows what changed on the server (issue 39: it polls at least every 2 s)."""
UNREACHABLE_WITHIN = 10.0
"""Seconds within which the page says a killed server is unreachable: its next poll fails, whatever its back-off."""
TOPIC, SUBSCRIPTION = "orders", "billing"
TOKEN = "console-token-5e1d"
Span = tuple[str, int, int]
"""A range as the page and ``/ranges`` give it: (consumer, start, end)."""


@pytest.fixture
@starts_processes
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server with its admin endpoint; a message nacked twice goes to the dead-letter topic at once."""
    options = ("--metrics-port", "0", "--max-redeliveries", "1", "--nack-backoff", "0")
    with ServerProcess(tmp_path / "data", *options) as started:
        yield started


@pytest.fixture
def console(browser: WebDriver) -> Iterator[WebDriver]:
    """The session's browser for one test; afterwards its page is left (it stops polling) and what the page
    kept for its server (the token) is forgotten."""
    yield browser
    if browser.current_url.startswith("http"):
        browser.execute_script("window.localStorage.clear(); window.sessionStorage.clear();")
    browser.get("about:blank")


# -- the server, read directly ------------------------------------------------------------------------


def admin_json(server: ServerProcess, path: str, token: str | None = None) -> Any:
    """GET ``path`` (with its query) of the server's admin endpoint, as JSON."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(f"{server.admin_url}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def subscription_query(topic: str = TOPIC, subscription: str = SUBSCRIPTION) -> str:
    return urllib.parse.urlencode({"topic": topic, "subscription": subscription})


def served_ranges(server: ServerProcess, token: str | None = None) -> list[Span]:
    """The subscription's ranges from ``/ranges``, in slot order."""
    snapshot = admin_json(server, f"/ranges?{subscription_query()}", token)
    return [(r["consumer"], r["start"], r["end"]) for r in snapshot["ranges"]]


def dead_letters(server: ServerProcess) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = admin_json(server, f"/dlq?{subscription_query()}")["dead_letters"]
    return found


# -- the page -----------------------------------------------------------------------------------------


def open_page(browser: WebDriver, server: ServerProcess, route: str) -> None:
    """Open the console at ``route`` (``#/...``); fails saying so when the server serves no console."""
    assert server.admin_url is not None
    try:
        with urllib.request.urlopen(f"{server.admin_url}/ui", timeout=10) as response:
            assert response.status == 200
    except HTTPError as exc:
        pytest.fail(f"GET /ui answered {exc.code}: the server serves no console (issue 39); expected its index page")
    browser.get(f"{server.admin_url}/ui{route}")


def subscription_route(topic: str = TOPIC, subscription: str = SUBSCRIPTION) -> str:
    quoted = "/".join(urllib.parse.quote(name, safe="") for name in (topic, subscription))
    return f"#/subscription/{quoted}"


def rows(browser: WebDriver, selector: str, *attributes: str) -> list[tuple[str, ...]]:
    """Each element of ``selector``: its ``data-`` ``attributes``, read in one script (the page re-renders)."""
    found: list[list[str]] = browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]))"
        ".map(e => arguments[1].map(a => e.getAttribute('data-' + a)));",
        selector,
        list(attributes),
    )
    return [tuple(row) for row in found]


def text_of(browser: WebDriver, selector: str) -> str | None:
    """The text of the first element of ``selector`` (None: none), read in one script (the page re-renders: an
    element found first and read after may be gone)."""
    found: str | None = browser.execute_script(
        "const e = document.querySelector(arguments[0]); return e === null ? null : e.innerText;", selector
    )
    return found


def spans(browser: WebDriver, selector: str) -> list[Span]:
    """The ranges the page shows at ``selector``: the bar's segments or the table's rows."""
    return [(c, int(s), int(e)) for c, s, e in rows(browser, selector, "consumer", "start", "end")]


def state(browser: WebDriver) -> str:
    """``#status``'s ``data-state`` and its text."""
    found: str = browser.execute_script(
        "const s = document.querySelector('#status');"
        "return s === null ? 'no #status' : s.getAttribute('data-state') + ': ' + s.textContent.trim();"
    )
    return found


def shown(browser: WebDriver, condition: Callable[[], T | None], what: str, within: float = SHOWN_WITHIN) -> T:
    """Wait until ``condition()`` gives something (not None, not False); fail naming ``what`` past ``within`` s."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.wait import WebDriverWait

    try:
        found = WebDriverWait(browser, within, poll_frequency=0.1).until(lambda _: condition())
    except TimeoutException:
        pytest.fail(f"the page did not show {what} within {within:g} s; status {state(browser)!r}")
    assert found is not None
    return found


def showing_the_served_ranges(browser: WebDriver, server: ServerProcess, token: str | None = None) -> bool:
    """The bar's segments and the table's rows are the ranges ``/ranges`` gives now."""
    served = served_ranges(server, token)
    return spans(browser, "#range-bar .segment") == served and spans(browser, "#range-table tbody tr") == served


def consumers_listed(browser: WebDriver) -> set[str]:
    return {consumer for (consumer,) in rows(browser, "#consumers tbody tr", "consumer")}


def history_reasons(browser: WebDriver) -> dict[int, str]:
    """The strip of ownership changes: each change's epoch and reason."""
    return {int(epoch): reason for epoch, reason in rows(browser, "#history .change", "epoch", "reason")}


# -- the subscription page ----------------------------------------------------------------------------


def test_the_subscription_page_shows_a_join_and_a_leave_within_5_s_as_the_server_s_ranges(
    server: ServerProcess, console: WebDriver
) -> None:
    """A consumer joins and another leaves while the page is open: each time, within 5 s of the server's new
    map, the bar and the table show exactly the ranges ``/ranges`` gives, the consumers table lists who is
    there, and the history strip has the change with its epoch and reason."""
    with Client(server.url) as client:
        first = client.subscribe(TOPIC, SUBSCRIPTION, consumer_name="c1")
        client.subscribe(TOPIC, SUBSCRIPTION, consumer_name="c2")
        wait_until(lambda: {c for c, _, _ in served_ranges(server)} == {"c1", "c2"}, "c1 and c2 own ranges")
        open_page(console, server, subscription_route())
        shown(console, lambda: state(console).startswith("live"), "the live state")
        shown(console, lambda: showing_the_served_ranges(console, server), "the ranges of c1 and c2")
        assert consumers_listed(console) == {"c1", "c2"}

        client.subscribe(TOPIC, SUBSCRIPTION, consumer_name="c3")
        wait_until(lambda: "c3" in {c for c, _, _ in served_ranges(server)}, "c3 owns ranges")
        shown(console, lambda: showing_the_served_ranges(console, server), "the ranges after c3 joined")
        shown(console, lambda: consumers_listed(console) == {"c1", "c2", "c3"}, "c3 in the consumers table")
        joined = admin_json(server, f"/ranges?{subscription_query()}")["epoch"]
        shown(console, lambda: history_reasons(console).get(joined) == "join", f"the join at epoch {joined}")

        first.close()
        wait_until(lambda: "c1" not in {c for c, _, _ in served_ranges(server)}, "c1's ranges went to the others")
        shown(console, lambda: showing_the_served_ranges(console, server), "the ranges after c1 left")
        shown(console, lambda: consumers_listed(console) == {"c2", "c3"}, "c1 gone from the consumers table")
        left = admin_json(server, f"/ranges?{subscription_query()}")["epoch"]
        shown(console, lambda: history_reasons(console).get(left) == "leave", f"the leave at epoch {left}")
        assert state(console).startswith("live")


def test_the_bar_s_segments_are_the_ranges_of_the_server_one_per_range_in_slot_order(
    server: ServerProcess, console: WebDriver
) -> None:
    """With five consumers the map has many ranges: the bar has one segment per range, in slot order, each with
    the consumer, first and last slot ``/ranges`` gives, and together they tile the 65,536 slots."""
    with Client(server.url) as client:
        for name in ("a", "b", "c", "d", "e"):
            client.subscribe(TOPIC, SUBSCRIPTION, consumer_name=name)
        wait_until(lambda: len({c for c, _, _ in served_ranges(server)}) == 5, "five consumers own ranges")
        open_page(console, server, subscription_route())
        shown(console, lambda: showing_the_served_ranges(console, server), "the five consumers' ranges")
        segments = spans(console, "#range-bar .segment")
        assert segments == served_ranges(server)
        assert segments[0][1] == 0 and segments[-1][2] == 65535
        assert all(before[2] + 1 == after[1] for before, after in itertools.pairwise(segments))


def _linear(colour: str) -> tuple[float, float, float]:
    """The linear RGB of a ``#rrggbb`` colour (sRGB's transfer undone)."""
    channels = (int(colour[at : at + 2], 16) / 255 for at in (1, 3, 5))
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return r, g, b


def _lab(colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of a ``#rrggbb`` colour."""
    r, g, b = _linear(colour)
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _contrast(text: str, background: str) -> float:
    """WCAG 2 contrast ratio of two ``#rgb`` or ``#rrggbb`` colours."""

    def luminance(colour: str) -> float:
        full = colour if len(colour) == 7 else "#" + "".join(c * 2 for c in colour[1:])
        r, g, b = _linear(full)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    lighter, darker = sorted((luminance(text), luminance(background)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def test_32_consumers_get_colours_far_apart_with_readable_names_on_them(
    server: ServerProcess, console: WebDriver
) -> None:
    """The page's colours for 32 consumers differ pairwise by a CIE76 distance of 20 or more, far above the
    2.3 an eye can just tell apart, and a name drawn on each has a WCAG contrast of 4.5 or more."""
    open_page(console, server, "#/dlq")
    shown(console, lambda: state(console).startswith("live"), "the page live")
    colours: list[dict[str, str]] = console.execute_script(
        "return Array.from({length: 32}, (_, i) => colour('palette-test-' + i));"
    )
    backgrounds = [c["background"] for c in colours]
    assert len(set(backgrounds)) == 32 and all(len(b) == 7 and b.startswith("#") for b in backgrounds)
    labs = [_lab(b) for b in backgrounds]
    closest = min(math.dist(a, b) for a, b in itertools.combinations(labs, 2))
    assert closest >= 20, f"two of the 32 colours are only {closest:.1f} apart"
    for c in colours:
        contrast = _contrast(c["text"], c["background"])
        assert contrast >= 4.5, f"{c['text']} on {c['background']}: contrast {contrast:.1f}"


def test_a_server_with_a_token_has_the_page_ask_for_it_refuse_a_wrong_one_and_take_the_right_one(
    tmp_path: Path, console: WebDriver
) -> None:
    from selenium.webdriver.common.by import By

    with (
        ServerProcess(tmp_path / "data", "--metrics-port", "0", "--token", TOKEN) as server,
        Client(server.url, TOKEN) as client,
    ):
        client.subscribe(TOPIC, SUBSCRIPTION, consumer_name="c1")
        wait_until(lambda: bool(served_ranges(server, TOKEN)), "c1 owns the ranges")
        open_page(console, server, subscription_route())
        shown(console, lambda: console.find_elements(By.CSS_SELECTOR, "form#token-form"), "the token form")
        assert spans(console, "#range-bar .segment") == []

        def submit(token: str) -> None:
            field = console.find_element(By.CSS_SELECTOR, "input#token-input")
            field.clear()
            field.send_keys(token)
            console.find_element(By.CSS_SELECTOR, "button#token-submit").click()

        def refused() -> bool:
            error = text_of(console, "#token-error")
            return error is not None and "refused" in error and state(console).startswith("unauthorized")

        submit("not-" + TOKEN)
        shown(console, refused, "the wrong token refused")
        assert spans(console, "#range-bar .segment") == []

        submit(TOKEN)
        shown(console, lambda: state(console).startswith("live"), "the live state with the right token")
        shown(console, lambda: showing_the_served_ranges(console, server, TOKEN), "c1's ranges")
        assert not refused()


def test_a_server_killed_under_the_open_page_is_shown_unreachable(server: ServerProcess, console: WebDriver) -> None:
    with Client(server.url) as client:
        client.subscribe(TOPIC, SUBSCRIPTION, consumer_name="c1")
        wait_until(lambda: bool(served_ranges(server)), "c1 owns the ranges")
        open_page(console, server, subscription_route())
        shown(console, lambda: showing_the_served_ranges(console, server), "c1's ranges")
        server.kill()

        def unreachable() -> bool:
            now = state(console)
            return now.startswith("unreachable") and "unreachable" in now.split(": ", 1)[1]

        shown(console, unreachable, "the server unreachable", within=UNREACHABLE_WITHIN)


# -- the dead letters page ----------------------------------------------------------------------------


def nack_until_dead(server: ServerProcess, consumer: Consumer, count: int) -> None:
    """Nack every delivery until the subscription has ``count`` dead letters (each is nacked twice)."""

    def dead() -> bool:
        with contextlib.suppress(Timeout):
            consumer.negative_acknowledge(consumer.receive(timeout=0.2))
        return len(dead_letters(server)) >= count

    wait_until(dead, f"{count} dead letters")


def test_the_dead_letters_page_lists_a_subscription_s_dead_letters_and_replays_and_purges_after_a_confirmation(
    server: ServerProcess, console: WebDriver
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions

    with Client(server.url) as client:
        consumer = client.subscribe(TOPIC, SUBSCRIPTION, consumer_name="c1")
        producer = client.create_producer(TOPIC)
        for key in ("k1", "k2", "k3"):
            producer.send(b"poison", key)
        nack_until_dead(server, consumer, 3)
        consumer.close()  # the replayed letters stay in the topic: nobody nacks them again

        open_page(console, server, "#/dlq")
        selector = f'#dead-letters tbody tr[data-topic="{TOPIC}"][data-subscription="{SUBSCRIPTION}"]'

        def row_text() -> str | None:
            return text_of(console, selector)

        listed = shown(console, row_text, "the subscription's row")
        assert "3" in listed

        def confirmed(button: str) -> None:
            console.find_element(By.CSS_SELECTOR, f"{selector} button.{button}").click()
            shown(console, lambda: expected_conditions.alert_is_present()(console), f"the {button} confirmation")
            console.switch_to.alert.accept()

        confirmed("replay")
        wait_until(lambda: all(letter["replayed_at"] is not None for letter in dead_letters(server)), "replayed")
        replayed = shown(console, lambda: (text := row_text()) != listed and text, "the replayed count")

        confirmed("purge")
        wait_until(lambda: dead_letters(server) == [], "the dead letters purged")
        shown(console, lambda: row_text() != replayed or None, "the purged count")


# -- the cluster page ---------------------------------------------------------------------------------


@pytest.mark.cluster
def test_the_cluster_page_shows_the_brokers_and_who_serves_each_partition_and_a_killed_broker(
    zookeeper: ZooKeeper, postgres: PostgreSQL, console: WebDriver
) -> None:
    """Two brokers serving four partitions: the page lists both reachable and each partition on the broker
    the cluster's assignment gives; once one broker is killed, it is no longer shown reachable and every
    partition shows on the other."""
    cluster = f"zk://{zookeeper.hosts}/kf-console-{uuid.uuid4().hex[:8]}"
    with running(cluster, postgres, 2, 4, "--metrics-port", "0") as (topic, brokers):
        first, second = brokers
        ids = {f"127.0.0.1:{broker.port}" for broker in brokers}

        def partitions() -> set[tuple[str, int, str]]:
            found = rows(console, "#partitions tbody tr", "topic", "partition", "broker")
            return {(t, int(p), b) for t, p, b in found}

        def assigned() -> set[tuple[str, int, str]]:
            return {(t, p, b) for (t, p), b in served_by(cluster).items() if t == topic}

        def reachable() -> dict[str, str]:
            return {broker: up for broker, up in rows(console, "#brokers tbody tr", "broker", "reachable")}

        open_page(console, first, "#/cluster")
        shown(console, lambda: reachable() == dict.fromkeys(ids, "true"), "both brokers reachable")
        shown(console, lambda: {p for p in partitions() if p[0] == topic} == assigned(), "the assignment")

        second.kill()
        wait_until(lambda: {b for _, _, b in assigned()} == {f"127.0.0.1:{first.port}"}, "one broker serves all")
        gone = f"127.0.0.1:{second.port}"
        shown(console, lambda: reachable().get(gone, "false") == "false", "the killed broker not reachable")
        shown(console, lambda: {p for p in partitions() if p[0] == topic} == assigned(), "the partitions moved")


# -- without a browser --------------------------------------------------------------------------------


def test_what_is_missing_for_a_browser_is_named_with_how_to_install_it() -> None:
    said = _missing(None, None)
    assert said is not None
    assert "apt-get install chromium)" in said and "apt-get install chromium-driver" in said
    assert "scripts/setup-system" in said
    assert _missing("/usr/bin/chromium", "/usr/bin/chromedriver") is None  # Selenium is in the dev extra
