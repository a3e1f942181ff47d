"""Screenshots of the console's pages for the docs, taken by Debian's headless Chromium from live servers.

Run by ``scripts/console-screenshots [OUT_DIR]`` (default docs). First a single server: ``keyfailover
serve`` on free loopback ports with a temporary data folder and its admin endpoint, Zipf(1.1)-keyed
account events produced at a steady rate to ``accounts``, and consumers of ``ledger`` that join and
leave while they flow: c1, c2 and c3, then c4 joins, c2 leaves and c5 joins, so the history strip has
changes of each kind. A consumer of ``payments`` / ``settlement`` nacks every delivery of a few keys,
which the server's ``--max-redeliveries 1`` turns into dead letters. Its subscription page and its
dead-letter page are saved once they show their content: ``console-subscription.png`` and
``console-dlq.png``. Then a cluster: ZooKeeper, one PostgreSQL and three brokers on loopback, a topic of
six partitions with two consumers acking a few hundred events (a partition lists the subscriptions whose
cursor the store has), and the cluster page of the first broker: ``console-cluster.png``.
Without ZooKeeper or PostgreSQL installed that picture is skipped, saying why.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from keyfailover.client import Client, Consumer, Producer, Timeout
from keyfailover.tools._browser import start_chromium
from keyfailover.tools.demo._report import zipf_ids
from keyfailover.tools.demo._server import console_url, started
from keyfailover.tools.demo._traffic import TOPIC, Observed, Worker
from keyfailover.tools.services import PostgreSQL, ServiceError, ZooKeeper, free_port

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

RATE = 400
"""Account events produced per second."""
POISONED = ("payments", "settlement", ("card-17", "card-23", "card-42"))
"""The topic, the subscription and the keys whose every delivery is nacked: the dead letters."""
WIDTH = 1400
WAIT = 30.0
"""Seconds a page has to show its content."""
BROKERS, PARTITIONS = 3, 6


@contextlib.contextmanager
def serving(*where: str) -> Iterator[tuple[str, str]]:
    """``keyfailover serve`` with ``where`` (its data folder or its cluster and store) and its admin endpoint
    on free loopback ports: its client URL ``kf://HOST:PORT`` and its admin URL."""
    server = subprocess.Popen(
        [sys.executable, "-m", "keyfailover", "serve", *where, "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield started(server)
    finally:
        server.terminate()
        server.wait(timeout=30)


Content = tuple[tuple[str, int], ...]
"""What a page shows once it has its content: selectors, each with how many elements of it at least."""


def shows(driver: WebDriver, content: Content) -> bool:
    """The page is live and has ``content``."""
    found: bool = driver.execute_script(
        "return document.querySelector('#status')?.getAttribute('data-state') === 'live'"
        " && arguments[0].every(([selector, count]) => document.querySelectorAll(selector).length >= count);",
        [list(each) for each in content],
    )
    return found


def save(driver: WebDriver, url: str, content: Content, target: Path) -> None:
    """Open ``url``; once it is live with ``content``, save the whole page's height to ``target``."""
    from selenium.webdriver.support.wait import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, WAIT, poll_frequency=0.2).until(
        functools.partial(shows, content=content), message=f"{url} showed no {content} within {WAIT:g} s"
    )
    height = driver.execute_script("return Math.ceil(document.body.getBoundingClientRect().height);")
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WIDTH, "height": int(height) + 16, "scale": 1},
        },
    )
    target.write_bytes(base64.b64decode(shot["data"]))
    print(f"wrote {target}")


def produce(producer: Producer, stop: threading.Event) -> None:
    """Zipf-keyed account events at :data:`RATE` a second, in batches of a tenth of a second, until ``stop``;
    each payload is ``KEY:NUMBER:AMOUNT``, as the demo's consumers read it."""
    accounts = zipf_ids(RATE * 60, 2_000, seed=7)
    batch = RATE // 10
    for start in range(0, len(accounts), batch):
        for number, account in enumerate(accounts[start : start + batch], start):
            producer.send_async(f"account-{account}:{number}:0".encode(), f"account-{account}")
        if stop.wait(0.1):
            return


def nack(consumer: Consumer, stop: threading.Event) -> None:
    """Nack every delivery until ``stop``: each message becomes a dead letter after its second delivery."""
    while not stop.is_set():
        with contextlib.suppress(Timeout):
            consumer.negative_acknowledge(consumer.receive(timeout=0.2))


def in_thread(work: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def single_server_pages(driver: WebDriver, out: Path) -> None:
    """The subscription page and the dead-letter page of a single server with traffic, changes and dead letters."""
    stop = threading.Event()
    with (
        tempfile.TemporaryDirectory(prefix="console-screenshots-") as folder,
        serving("--data-dir", folder, "--port", "0", "--max-redeliveries", "1", "--nack-backoff", "0") as (
            url,
            admin,
        ),
        Client(url) as client,
    ):
        print(f"console: {console_url(admin)}")
        observed = Observed()
        workers = {name: Worker(client, name, observed, 200) for name in ("c1", "c2", "c3")}
        poisoned_topic, poisoned_subscription, keys = POISONED
        nacking = client.subscribe(poisoned_topic, poisoned_subscription, consumer_name="nacker")
        threads = [
            in_thread(lambda: produce(client.create_producer(TOPIC, "screenshots"), stop)),
            in_thread(lambda: nack(nacking, stop)),
        ]
        poison = client.create_producer(poisoned_topic, "screenshots-poison")
        for number, key in enumerate(keys * 3):
            poison.send(f"charge {number}".encode(), key)
        for change in ("c4 joins", "c2 leaves", "c5 joins"):
            stop.wait(1.0)  # a second of traffic between two changes
            name = change.split()[0]
            if change.endswith("joins"):
                workers[name] = Worker(client, name, observed, 200)
            else:
                workers.pop(name).leave()
            print(change)
        # Every change in the strip, and both charts drawn through a few samples.
        changes_and_charts = (("#history .change", 6), ('svg.chart polyline[points*=" "]', 2))
        save(driver, console_url(admin), changes_and_charts, out / "console-subscription.png")
        save(driver, f"{admin}/ui#/dlq", (("#dead-letters tbody tr[data-topic]", 1),), out / "console-dlq.png")
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        nacking.close()
        for worker in workers.values():
            worker.leave()


def cluster_page(driver: WebDriver, out: Path) -> str | None:
    """The cluster page of the first of three brokers serving a topic of six partitions; why it was not taken."""
    try:
        ZooKeeper.check_installed()
        PostgreSQL.check_installed()
    except ServiceError as missing:
        return str(missing)
    folder = Path(tempfile.mkdtemp(prefix="console-screenshots-cluster-"))  # under /tmp: open to the postgres user
    folder.chmod(0o711)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, ignore_errors=True)  # owned by the postgres user in part
        zookeeper = stack.enter_context(ZooKeeper(folder / "zookeeper"))
        store = stack.enter_context(PostgreSQL(folder / "postgresql")).dsn
        cluster = f"zk://{zookeeper.hosts}/console"
        brokers = []
        for number in range(1, BROKERS + 1):
            port = free_port()
            where = ("--cluster", cluster, "--store", store, "--port", str(port), "--advertise", f"127.0.0.1:{port}")
            brokers.append(stack.enter_context(serving(*where, "--broker-id", f"b{number}")))
        create = ["topics", "create", TOPIC, "--partitions", str(PARTITIONS), "--cluster", cluster]
        subprocess.run([sys.executable, "-m", "keyfailover", *create], check=True, capture_output=True)
        client = stack.enter_context(Client("kf://" + ",".join(url.removeprefix("kf://") for url, _ in brokers)))
        observed = Observed()
        for name in ("c1", "c2"):
            stack.callback(Worker(client, name, observed, 100).leave)
        producer = client.create_producer(TOPIC, "screenshots")
        for number, account in enumerate(zipf_ids(RATE, 200, seed=7)):  # acked, so the store has the cursors
            producer.send_async(f"account-{account}:{number}:0".encode(), f"account-{account}")
        producer.flush()
        # Each partition on its broker, with the subscription linked.
        served = (('#partitions tbody tr[data-broker^="b"]', PARTITIONS), ("#partitions tbody tr a", PARTITIONS))
        save(driver, f"{brokers[0][1]}/ui#/cluster", served, out / "console-cluster.png")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("docs"), help="the folder to write to (docs)")
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    driver = start_chromium(WIDTH, 900)
    try:
        single_server_pages(driver, out)
        skipped = cluster_page(driver, out)
    finally:
        driver.quit()
    if skipped is not None:
        print(f"{out / 'console-cluster.png'}: not taken, {skipped}")


if __name__ == "__main__":
    main()
