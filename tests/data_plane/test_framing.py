"""The one length-prefix framing: encode, decode incrementally (byte by byte, several frames
in one read), limits on both sides."""

from __future__ import annotations

import pytest

from omni_mesh.data_plane import codec, framing
from omni_mesh.data_plane.messages import Abort, HopResult

pytestmark = pytest.mark.unit


def test_frames_survive_any_split_of_the_byte_stream() -> None:
    msgs = [Abort(key="r1"), HopResult(request_id="r2", more=True), Abort(key="r3/4")]
    stream = b"".join(framing.encode_frame(m) for m in msgs)
    for step in (1, 3, len(stream)):
        dec = framing.FrameDecoder(1 << 20)
        got = []
        for start in range(0, len(stream), step):
            dec.feed(stream[start : start + step])
            while (body := dec.next_frame()) is not None:
                got.append(body)
        assert [codec.decode(b, type(m)) for b, m in zip(got, msgs, strict=True)] == msgs
        assert dec.pending == 0


def test_a_partial_frame_stays_pending() -> None:
    frame = framing.encode_frame(Abort(key="r1"))
    dec = framing.FrameDecoder(1 << 20)
    dec.feed(frame[:-1])
    assert dec.next_frame() is None and dec.pending == len(frame) - 1


def test_limits_on_encode_and_on_the_announced_length() -> None:
    with pytest.raises(framing.FrameTooLarge, match="exceeds the 8-byte limit"):
        framing.encode_frame(Abort(key="a-long-key"), max_frame=8)
    dec = framing.FrameDecoder(8)
    dec.feed(framing.HEADER.pack(9))
    with pytest.raises(framing.FrameTooLarge, match="9-byte frame, over the 8-byte limit"):
        dec.next_frame()
