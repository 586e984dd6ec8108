"""Assembling answer frames into final outputs (async_chunk): in-order emission, out-of-order
buffering, duplicates dropped, errors and gaps, and joining chunks (server and client side) into
the bytes of a whole output."""

from __future__ import annotations

import numpy as np
import pytest

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import HopResult, Payload, RunOutputBin, StageError
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.run_client.outputs import join_run_outputs
from omni_mesh.sidecar.api.outputs import (
    ChunkAssembler,
    final_output,
    join_outputs,
)

pytestmark = pytest.mark.unit

OMNI = get_pipeline("tiny-omni")
SYN = get_pipeline("synthetic")


def wave(chunk: int, n: int = 480) -> np.ndarray:
    t = np.arange(chunk * n, (chunk + 1) * n, dtype=np.float32)
    return np.asarray(0.6 * np.sin(t / 7.0), dtype=np.float32)


def audio(chunk: int) -> Payload:
    return payload_from_arrays({"sample_rate": 24000}, {"waveform": wave(chunk)})


def frame(
    outputs: dict[int, Payload], chunks: dict[int, int] | None = None, *, more: bool = True
) -> HopResult:
    return HopResult(request_id="r", outputs=outputs, chunks=chunks or {}, more=more)


def emitted(assembler: ChunkAssembler, f: HopResult) -> list[tuple[int, int]]:
    return [(c.stage_id, c.chunk) for c in assembler.add(f)]


def test_chunks_are_handed_on_in_order_as_soon_as_they_are_contiguous() -> None:
    asm = ChunkAssembler(OMNI)
    text = Payload(fields={"text": "hello"})
    assert emitted(asm, frame({0: text})) == [(0, 0)]
    assert (asm.streamed, asm.done) == (True, False)
    assert emitted(asm, frame({2: audio(1)}, {2: 1})) == []  # chunk 0 not here yet
    assert emitted(asm, frame({2: audio(2)}, {2: 2})) == []
    assert emitted(asm, frame({2: audio(0)}, {2: 0})) == [(2, 0), (2, 1), (2, 2)]
    assert emitted(asm, frame({2: audio(3)}, {2: 3}, more=False)) == [(2, 3)]
    assert asm.done and asm.end() is None
    joined = asm.joined()
    assert [(o.stage_id, o.kind) for o in joined] == [(0, OutputKind.TEXT), (2, OutputKind.AUDIO)]
    whole = np.concatenate([wave(c) for c in range(4)])
    assert joined[1].data == media.wav_bytes(whole, 24000)
    assert joined[0].text == "hello"


def test_duplicates_of_a_replayed_hop_are_dropped() -> None:
    asm = ChunkAssembler(SYN)
    data = [payload_from_arrays({}, {"data": np.full(8, c, np.uint8)}) for c in range(3)]
    assert emitted(asm, frame({2: data[0]}, {2: 0})) == [(2, 0)]
    assert emitted(asm, frame({2: data[1]}, {2: 1})) == [(2, 1)]
    # The replica died; the replay answers from the start again.
    bogus = payload_from_arrays({}, {"data": np.full(8, 99, np.uint8)})
    assert emitted(asm, frame({2: bogus}, {2: 0})) == []
    assert emitted(asm, frame({2: bogus}, {2: 1})) == []
    assert emitted(asm, frame({2: data[2]}, {2: 2}, more=False)) == [(2, 2)]
    assert asm.duplicates == 2
    assert asm.joined()[0].data == bytes([0] * 8 + [1] * 8 + [2] * 8)


def test_a_unary_answer_is_one_frame_and_joins_to_the_same_bytes() -> None:
    asm = ChunkAssembler(OMNI)
    payloads = {0: Payload(fields={"text": "t"}), 2: audio(0)}
    assert emitted(asm, frame(payloads, more=False)) == [(0, 0), (2, 0)]
    assert not asm.streamed and asm.end() is None
    assert asm.joined()[1].data == final_output(OMNI, 2, audio(0)).data


def test_the_first_error_ends_the_stream() -> None:
    asm = ChunkAssembler(OMNI)
    asm.add(frame({2: audio(0)}, {2: 0}))
    first = StageError(code="deadline", message="too late", stage_id=2)
    assert asm.add(HopResult(request_id="r", error=first, more=False)) == []
    later = StageError(code="engine_error", message="later", stage_id=1)
    assert asm.add(HopResult(request_id="r", error=later)) == []
    assert asm.add(frame({2: audio(1)}, {2: 1})) == []
    assert asm.error == first and asm.end() == first


def test_a_gap_at_the_end_is_an_error_naming_the_stage_and_chunk() -> None:
    asm = ChunkAssembler(OMNI)
    asm.add(frame({2: audio(0)}, {2: 0}))
    asm.add(frame({2: audio(2)}, {2: 2}, more=False))
    err = asm.end()
    assert err is not None and err.stage_id == 2 and "chunk 1" in err.message


def test_a_stream_without_its_last_frame_is_an_error() -> None:
    asm = ChunkAssembler(OMNI)
    asm.add(frame({2: audio(0)}, {2: 0}))
    err = asm.end()
    assert err is not None and "before its last frame" in err.message


def test_timings_accumulate_over_frames() -> None:
    from omni_mesh.data_plane.messages import StageTiming

    asm = ChunkAssembler(OMNI)
    t = [StageTiming(k, f"i{k}", 1.0, 0.0, 2.0) for k in range(3)]
    asm.add(HopResult(request_id="r", timings=t[:1], more=True))
    asm.add(HopResult(request_id="r", timings=t[1:], more=False))
    assert asm.timings == t


# ---- joining ---------------------------------------------------------------------------------


def test_joined_audio_pcm_is_the_chunks_pcm_in_order() -> None:
    parts = [final_output(OMNI, 2, audio(c)) for c in range(3)]
    joined = join_outputs(parts)
    pcm, rate = media.wav_pcm(joined.data or b"")
    assert rate == 24000
    assert pcm == b"".join(media.pcm_bytes(wave(c)) for c in range(3))
    assert joined.array is not None and joined.array.shape == (3 * 480,)


def test_join_text_data_and_single_parts() -> None:
    texts = [final_output(OMNI, 0, Payload(fields={"text": t, "n": i})) for i, t in enumerate("ab")]
    joined = join_outputs(texts)
    assert (joined.text, joined.fields) == ("ab", {"n": 1})
    one = final_output(OMNI, 0, Payload(fields={"text": "x"}))
    assert join_outputs([one]) is one
    blobs = [final_output(SYN, 2, payload_from_arrays({}, {"data": np.arange(4, dtype=np.uint8)}))]
    assert join_outputs(blobs * 2).data == bytes([0, 1, 2, 3] * 2)


def test_an_images_chunks_are_previews_then_itself_and_audio_keeps_its_rate() -> None:
    image = get_pipeline("tiny-image")
    previews = [
        final_output(image, 1, payload_from_arrays({"partial_image_index": i}, {"image": px}))
        for i, px in enumerate([np.zeros((4, 4, 3), np.uint8), np.ones((4, 4, 3), np.uint8)])
    ]
    last = final_output(
        image, 1, payload_from_arrays({}, {"image": np.full((4, 4, 3), 9, np.uint8)})
    )
    assert join_outputs([*previews, last]) is last
    slow = payload_from_arrays({"sample_rate": 16000}, {"waveform": wave(1)})
    with pytest.raises(ValueError, match="several rates"):
        join_outputs([final_output(OMNI, 2, audio(0)), final_output(OMNI, 2, slow)])


def test_the_client_join_gives_the_servers_bytes() -> None:
    """omni-run joins the WAVs of /v1/run chunk calls; the orchestrated path joins waveforms:
    the same bytes."""
    parts = [final_output(OMNI, 2, audio(c)) for c in range(4)]
    server = join_outputs(parts)
    client = join_run_outputs([p.to_run_output_bin() for p in parts])
    assert client.data == server.data and client.mime_type == "audio/wav"
    text = join_run_outputs([RunOutputBin("text", text="ab"), RunOutputBin("text", text="c")])
    assert text.text == "abc"
    blob = join_run_outputs([RunOutputBin("data", data=b"ab"), RunOutputBin("data", data=b"c")])
    assert blob.data == b"abc"
    single = RunOutputBin("image", data=b"png")
    assert join_run_outputs([single]) is single
    preview = RunOutputBin("image", data=b"preview", fields={"partial_image_index": 0})
    assert join_run_outputs([preview, single]) is single
