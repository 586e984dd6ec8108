"""The sidecar's edges in-process: prompt → entry StageInput, final payloads → client outputs
(admission is tested in test_admission.py)."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest

from omni_mesh.configs.pipeline_spec import OutputKind
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import codec, media
from omni_mesh.data_plane.messages import (
    Payload,
    Prompt,
    SamplingParams,
    StageInput,
)
from omni_mesh.data_plane.tensors import payload_from_arrays
from omni_mesh.sidecar.api.outputs import final_output
from omni_mesh.sidecar.inputs import BadPrompt, entry_input
from tests import media_readers

pytestmark = pytest.mark.unit

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# ---- entry_input -----------------------------------------------------------------------------


def test_entry_input_builds_the_entry_stage_input() -> None:
    tts = get_pipeline("tiny-tts")
    sampling = SamplingParams(temperature=0.5)
    before = time.time()
    si = entry_input(
        tts,
        Prompt(prompt="hello", seed=12, voice="echo", max_tokens=40),
        timeout_s=30.0,
        sampling=sampling,
        traceparent=TRACEPARENT,
    )
    assert (si.pipeline, si.stage_id, si.from_stage) == ("tiny-tts", tts.entry_stage_id, -1)
    assert (si.chunk, si.attempt, si.seed) == (0, 0, 12)
    assert si.sampling == sampling and si.traceparent == TRACEPARENT
    assert si.payload.fields == {"prompt": "hello", "voice": "echo", "max_tokens": 40}
    assert si.payload.tensors == {}
    assert (before + 30) * 1000 - 50 <= si.deadline_ms <= (time.time() + 30) * 1000 + 50
    assert codec.decode(codec.encode(si), StageInput) == si  # valid on the wire


@pytest.mark.parametrize(
    ("pipeline", "prompt", "bad_field"),
    [
        ("tiny-tts", Prompt(prompt="x", size=64), "size"),
        ("tiny-tts", Prompt(prompt="x", steps=4), "steps"),
        ("tiny-image", Prompt(prompt="x", voice="echo"), "voice"),
        ("synthetic", Prompt(prompt="x", max_tokens=3), "max_tokens"),
    ],
)
def test_entry_input_refuses_fields_the_pipeline_does_not_accept(
    pipeline: str, prompt: Prompt, bad_field: str
) -> None:
    spec = get_pipeline(pipeline)
    with pytest.raises(BadPrompt) as info:
        entry_input(spec, prompt, timeout_s=5)
    message = str(info.value)
    assert f"stage_input.{bad_field}" in message
    assert repr(pipeline) in message
    assert f"accepted: prompt, {', '.join(spec.prompt_fields)}" in message


def test_entry_input_keeps_a_clients_request_id() -> None:
    si = entry_input(
        get_pipeline("synthetic"), Prompt(prompt="x", request_id="my-id.1"), timeout_s=5
    )
    assert si.request_id == "my-id.1"


def test_entry_input_makes_a_fresh_request_id_and_seed_when_absent() -> None:
    spec = get_pipeline("synthetic")
    a = entry_input(spec, Prompt(prompt="x"), timeout_s=5)
    b = entry_input(spec, Prompt(prompt="x"), timeout_s=5)
    assert a.request_id != b.request_id
    assert len(a.request_id) == 32 and int(a.request_id, 16) >= 0
    assert 0 <= a.seed < 2**31 and 0 <= b.seed < 2**31
    assert "seed" not in a.payload.fields


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "",
    ],
)
def test_entry_input_drops_a_bad_traceparent(traceparent: str) -> None:
    spec = get_pipeline("synthetic")
    si = entry_input(spec, Prompt(prompt="x"), timeout_s=5, traceparent=traceparent)
    assert si.traceparent == ""


def test_entry_input_drops_a_traceparent_with_a_trailing_newline() -> None:
    spec = get_pipeline("synthetic")
    si = entry_input(spec, Prompt(prompt="x"), timeout_s=5, traceparent=TRACEPARENT + "\n")
    assert si.traceparent == ""


# ---- final_output ----------------------------------------------------------------------------


def test_text_output() -> None:
    omni = get_pipeline("tiny-omni")
    out = final_output(omni, 0, Payload(fields={"text": "hi there", "generated_tokens": 8}))
    assert (out.stage_id, out.kind, out.text) == (0, OutputKind.TEXT, "hi there")
    assert out.fields == {"generated_tokens": 8}
    assert out.data is None
    run = out.to_run_output()
    assert (run.kind, run.text, run.data, run.fields) == (
        "text",
        "hi there",
        None,
        {"generated_tokens": 8},
    )


def test_audio_output_is_a_wav_file() -> None:
    omni = get_pipeline("tiny-omni")
    wave = np.sin(np.linspace(0, 40, 4800, dtype=np.float32)) * 0.5
    payload = payload_from_arrays({"sample_rate": 16000}, {"waveform": wave})
    out = final_output(omni, 2, payload)
    assert (out.kind, out.mime_type) == (OutputKind.AUDIO, "audio/wav")
    assert out.data is not None and out.data[:4] == b"RIFF" and out.data[8:12] == b"WAVE"
    decoded, rate = media_readers.read_wav(out.data)
    assert rate == 16000 and decoded.shape == wave.shape
    np.testing.assert_allclose(decoded, wave, atol=1e-4)
    assert out.array is not None
    np.testing.assert_array_equal(out.array, wave)
    run = out.to_run_output()
    assert run.data is not None and base64.b64decode(run.data) == out.data
    assert (run.kind, run.mime_type) == ("audio", "audio/wav")
    assert out.to_run_output_bin().data == out.data


def test_audio_output_defaults_to_24_khz() -> None:
    omni = get_pipeline("tiny-omni")
    payload = payload_from_arrays({}, {"waveform": np.zeros(240, dtype=np.float32)})
    out = final_output(omni, 2, payload)
    assert out.data is not None
    assert media_readers.read_wav(out.data)[1] == 24000


def test_image_output_is_a_png_file() -> None:
    image_pipeline = get_pipeline("tiny-image")
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    payload = payload_from_arrays({"width": 48, "height": 32}, {"image": image})
    out = final_output(image_pipeline, 1, payload)
    assert (out.kind, out.mime_type) == (OutputKind.IMAGE, "image/png")
    assert out.data is not None and out.data.startswith(media.PNG_SIGNATURE)
    assert media_readers.read_png_size(out.data) == (48, 32)
    np.testing.assert_array_equal(media_readers.read_png(out.data), image)
    assert out.fields == {"width": 48, "height": 32}
    assert out.to_run_output().kind == "image"


def test_data_output_is_the_raw_bytes() -> None:
    syn = get_pipeline("synthetic")
    blob = np.arange(300, dtype=np.uint16)
    out = final_output(syn, 2, payload_from_arrays({"n": 1}, {"data": blob}))
    assert (out.kind, out.mime_type) == (OutputKind.DATA, "application/octet-stream")
    assert out.data == blob.tobytes()
    assert out.fields == {"n": 1}
    assert final_output(syn, 2, Payload()).data == b""
