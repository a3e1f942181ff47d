"""Range ownership over time: a subscription's recorded range maps drawn as a PNG.

The history is a list of ``(unix seconds, RangeMap snapshot)`` pairs, oldest first: what the
server's admin ``/history`` endpoint returns, or a JSON-lines file of
``{"time": seconds, "snapshot": {...}}`` records, in snapshot version 1 (one range per
consumer) or 2 (several), mixed freely. Each map holds from its time until the next one's;
the picture has the hash space upwards, time rightwards and a vertical line at every change.
A consumer may own several bands at once: all of them have its colour, and the legend lists
each consumer once. matplotlib (the ``plot`` extra) is imported only when drawing, so the
base install reads and checks histories without it.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from keyfailover.core.errors import KeyFailoverError, RangeMapError
from keyfailover.core.ranges import RangeMap

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.figure import Figure

__all__ = [
    "HistoryEntry",
    "HistoryError",
    "MatplotlibMissingError",
    "history_from_records",
    "load_history",
    "ownership_figure",
    "render_ownership",
]

HistoryEntry = tuple[float, dict[str, Any]]
"""``(unix seconds, RangeMap snapshot)``: one recorded range map."""

_LINE_COLOUR = "black"
_LEGEND_ROWS = 24  # consumers per legend column


class HistoryError(KeyFailoverError, ValueError):
    """A history of range maps is empty, malformed, out of time order or mixes range sizes."""


class MatplotlibMissingError(KeyFailoverError, ImportError):
    """Drawing needs matplotlib, which is not installed (it is the ``plot`` extra)."""


def load_history(path: str | os.PathLike[str]) -> list[HistoryEntry]:
    """Read a JSON-lines history (one ``{"time", "snapshot"}`` object a line; blank lines skipped).

    Every line is checked as :func:`history_from_records` checks a record, and errors name the
    line; snapshots come back in the current version (2) whatever version was stored. Raises
    :class:`HistoryError`, or ``OSError`` if the file cannot be read.
    """
    items: list[tuple[str, object]] = []
    with open(path, encoding="utf-8") as source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)} line {number}"
            try:
                items.append((where, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise HistoryError(f"{where}: not JSON ({exc})") from None
    return _from_records(items, f"{os.fspath(path)}")


def history_from_records(records: object, source: str = "the history") -> list[HistoryEntry]:
    """Check a list of ``{"time", "snapshot"}`` records (the ``history`` of ``/history``).

    Times must be finite numbers, oldest first; each snapshot must pass
    :meth:`RangeMap.from_snapshot` (version 1 or 2), all with one range size, and comes back
    as a version 2 snapshot. ``source`` names the records in errors. Raises :class:`HistoryError`.
    """
    if not isinstance(records, list):
        raise HistoryError(f"{source} must be a list of {{'time', 'snapshot'}} records, not {type(records).__name__}")
    return _from_records(((f"{source} entry {index}", record) for index, record in enumerate(records, 1)), source)


def ownership_figure(history: Sequence[tuple[float, Mapping[str, Any]]], title: str | None = None) -> Figure:
    """The ownership picture as a matplotlib ``Figure`` (Agg canvas), for pages of your own.

    The x axis is the time since the first map (seconds, or minutes or hours for long
    histories), the y axis the hash slot: slot ``s`` covers ``[s, s + 1)``. The last map is
    drawn for a tenth of the history's span (1 s when there is a single map). Each consumer has
    one colour, for every band it owns, in order of first appearance. Raises
    :class:`HistoryError` for a bad history and :class:`MatplotlibMissingError` without matplotlib.
    """
    checked = _checked(
        ((f"history entry {index}", entry) for index, entry in enumerate(history, 1)),
        "the history",
    )
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise MatplotlibMissingError(
            f"drawing needs matplotlib ({exc}); install keyfailover[plot]: pip install 'keyfailover[plot]'"
        ) from None
    first = checked[0][0]
    span = checked[-1][0] - first
    seconds_per_unit, unit = _time_unit(span)
    starts = [(at - first) / seconds_per_unit for at, _ in checked]
    end = starts[-1] + (span / 10 if span > 0 else 1.0) / seconds_per_unit
    range_size = checked[0][1].range_size

    tab20 = colormaps["tab20"]
    # tab20 pairs a dark and a light shade of each hue (an int picks a colour): the ten dark ones first.
    palette = [tab20(index)[:3] for index in (*range(0, 20, 2), *range(1, 20, 2))]
    colours = _colours(_consumers(ranges for _, ranges in checked), palette)
    verts: list[list[tuple[float, float]]] = []
    faces: list[str] = []
    for left, right, (_, ranges) in zip(starts, [*starts[1:], end], checked, strict=True):
        for start, last, consumer in ranges.ranges():
            verts.append([(left, start), (right, start), (right, last + 1), (left, last + 1)])
            faces.append(colours[consumer])

    figure = Figure(figsize=(10, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    # Without antialiasing, neighbouring ranges meet on a pixel edge and keep their exact colours.
    axes.add_collection(PolyCollection(verts, facecolors=faces, edgecolors="none", antialiased=False))
    changes = sorted(set(starts[1:]))
    if changes:
        axes.vlines(changes, 0, range_size, colors=_LINE_COLOUR, linewidth=0.8)
    axes.set_xlim(0, end)
    axes.set_ylim(0, range_size)
    axes.set_yticks(sorted({*(i * range_size // 4 for i in range(4)), range_size - 1}))
    started = datetime.fromtimestamp(first, UTC)
    axes.set_xlabel(f"{unit} since {started:%Y-%m-%d %H:%M:%S} UTC")
    axes.set_ylabel("hash slot")
    axes.set_title(title if title is not None else "Range ownership")

    handles: list[Artist] = [Patch(facecolor=colour, label=consumer) for consumer, colour in colours.items()]
    if changes:
        handles.append(Line2D([], [], color=_LINE_COLOUR, linewidth=0.8, label="rebalance"))
    figure.legend(handles=handles, loc="outside right upper", ncols=max(1, math.ceil(len(handles) / _LEGEND_ROWS)))
    return figure


def render_ownership(
    history: Sequence[tuple[float, Mapping[str, Any]]], out: str | os.PathLike[str], title: str | None = None
) -> None:
    """Draw :func:`ownership_figure` of ``history`` into the PNG file ``out``."""
    figure = ownership_figure(history, title)
    figure.savefig(out, format="png", dpi=figure.dpi)


# -- checking ------------------------------------------------------------------------


_RECORD_KEYS = frozenset({"time", "snapshot", "reason", "consumer"})
"""The keys a history record may have: ``/history`` adds each change's reason and consumer, which plots ignore."""


def _from_records(items: Iterable[tuple[str, object]], source: str) -> list[HistoryEntry]:
    pairs: list[tuple[str, object]] = []
    for where, record in items:
        if not isinstance(record, dict) or not {"time", "snapshot"} <= set(record) <= _RECORD_KEYS:
            shown = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise HistoryError(
                f"{where}: expected an object with 'time' and 'snapshot' (and at most 'reason' and 'consumer'), "
                f"got {shown}"
            )
        pairs.append((where, (record["time"], record["snapshot"])))
    return [(at, ranges_map.snapshot()) for at, ranges_map in _checked(pairs, source)]


def _checked(items: Iterable[tuple[str, object]], source: str) -> list[tuple[float, RangeMap]]:
    """Each ``(where, (time, snapshot))`` item as ``(time, RangeMap)``; errors say ``where``."""
    checked: list[tuple[float, RangeMap]] = []
    for where, entry in items:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise HistoryError(f"{where}: expected a (time, snapshot) pair, got {entry!r:.80}")
        at, snapshot = entry
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            raise HistoryError(f"{where}: time {at!r:.40} is not a finite number of unix seconds")
        try:
            ranges_map = RangeMap.from_snapshot(snapshot)
        except RangeMapError as exc:
            raise HistoryError(f"{where}: {exc}") from None
        if checked:
            before, previous = checked[-1]
            if at < before:
                raise HistoryError(f"{where}: time {at} is before the previous map's {before}; expected oldest first")
            if ranges_map.range_size != previous.range_size:
                raise HistoryError(
                    f"{where}: range size {ranges_map.range_size} differs from the previous map's "
                    f"{previous.range_size}; expected one hash space"
                )
        checked.append((float(at), ranges_map))
    if not checked:
        raise HistoryError(f"{source} holds no range maps; expected at least one")
    return checked


# -- drawing -------------------------------------------------------------------------


def _time_unit(span: float) -> tuple[float, str]:
    """Seconds per x unit and its name, so the axis reads in small numbers."""
    if span <= 600:
        return 1.0, "seconds"
    if span <= 10 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _consumers(maps: Iterable[RangeMap]) -> list[str]:
    """Every consumer once, in order of first appearance (in hash order within a map)."""
    return list(dict.fromkeys(consumer for ranges in maps for consumer in ranges.consumers()))


def _colours(consumers: Sequence[str], palette: Sequence[tuple[float, float, float]]) -> dict[str, str]:
    """One colour per consumer for the whole picture: the palette, then golden-angle hues."""
    colours: dict[str, str] = {}
    for index, consumer in enumerate(consumers):
        if index < len(palette):
            rgb = palette[index]
        else:
            rgb = colorsys.hsv_to_rgb((index * 0.618033988749895) % 1.0, 0.55, 0.85)
        colours[consumer] = "#" + "".join(f"{round(channel * 255):02x}" for channel in rgb)
    return colours
