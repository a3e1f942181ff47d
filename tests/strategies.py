"""Hypothesis strategies shared by the decoder's and the server's fuzz tests."""

from __future__ import annotations

import struct

from hypothesis import strategies as st

random_streams = st.lists(
    st.binary(max_size=200) | st.binary(max_size=200).map(lambda body: struct.pack(">I", len(body)) + body),
    max_size=4,
).map(b"".join)
"""Random bytes, and random bodies behind a 4-byte length prefix that fits them (so a decoder reads them)."""


@st.composite
def mutated(draw: st.DrawFn, stream: bytes) -> bytes:
    """``stream`` with a few bytes flipped, set, inserted or deleted."""
    data = bytearray(stream)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        if action == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)
