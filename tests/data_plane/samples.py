"""Sample values of every data-plane message, shared by the tests."""

from __future__ import annotations

import numpy as np

from omni_mesh.data_plane import messages as m
from omni_mesh.data_plane.tensors import payload_from_arrays


def sample_payload(n: int = 16) -> m.Payload:
    rng = np.random.default_rng(0)
    return payload_from_arrays(
        {"text": "héllo", "tokens": 3, "temp": 0.5, "done": True, "none": None},
        {
            "hidden": rng.standard_normal((n, 8), dtype=np.float32),
            "codes": np.arange(n * 4, dtype=np.int64).reshape(4, n),
            "mask": np.ones(n, dtype=bool),
        },
    )


def sample_stage_input(stage_id: int = 1, **kw: object) -> m.StageInput:
    fields: dict[str, object] = {
        "pipeline": "tiny-omni",
        "request_id": "req-42",
        "stage_id": stage_id,
        "from_stage": stage_id - 1,
        "deadline_ms": 1_900_000_000_000,
        "seed": 7,
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "sampling": m.SamplingParams(temperature=0.7, top_k=5, max_tokens=32),
        "payload": sample_payload(),
    }
    fields.update(kw)
    return m.StageInput(**fields)  # type: ignore[arg-type]


def sample_output() -> m.StageOutput:
    return m.StageOutput(
        request_id="req-42",
        stage_id=0,
        final=m.Payload(fields={"text": "hi"}),
        next=[sample_stage_input()],
        engine_ms=1.5,
        queue_ms=0.25,
    )


ENGINE_MESSAGES: list[m.EngineMessage] = [
    m.Hello(pid=123, shm_prefix="omni-123-abcd"),
    m.Ready(engine="thinker", max_num_seqs=8, load_seconds=1.25),
    m.Submit(stage_input=sample_stage_input()),
    m.Abort(key="req-42"),
    m.Release(key="req-42"),
    m.Result(output=sample_output(), key="req-42"),
    m.Results(
        results=[
            m.Result(output=sample_output(), key="req-42"),
            m.Result(output=sample_output(), key="req-43/2"),
        ]
    ),
    m.Feed(key="req-42", stage_input=sample_stage_input()),
    m.Stats(queued=1, running=2, batch_size=2, step_ms=3.5, steps=10),
    m.Shutdown(drain=False),
    m.Fatal(message="weights missing"),
]

OTHER_MESSAGES: list[object] = [
    sample_stage_input(),
    sample_output(),
    m.StageOutput(request_id="r", stage_id=2, error=m.StageError(code="deadline", message="late")),
    m.HopResult(
        request_id="req-42",
        outputs={0: m.Payload(fields={"text": "hi"}), 2: sample_payload()},
        timings=[
            m.StageTiming(
                stage_id=0, instance_id="i-1", engine_ms=1, queue_ms=0, total_ms=2, output_bytes=10
            )
        ],
    ),
    m.Tensor(dtype="float32", shape=(), shm=m.ShmRef(segment="omni-1-ab-0", offset=0, nbytes=4)),
    m.Prompt(prompt="hello", seed=1, voice="alloy", max_tokens=16, request_id="abc"),
    m.RunRequest(stage_id=0, stage_input=m.Prompt(prompt="hi")),
    m.RunRequest(stage_id=1, stage_input="T01OSQ", sampling_params=m.SamplingParams()),
    m.RunRequestBin(stage_id=1, stage_input=b"OMNI\x01"),
    m.RunResponse(
        stage_id=0,
        request_id="r",
        next_stage_id=1,
        stage_input="abc",
        output=m.RunOutput(kind="text", text="hi"),
    ),
    m.RunResponse(
        stage_id=0,
        request_id="r",
        next=[m.NextInput(stage_id=1, stage_input="a")],
        outputs={2: m.RunOutput(kind="audio", data="UklGRg==", mime_type="audio/wav")},
    ),
    m.RunResponseBin(
        stage_id=2,
        request_id="r",
        output=m.RunOutputBin(kind="audio", data=b"RIFF", mime_type="audio/wav"),
        next=[m.NextInputBin(stage_id=1, stage_input=b"x")],
        outputs={2: m.RunOutputBin(kind="data", data=b"\x00")},
    ),
]
