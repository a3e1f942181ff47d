"""How a subscription packs a consumer's deliveries into ``messages`` frames (its ``_send_in_frames``)."""

from __future__ import annotations

from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from keyfailover.broker.server._subscription import _SEND_BATCH, _SEND_BYTES, Session, _send_in_frames
from keyfailover.wire.properties import MAX_PROPERTIES_SIZE, check_encoded
from keyfailover.wire.protocol import Delivered, Frame, Messages


class Recorder:
    """A session that keeps what it is sent."""

    id = 7

    def __init__(self) -> None:
        self.frames: list[Frame] = []

    def send(self, frame: Frame) -> None:
        self.frames.append(frame)


def sent(items: list[Delivered]) -> list[list[Delivered]]:
    recorder = Recorder()
    _send_in_frames(cast(Session, recorder), items, sum(len(each[5] or b"") for each in items))
    assert all(type(frame) is Messages and frame.session == 7 for frame in recorder.frames)
    return [cast(Messages, frame).messages for frame in recorder.frames]


def item(position: int, size: int, properties: bytes | None = None) -> Delivered:
    return (position, f"key-{position}", b"x" * size, 0, 1_700_000_000_000_000, properties, "producer")


def test_what_fits_goes_in_one_frame() -> None:
    items = [item(p, 100) for p in range(_SEND_BATCH)]
    assert sent(items) == [items]


def test_more_than_a_batch_goes_in_frames_of_a_batch_in_order() -> None:
    items = [item(p, 10) for p in range(2 * _SEND_BATCH + 5)]
    frames = sent(items)
    assert [len(frame) for frame in frames] == [_SEND_BATCH, _SEND_BATCH, 5]
    assert [each for frame in frames for each in frame] == items


def test_large_payloads_are_split_under_the_byte_bound_and_one_too_large_goes_alone() -> None:
    items = [item(0, _SEND_BYTES // 3), item(1, _SEND_BYTES // 3), item(2, _SEND_BYTES // 3), item(3, _SEND_BYTES + 1)]
    frames = sent(items)
    assert [[each[0] for each in frame] for frame in frames] == [[0, 1], [2], [3]]


def test_properties_count_toward_the_byte_bound() -> None:
    """A thousand messages each with the most properties would make a 64 MiB frame: they are split."""
    heavy = b"\x81\xa1k\xda" + (MAX_PROPERTIES_SIZE - 6).to_bytes(2, "big") + b"v" * (MAX_PROPERTIES_SIZE - 6)
    assert len(check_encoded(heavy)) == MAX_PROPERTIES_SIZE
    items = [item(p, 10, heavy) for p in range(_SEND_BATCH)]
    frames = sent(items)
    assert [each for frame in frames for each in frame] == items
    assert all(sum(len(each[2]) + 32 + len(each[5] or b"") for each in frame) <= _SEND_BYTES for frame in frames)
    per_frame = _SEND_BYTES // (10 + 32 + MAX_PROPERTIES_SIZE)  # 31
    assert len(frames) == -(-_SEND_BATCH // per_frame)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 1000, _SEND_BYTES // 7, _SEND_BYTES // 2, _SEND_BYTES]), max_size=40),
    st.integers(1, 1500),
)
def test_frames_keep_every_delivery_in_order_within_both_bounds(sizes: list[int], small: int) -> None:
    items = [item(p, size) for p, size in enumerate(sizes)] + [item(len(sizes) + p, 1) for p in range(small)]
    frames = sent(items)
    assert [each for frame in frames for each in frame] == items
    for frame in frames:
        assert 0 < len(frame) <= _SEND_BATCH
        if len(frame) > 1:
            assert sum(len(each[2]) + 32 for each in frame) <= _SEND_BYTES + 32
    if items and len(items) <= _SEND_BATCH and sum(len(each[2]) + 32 for each in items) <= _SEND_BYTES:
        assert len(frames) == 1
