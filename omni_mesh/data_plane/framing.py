"""The one length-prefixed framing of the data path: a 4-byte big-endian length, then that
many bytes of msgpack. The sidecar ⇄ engine channel and the streamed ``/v1/hop`` answer
(:data:`~omni_mesh.data_plane.constants.HOP_FRAMES`) both speak it.

* :func:`encode_frame` — prefix and message in one buffer (encoded in place: no copy).
* :func:`frame_size` — the length announced by a prefix, checked against a limit.
* :class:`FrameDecoder` — incremental: feed bytes as they arrive, take whole frames out.
"""

from __future__ import annotations

import struct
from typing import Any

from omni_mesh.data_plane.codec import Buffer, encode_into

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
#: The most a prefix can announce.
MAX_LENGTH = 0xFFFFFFFF


class FrameError(ValueError):
    """A frame over its limit, or bytes that end inside a frame."""


class FrameTooLarge(FrameError):
    """A frame (announced or encoded) is over the limit."""


def encode_frame(msg: Any, *, max_frame: int = MAX_LENGTH) -> bytearray:
    """``[length][msgpack of msg]`` in one buffer; :class:`FrameTooLarge` over ``max_frame``
    bytes of body (:class:`~omni_mesh.data_plane.codec.CodecError` when it cannot encode)."""
    frame = bytearray(HEADER_SIZE)
    size = encode_into(msg, frame, HEADER_SIZE) - HEADER_SIZE
    if size > max_frame:
        raise FrameTooLarge(f"frame of {size} bytes exceeds the {max_frame}-byte limit")
    HEADER.pack_into(frame, 0, size)
    return frame


def frame_size(header: Buffer, max_frame: int) -> int:
    """The body length a prefix announces; :class:`FrameTooLarge` over ``max_frame``."""
    (size,) = HEADER.unpack_from(header)
    if size > max_frame:
        raise FrameTooLarge(f"peer sent a {size}-byte frame, over the {max_frame}-byte limit")
    return int(size)


class FrameDecoder:
    """Bytes in (:meth:`feed`), whole frame bodies out (:meth:`next_frame`)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: Buffer) -> None:
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next whole frame's body, or ``None`` until more bytes arrive."""
        buf = self._buf
        if len(buf) < HEADER_SIZE:
            return None
        end = HEADER_SIZE + frame_size(buf, self.max_frame)
        if len(buf) < end:
            return None
        body = bytes(buf[HEADER_SIZE:end])
        del buf[:end]
        return body

    def peek(self, n: int) -> bytes:
        """The first ``n`` bytes buffered (fewer when fewer are)."""
        return bytes(self._buf[:n])

    @property
    def pending(self) -> int:
        """Bytes buffered that do not make a whole frame yet (0 at a clean boundary)."""
        return len(self._buf)
