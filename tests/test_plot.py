"""keyfailover.plot and ``keyfailover plot``: histories checked, pictures decoded pixel by pixel."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import numpy as np
import numpy.typing as npt
import pytest

from keyfailover.broker.server import ServerConfig
from keyfailover.client import Client
from keyfailover.core.ranges import RangeMap
from keyfailover.integrations.plot import (
    HistoryEntry,
    HistoryError,
    MatplotlibMissingError,
    history_from_records,
    load_history,
    ownership_figure,
    render_ownership,
)
from keyfailover.tools.cli import main
from tests.server_process import ServerThread, run_main

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs keyfailover[plot]")

RGB = tuple[int, int, int]


def _scenario() -> list[HistoryEntry]:
    """c1 alone; c2 and c3 join; c1 leaves; c4 joins; c3 leaves: 1, 2, 3, 2, 3, 2 consumers, several bands each."""
    ranges = RangeMap()
    history: list[HistoryEntry] = []
    at = 1_700_000_000.0

    def record(seconds: float) -> None:
        history.append((at + seconds, ranges.snapshot()))

    ranges.assign_all("c1")
    record(0.0)
    ranges.reassign([(16384, 32767, "c2"), (49152, 65535, "c2")])  # c1 [0, 16383] [32768, 49151]
    record(4.0)
    ranges.reassign([(8192, 16383, "c3"), (24576, 32767, "c3"), (57344, 65535, "c3")])  # c3: three bands
    record(9.0)
    ranges.reassign([(0, 8191, "c2"), (32768, 49151, "c3")])  # c1 leaves: c2 [0, 8191] [16384, 24575] ...
    record(15.0)
    ranges.reassign([(4096, 8191, "c4"), (40960, 49151, "c4")])  # c4 [4096, 8191] [40960, 49151]
    record(20.0)
    ranges.reassign([(8192, 16383, "c4"), (24576, 40959, "c2"), (57344, 65535, "c4")])  # c3 leaves
    record(27.0)
    return history


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _jsonl(history: list[HistoryEntry]) -> list[str]:
    return [json.dumps({"time": at, "snapshot": snapshot}) for at, snapshot in history]


class Picture:
    """A rendered PNG, and where data coordinates land in it (taken from an identical figure)."""

    def __init__(self, png: Path, history: list[HistoryEntry], title: str) -> None:
        from matplotlib.colors import to_rgb
        from matplotlib.image import imread
        from matplotlib.patches import Patch

        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        decoded: npt.NDArray[np.float32] = imread(png)
        self.rgb: npt.NDArray[np.int64] = np.rint(decoded[:, :, :3] * 255).astype(np.int64)
        figure = ownership_figure(history, title)
        figure.canvas.draw()
        width, height = figure.canvas.get_width_height()
        assert self.rgb.shape[:2] == (height, width)
        self.height = height
        self.axes = figure.axes[0]
        self.first = history[0][0]
        self.background = _rgb8(to_rgb(self.axes.get_facecolor()))
        (legend,) = figure.legends
        self.labels = [text.get_text() for text in legend.get_texts()]
        self.colours: dict[str, RGB] = {
            text.get_text(): _rgb8(to_rgb(handle.get_facecolor()))
            for text, handle in zip(legend.get_texts(), legend.legend_handles, strict=True)
            if isinstance(handle, Patch)
        }

    def pixel(self, at: float, slot: float) -> tuple[int, int]:
        """(row, column) of the pixel showing unix time ``at`` and hash ``slot``."""
        x, y = self.axes.transData.transform((at - self.first, slot))
        return int(self.height - y), int(x)

    def colour(self, at: float, slot: float) -> RGB:
        row, column = self.pixel(at, slot)
        red, green, blue = (int(channel) for channel in self.rgb[row, column])
        return red, green, blue

    def column(self, at: float) -> set[RGB]:
        """The distinct colours of the plotting area's pixel column at time ``at``.

        The 3 pixels next to the frame are left out: antialiasing blends them with it.
        """
        top, column = self.pixel(at, self.axes.get_ylim()[1])
        bottom, _ = self.pixel(at, 0)
        return {(int(r), int(g), int(b)) for r, g, b in self.rgb[top + 3 : bottom - 3, column]}

    def width(self, start: float, end: float) -> int:
        return self.pixel(end, 0)[1] - self.pixel(start, 0)[1]


def _rgb8(rgb: tuple[float, float, float]) -> RGB:
    red, green, blue = (round(channel * 255) for channel in rgb)
    return red, green, blue


def _check_bands(picture: Picture, history: list[HistoryEntry], min_width: int = 6) -> int:
    """Every interval at least ``min_width`` pixels wide shows its map; returns how many were checked."""
    ends = [at for at, _ in history[1:]] + [history[-1][0] + (history[-1][0] - history[0][0]) / 10]
    checked = 0
    for (start, snapshot), end in zip(history, ends, strict=True):
        if picture.width(start, end) < min_width:
            continue
        middle = (start + end) / 2
        ranges = RangeMap.from_snapshot(snapshot)
        for first, last, consumer in ranges.ranges():
            assert picture.colour(middle, (first + last + 1) / 2) == picture.colours[consumer], (start, consumer)
        # Every band of a consumer in its colour, nothing else (no seams, no lines);
        # a map with no consumers draws nothing over the background.
        bands = {picture.colours[consumer] for consumer in ranges.consumers()}
        assert picture.column(middle) == (bands or {picture.background})
        checked += 1
    return checked


@needs_matplotlib
def test_file_history_renders_every_band_in_its_owners_colour(tmp_path: Path) -> None:
    history = _scenario()
    maps = [RangeMap.from_snapshot(snapshot) for _, snapshot in history]
    # The story has a consumer owning three bands at once, none adjacent to another.
    assert maps[2].ranges_of("c3") == [(8192, 16383), (24576, 32767), (57344, 65535)]
    assert [{c: len(owned) for c, owned in m.ranges_by_consumer().items()} for m in maps] == [
        {"c1": 1},
        {"c1": 2, "c2": 2},
        {"c1": 2, "c3": 3, "c2": 2},
        {"c2": 3, "c3": 3},
        {"c2": 3, "c4": 2, "c3": 3},
        {"c2": 3, "c4": 3},
    ]
    source = _write(tmp_path / "history.jsonl", _jsonl(history))
    loaded = load_history(source)
    assert loaded == history
    out = tmp_path / "ownership.png"
    render_ownership(loaded, out, title="billing")
    assert out.stat().st_size > 10_000

    picture = Picture(out, history, "billing")
    assert picture.labels == ["c1", "c2", "c3", "c4", "rebalance"]  # each consumer once, however many bands
    assert len(set(picture.colours.values())) == 4
    assert _check_bands(picture, history) == len(history)
    # Spot checks at known (time, slot) points: c3's three bands at 12 s, the others' at 2, 6, 23 and 30 s.
    start = history[0][0]
    assert picture.colour(start + 2, 40_000) == picture.colours["c1"]
    assert picture.colour(start + 6, 20_000) == picture.colour(start + 6, 60_000) == picture.colours["c2"]
    assert {picture.colour(start + 12, slot) for slot in (10_000, 30_000, 60_000)} == {picture.colours["c3"]}
    assert picture.colour(start + 12, 20_000) == picture.colours["c2"]
    assert picture.colour(start + 23, 6_000) == picture.colour(start + 23, 45_000) == picture.colours["c4"]
    assert picture.colour(start + 28, 60_000) == picture.colours["c4"]
    assert picture.colour(start + 28, 30_000) == picture.colours["c2"]
    # A dark rebalance line at each change after the first map, none before it.
    for at, _ in history[1:]:
        row, column = picture.pixel(at, 20_000)
        assert (picture.rgb[row, column - 1 : column + 2] < 90).all(axis=1).any(), at
    row, column = picture.pixel(start, 20_000)
    assert (picture.rgb[row, column + 3 : column + 40] == picture.colours["c1"]).all()


def _version_1(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` as a version 1 snapshot (one range per consumer), as histories written before issue 12 hold."""
    assert len({r["consumer"] for r in snapshot["ranges"]}) == len(snapshot["ranges"])
    return snapshot | {"version": 1}


@needs_matplotlib
def test_version_1_and_version_2_snapshots_mix_in_one_history(tmp_path: Path) -> None:
    old = [
        (100.0, _version_1(RangeMap.from_ranges([(0, 65535, "c1")]).snapshot())),
        (110.0, _version_1(RangeMap.from_ranges([(0, 32767, "c1"), (32768, 65535, "c2")]).snapshot())),
    ]
    new = (120.0, RangeMap.from_ranges([(0, 9999, "c2"), (10000, 32767, "c1"), (32768, 65535, "c2")]).snapshot())
    source = _write(tmp_path / "history.jsonl", _jsonl([*old, new]))
    loaded = load_history(source)
    assert [snapshot["version"] for _, snapshot in loaded] == [2, 2, 2]  # read as the current version
    assert [RangeMap.from_snapshot(s) for _, s in loaded] == [RangeMap.from_snapshot(s) for _, s in [*old, new]]
    out = tmp_path / "mixed.png"
    assert main(["plot", "--history-file", str(source), "--out", str(out)]) == 0
    picture = Picture(out, loaded, "Range ownership")
    assert picture.labels == ["c1", "c2", "rebalance"]
    assert _check_bands(picture, loaded) == 3
    assert picture.colour(121.0, 5_000) == picture.colour(121.0, 50_000) == picture.colours["c2"]
    # A version 1 snapshot cannot give one consumer two ranges.
    twice = _version_1(old[1][1]) | {"ranges": new[1]["ranges"]}
    with pytest.raises(HistoryError, match=r"line 1: a version 1 snapshot has one range per consumer, but \['c2'\]"):
        load_history(_write(tmp_path / "bad.jsonl", _jsonl([(1.0, twice)])))


@needs_matplotlib
def test_colours_stay_with_consumers_and_empty_maps_draw_nothing(tmp_path: Path) -> None:
    empty = RangeMap().snapshot()
    alone = RangeMap.from_ranges([(0, 65535, "c2")]).snapshot()
    pair = RangeMap.from_ranges([(0, 30000, "c2"), (30001, 65535, "c1")]).snapshot()
    history: list[HistoryEntry] = [(100.0, pair), (110.0, empty), (120.0, alone), (130.0, pair)]
    out = tmp_path / "gap.png"
    render_ownership(history, out)
    picture = Picture(out, history, "Range ownership")
    assert picture.labels == ["c2", "c1", "rebalance"]  # first appearance, in hash order
    assert picture.column(105.0) == {picture.colours["c2"], picture.colours["c1"]}
    assert picture.column(115.0) == {picture.background}  # nobody owned anything
    assert _check_bands(picture, history) == 4


@needs_matplotlib
def test_plot_from_a_running_server_through_the_cli(tmp_path: Path) -> None:
    query = "topic=orders&subscription=billing"
    out = tmp_path / "server.png"
    with ServerThread(ServerConfig(data_dir=tmp_path / "data", metrics_port=0)) as server, Client(server.url) as client:
        assert server.admin_url is not None
        joined = {name: client.subscribe("orders", "billing", consumer_name=name) for name in ("c1", "c2", "c3")}
        joined["c2"].close()  # returns once the server answered, after it recorded the merge
        joined["c4"] = client.subscribe("orders", "billing", consumer_name="c4")
        command = ["plot", "--admin-url", server.admin_url, "--topic", "orders"]
        done = run_main(*command, "--subscription", "billing", "--out", str(out), "--title", "billing")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"wrote {out}: 5 range maps"
        with urlopen(f"{server.admin_url}/history?{query}", timeout=10) as response:
            found: dict[str, Any] = json.load(response)
        unknown = run_main(*command, "--subscription", "nope", "--out", str(tmp_path / "no.png"))
    assert unknown.returncode == 1
    assert "404" in unknown.stderr and "live subscription" in unknown.stderr
    assert not (tmp_path / "no.png").exists()

    history = history_from_records(found["history"])
    # Which range a join splits is the policy's choice (tests/test_rebalance.py); here, who is in.
    assert [sorted(RangeMap.from_snapshot(snapshot).consumers()) for _, snapshot in history] == [
        ["c1"],
        ["c1", "c2"],
        ["c1", "c2", "c3"],
        ["c1", "c3"],
        ["c1", "c3", "c4"],
    ]
    picture = Picture(out, history, "billing")
    assert picture.labels == ["c1", "c2", "c3", "c4", "rebalance"]
    # The joins come milliseconds apart, so only the wide intervals are sampled; the last one always is.
    assert _check_bands(picture, history) >= 1
    last = history[-1][0] + (history[-1][0] - history[0][0]) / 20
    assert picture.column(last) == {picture.colours[name] for name in ("c1", "c3", "c4")}


# -- malformed input ------------------------------------------------------------------

_GOOD = json.dumps({"time": 10.0, "snapshot": RangeMap.from_ranges([(0, 65535, "c1")]).snapshot()})
_GAP = RangeMap.from_ranges([(0, 65535, "c1")]).snapshot() | {"ranges": [{"start": 0, "end": 9, "consumer": "c1"}]}
_SMALL = RangeMap.from_ranges([(0, 15, "c1")], range_size=16).snapshot()


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], "history.jsonl holds no range maps; expected at least one"),
        (["", "  "], "history.jsonl holds no range maps"),
        ([_GOOD, "", "{not json"], "history.jsonl line 3: not JSON"),
        (
            [_GOOD, "[1, 2]"],
            "history.jsonl line 2: expected an object with 'time' and 'snapshot' (and at most 'reason' and "
            "'consumer'), got list",
        ),
        (
            ['{"time": 1}'],
            "line 1: expected an object with 'time' and 'snapshot' (and at most 'reason' and 'consumer'), got ['time']",
        ),
        (['{"time": "soon", "snapshot": {}}'], "line 1: time 'soon' is not a finite number of unix seconds"),
        (['{"time": NaN, "snapshot": {}}'], "line 1: time nan is not a finite number"),
        (['{"time": true, "snapshot": {}}'], "line 1: time True is not a finite number"),
        ([json.dumps({"time": 1, "snapshot": {"ranges": []}})], "line 1: snapshot keys are ['ranges']"),
        ([json.dumps({"time": 1, "snapshot": _GAP})], "line 1: invalid snapshot: ranges end at 9, expected them"),
        ([_GOOD, json.dumps({"time": 9.5, "snapshot": _SMALL})], "line 2: time 9.5 is before the previous map's 10.0"),
        ([_GOOD, json.dumps({"time": 11, "snapshot": _SMALL})], "line 2: range size 16 differs from the previous"),
    ],
)
def test_malformed_history_files_are_rejected_with_line_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], expected: str
) -> None:
    source = _write(tmp_path / "history.jsonl", lines)
    with pytest.raises(HistoryError) as raised:
        load_history(source)
    assert expected in str(raised.value)
    out = tmp_path / "never.png"
    assert main(["plot", "--history-file", str(source), "--out", str(out)]) == 1
    assert capsys.readouterr().err.startswith(f"keyfailover plot: {source}")
    assert not out.exists()


def test_the_api_checks_histories_too() -> None:
    good = RangeMap.from_ranges([(0, 65535, "c1")]).snapshot()
    with pytest.raises(HistoryError, match="the history holds no range maps"):
        render_ownership([], "never.png")
    with pytest.raises(HistoryError, match=r"history entry 2: time 1\.0 is before the previous map's 2\.0"):
        ownership_figure([(2.0, good), (1.0, good)])
    with pytest.raises(HistoryError, match="history entry 1: snapshot keys are"):
        ownership_figure([(1.0, {"epoch": 1})])
    with pytest.raises(HistoryError, match="/history must be a list of"):
        history_from_records({"history": []}, "/history")
    with pytest.raises(HistoryError, match="/history entry 2: expected an object"):
        history_from_records([{"time": 1.0, "snapshot": good}, "x"], "/history")
    assert history_from_records([{"time": 1, "snapshot": good}]) == [(1.0, good)]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--admin-url", "http://127.0.0.1:1", "--topic", "t"], "--admin-url needs --topic and --subscription"),
        (["--history-file", "h.jsonl", "--topic", "t"], "--topic and --subscription go with --admin-url"),
    ],
)
def test_cli_usage_errors(arguments: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", "--out", "never.png", *arguments]) == 2
    assert expected in capsys.readouterr().err


def test_cli_a_history_file_that_cannot_be_read() -> None:
    with pytest.raises(SystemExit, match=r"keyfailover plot: cannot read missing\.jsonl: No such file or directory"):
        main(["plot", "--out", "never.png", "--history-file", "missing.jsonl"])


def test_cli_needs_exactly_one_history_source(capsys: pytest.CaptureFixture[str]) -> None:
    for arguments in ([], ["--history-file", "h.jsonl", "--admin-url", "http://127.0.0.1:1"]):
        with pytest.raises(SystemExit) as raised:
            main(["plot", "--out", "never.png", *arguments])
        assert raised.value.code == 2
        assert "--history-file" in capsys.readouterr().err


def test_without_matplotlib_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path / "history.jsonl", _jsonl(_scenario()))
    for name in ["matplotlib", *(name for name in sys.modules if name.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: importing it fails
    with pytest.raises(MatplotlibMissingError, match=r"install keyfailover\[plot\]"):
        render_ownership(_scenario(), tmp_path / "never.png")
    assert main(["plot", "--history-file", str(source), "--out", str(tmp_path / "never.png")]) == 1
    assert "keyfailover plot: drawing needs matplotlib" in capsys.readouterr().err


@pytest.mark.integration
def test_the_base_install_imports_no_matplotlib() -> None:
    check = (
        "import sys, keyfailover.tools.cli, keyfailover.integrations.plot; "
        "assert 'matplotlib' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
