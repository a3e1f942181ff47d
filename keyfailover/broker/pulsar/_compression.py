"""Pulsar's payload compression, undone: LZ4, ZLIB, ZSTD and SNAPPY as Pulsar's clients write them.

A producer compresses a message's payload, or a batched entry's whole payload, with the codec its
MessageMetadata names in ``compression`` and says the size before in ``uncompressed_size``. The
server decompresses it to split a batch into its keys and stores what it gets, so consumers
receive uncompressed messages, which every Pulsar consumer accepts. The formats are those of
pulsar-client-cpp's ``CompressionCodec*`` and the Java client's: an LZ4 block without a frame, a
zlib stream, a ZSTD frame, raw snappy. The size a client gives is checked against a limit before
anything is allocated, each decoder writes into a buffer of one byte more (so a payload that holds more
fails, whatever its own header says), and the output must be exactly that size.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Final

import cramjam

from keyfailover.broker.pulsar._codec import PulsarFrameError
from keyfailover.broker.pulsar.PulsarApi_pb2 import LZ4, SNAPPY, ZLIB, ZSTD, CompressionType

__all__ = ["decompress"]


def _zlib(data: bytes, size: int) -> bytes:
    """A whole zlib stream, of at most ``size + 1`` bytes out."""
    stream = zlib.decompressobj()
    out = stream.decompress(data, size + 1)
    if not stream.eof or stream.unused_data:
        raise ValueError("the zlib stream does not end where the payload does")
    return out


def _into(decode: Callable[[bytes, bytearray], int]) -> Callable[[bytes, int], bytes]:
    """A decoder of at most ``size + 1`` bytes out, from a cramjam ``*_into`` function (which says how many
    bytes it wrote, where cramjam's other functions pad their output to the size asked for)."""

    def decoder(data: bytes, size: int) -> bytes:
        out = bytearray(size + 1)
        del out[decode(data, out) :]
        return bytes(out)

    return decoder


_DECODERS: Final[dict[int, Callable[[bytes, int], bytes]]] = {
    LZ4: _into(lambda data, out: cramjam.lz4.decompress_block_into(data, out, output_len=len(out))),
    ZLIB: _zlib,
    ZSTD: _into(cramjam.zstd.decompress_into),
    SNAPPY: _into(cramjam.snappy.decompress_raw_into),
}
"""Each codec's decoder: the compressed bytes and the size the client said in, at most that size and one byte
more out."""


def decompress(compression: int, payload: bytes, size: int, max_size: int) -> bytes:
    """``payload`` decompressed with Pulsar codec ``compression`` into ``size`` bytes, at most ``max_size``.

    Raises :class:`PulsarFrameError` for an unknown codec, a size over ``max_size``, or a payload that is
    not such a stream of exactly ``size`` bytes.
    """
    decoder = _DECODERS.get(compression)
    if decoder is None:
        raise PulsarFrameError(
            f"compression {compression} is not one of Pulsar's codecs; expected LZ4, ZLIB, ZSTD or SNAPPY"
        )
    name = CompressionType.Name(compression)  # type: ignore[arg-type]
    if size > max_size:
        raise PulsarFrameError(
            f"the {name} payload's uncompressed size {size} is over the limit of {max_size} bytes (the max message "
            "size); expected a message that fits uncompressed"
        )
    try:
        out = decoder(payload, size)
    except (ValueError, cramjam.DecompressionError, zlib.error) as exc:
        raise PulsarFrameError(f"the payload is not valid {name} data ({exc})") from None
    if len(out) != size:
        raise PulsarFrameError(
            f"the {name} payload decompresses to {len(out)} bytes; expected its uncompressed size, {size}"
        )
    return out
