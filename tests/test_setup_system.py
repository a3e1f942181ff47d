"""scripts/setup-system names each missing package, installs what the apt sources have, and says what it could not.

Each test runs the script on a PATH of its own, with a fake ``apt-get``, ``apt-cache`` and ``id``
and the packages' files looked for under a temporary folder (``SETUP_SYSTEM_ROOT``), so nothing is
installed on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "setup-system"

FILES = {
    "zookeeper": "/usr/share/java/zookeeper.jar",
    "postgresql": "/usr/lib/postgresql/15/bin/initdb",
    "libpostgresql-jdbc-java": "/usr/share/java/postgresql.jar",
    "patroni": "/usr/bin/patroni",
    "python3-kazoo": "/usr/lib/python3/dist-packages/kazoo",
    "chromium": "/usr/bin/chromium",
    "chromium-driver": "/usr/bin/chromedriver",
    "gcc": "/usr/bin/gcc",
}
"""The packages shown installed by a file, and that file."""
COMMANDS = {"redis-server": "redis-server", "prometheus": "promtool", "default-jre-headless": "java"}
"""The packages shown installed by a command on PATH, and that command."""

FAKE_APT = """
import json, os, pathlib, sys
fake = json.loads(os.environ["FAKE_APT"])
with open(fake["log"], "a") as log:
    log.write(pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:]) + "\\n")
command, packages = sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("-")]
if pathlib.Path(sys.argv[0]).name == "apt-cache":
    sys.exit(100 if packages[0] in fake["unknown"] else 0)
if command == "install":
    if fake["broken"] in packages:
        print("E: Sub-process /usr/bin/dpkg returned an error code (1)")
        sys.exit(100)
    for package in packages:
        made = pathlib.Path(fake["made"][package])
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_text("#!/bin/sh\\n")
        made.chmod(0o755)
"""


class Machine:
    """A machine for the script: its files under ``root``, its commands in ``bin`` (the only PATH)."""

    def __init__(self, folder: Path, *, root: bool = True) -> None:
        self.root, self.bin, self.log = folder / "root", folder / "bin", folder / "apt.log"
        self.bin.mkdir()
        self.log.touch()
        for tool in ("bash", "mktemp", "tail", "sed", "tr", "rm"):
            found = shutil.which(tool)
            assert found is not None, tool
            (self.bin / tool).symlink_to(found)
        self.write("id", f"#!/bin/sh\necho {0 if root else 1000}\n")
        for name in ("apt-get", "apt-cache"):
            self.write(name, f"#!{sys.executable}\n{FAKE_APT}")

    def write(self, name: str, text: str) -> None:
        """A command ``name`` on the machine's PATH that runs ``text``."""
        (self.bin / name).write_text(text)
        (self.bin / name).chmod(0o755)

    def made_by(self, package: str) -> Path:
        """The file or command that shows ``package`` installed."""
        if package in FILES:
            return self.root / FILES[package].lstrip("/")
        return self.bin / COMMANDS[package]

    def install(self, *packages: str) -> None:
        """Install ``packages`` beforehand."""
        for package in packages:
            made = self.made_by(package)
            made.parent.mkdir(parents=True, exist_ok=True)
            made.write_text("#!/bin/sh\n")
            made.chmod(0o755)

    def run(self, *, unknown: tuple[str, ...] = (), broken: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run the script; apt's sources lack ``unknown``, and an install with ``broken`` in it fails."""
        made = {package: str(self.made_by(package)) for package in [*FILES, *COMMANDS]}
        fake = {"log": str(self.log), "unknown": list(unknown), "broken": broken, "made": made}
        env = {"PATH": str(self.bin), "SETUP_SYSTEM_ROOT": str(self.root), "FAKE_APT": json.dumps(fake)}
        return subprocess.run(
            [str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False, cwd=os.getcwd()
        )

    def apt_calls(self) -> list[str]:
        """What apt-get and apt-cache were asked, in order."""
        return self.log.read_text().splitlines()


def test_with_everything_installed_it_says_and_does_nothing(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    machine.install(*FILES, *COMMANDS)
    done = machine.run()
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert machine.apt_calls() == []


def test_as_root_it_names_each_missing_package_installs_them_and_then_has_nothing_to_do(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    machine.install("libpostgresql-jdbc-java", "chromium", "chromium-driver", "gcc", *COMMANDS)
    done = machine.run()
    assert done.returncode == 0, done.stderr
    root = machine.root
    assert done.stderr.splitlines() == [
        f"setup-system: zookeeper is missing (no {root}/usr/share/java/zookeeper.jar): "
        "ZooKeeper, the cluster's coordination",
        f"setup-system: postgresql is missing (no {root}/usr/lib/postgresql/15/bin/initdb): "
        "PostgreSQL 15, the cluster's log",
        f"setup-system: patroni is missing (no {root}/usr/bin/patroni): "
        "Patroni, which runs the replicated store (a primary and a synchronous standby)",
        f"setup-system: python3-kazoo is missing (no {root}/usr/lib/python3/dist-packages/kazoo): "
        "the ZooKeeper client Patroni keeps its state with",
        "setup-system: installing zookeeper postgresql patroni python3-kazoo",
    ]
    assert machine.apt_calls()[-1] == (
        "apt-get install -y -qq --no-install-recommends zookeeper postgresql patroni python3-kazoo"
    )
    calls = len(machine.apt_calls())
    again = machine.run()
    assert (again.returncode, again.stderr) == (0, "")
    assert len(machine.apt_calls()) == calls


def test_as_root_it_names_what_it_could_not_install_and_why_and_exits_1(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    machine.install(
        "zookeeper", "postgresql", "libpostgresql-jdbc-java", "chromium", "chromium-driver", "gcc", *COMMANDS
    )
    done = machine.run(unknown=("patroni",), broken="python3-kazoo")
    assert done.returncode == 1, done.stderr
    root = machine.root
    assert done.stderr.splitlines()[-3:] == [
        "setup-system: installing python3-kazoo",
        f"setup-system: patroni is still missing (no {root}/usr/bin/patroni), Patroni, which runs the replicated "
        "store (a primary and a synchronous standby): no package patroni in the apt sources "
        "(apt-cache show patroni finds none): add a source that has it",
        f"setup-system: python3-kazoo is still missing (no {root}/usr/lib/python3/dist-packages/kazoo), the "
        "ZooKeeper client Patroni keeps its state with: apt-get install failed: "
        "E: Sub-process /usr/bin/dpkg returned an error code (1)",
    ]


def test_not_root_it_names_what_is_missing_and_the_command_to_install_it(tmp_path: Path) -> None:
    machine = Machine(tmp_path, root=False)
    machine.install(*[package for package in FILES if package != "patroni"], "prometheus", "default-jre-headless")
    done = machine.run()
    assert done.returncode == 0
    assert done.stderr.splitlines() == [
        "setup-system: redis-server is missing (no redis-server on PATH): the Redis server of the end-to-end benchmark",
        f"setup-system: patroni is missing (no {machine.root}/usr/bin/patroni): "
        "Patroni, which runs the replicated store (a primary and a synchronous standby)",
        "setup-system: not root, so nothing was installed; to install what is missing run:",
        "  sudo apt-get update -qq && sudo apt-get install -y -qq redis-server patroni",
        "setup-system: the benchmarks that need them skip that part and say why",
    ]
    assert machine.apt_calls() == []
