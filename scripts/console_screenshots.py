"""Screenshots of the console's pages for the docs, taken by Debian's headless Chromium from a live server.

Run by ``scripts/console-screenshots [OUT_DIR]`` (default docs). It starts ``keyfailover serve`` on free
loopback ports with a temporary data folder and its admin endpoint, produces Zipf(1.1)-keyed account
events at a steady rate to ``accounts``, and lets consumers of ``ledger`` join and leave while they
flow: c1, c2 and c3, then c4 joins, c2 leaves and c5 joins, so the history strip has changes of each
kind. A consumer of ``payments`` / ``settlement`` nacks every delivery of a few keys, which the
server's ``--max-redeliveries 1`` turns into dead letters. Then each page is opened in the browser and
saved once it shows its content: ``console-subscription.png`` and ``console-dlq.png``. The cluster
page needs a cluster (ZooKeeper, PostgreSQL, brokers) and is not taken here.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
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
from keyfailover.tools.demo._server import console_url
from keyfailover.tools.demo._traffic import TOPIC, Observed, Worker

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

RATE = 400
"""Account events produced per second."""
POISONED = ("payments", "settlement", ("card-17", "card-23", "card-42"))
"""The topic, the subscription and the keys whose every delivery is nacked: the dead letters."""
WIDTH = 1400
PAGES = (
    ("subscription", "console-subscription.png", "#history .change"),
    ("dlq", "console-dlq.png", "#dead-letters tbody tr[data-topic]"),
)
"""Each page, the file it is saved to, and what it shows once it has its content."""


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[tuple[str, str]]:
    """``keyfailover serve`` with its admin endpoint, data in ``folder``: its client URL and its admin URL."""
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "keyfailover", "serve", "--data-dir", str(folder)),
            *("--port", "0", "--metrics-port", "0", "--max-redeliveries", "1", "--nack-backoff", "0"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line, admin = server.stdout.readline(), server.stdout.readline()
        if not line.startswith("listening on ") or not admin.startswith("metrics on "):
            raise SystemExit(f"console-screenshots: the server did not start: it printed {line!r} {admin!r}")
        yield "kf://" + line.split("listening on ", 1)[1].strip(), admin.split("metrics on ", 1)[1].strip()
    finally:
        server.terminate()
        server.wait(timeout=30)


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


def shows(driver: WebDriver, content: str) -> bool:
    """The page is live and has an element of the selector ``content``."""
    found: bool = driver.execute_script(
        "return document.querySelector('#status')?.getAttribute('data-state') === 'live'"
        " && document.querySelector(arguments[0]) !== null;",
        content,
    )
    return found


def take(admin: str, out: Path) -> None:
    """Open each page once the story ran, and save it when it shows its content, the whole page's height."""
    from selenium.webdriver.support.wait import WebDriverWait

    driver = start_chromium(WIDTH, 900)
    try:
        for page, name, content in PAGES:
            url = console_url(admin) if page == "subscription" else f"{admin}/ui#/{page}"
            driver.get(url)
            WebDriverWait(driver, 15, poll_frequency=0.2).until(
                functools.partial(shows, content=content), message=f"the {page} page showed no {content} within 15 s"
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
            target = out / name
            target.write_bytes(base64.b64decode(shot["data"]))
            print(f"wrote {target}")
    finally:
        driver.quit()
    print("docs/console-cluster.png: not taken, the cluster page needs ZooKeeper, PostgreSQL and brokers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("docs"), help="the folder to write to (docs)")
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="console-screenshots-") as folder, serving(Path(folder)) as (url, admin):
        print(f"console: {console_url(admin)}")
        with Client(url) as client:
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
            for step, change in enumerate(("c4 joins", "c2 leaves", "c5 joins")):
                stop.wait(1.0)  # a second of traffic between two changes
                name = change.split()[0]
                if change.endswith("joins"):
                    workers[name] = Worker(client, name, observed, 200)
                else:
                    workers.pop(name).leave()
                print(f"change {step + 1}: {change}")
            take(admin, out)
            stop.set()
            for thread in threads:
                thread.join(timeout=10)
            nacking.close()
            for worker in workers.values():
                worker.leave()


if __name__ == "__main__":
    main()
