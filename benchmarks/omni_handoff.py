"""qwen3-omni's first audio against the length of the thinker's answer, with the thinker's answer
handed to the talker whole (``engine_extras.talker_chunk_tokens: 0``) and in chunks as it is made
(the default, 2): the stages' engine cores in this one process, stepped in turn as their
processes step them (a thinker step, then a talker step), the chunks fed as the sidecars feed
them; the fabric's own costs are measured elsewhere (``streaming``, ``omni``).

First audio: from the request to the talker's first chunk of codes (the frames code2wav turns
into the first audio packet). Answer lengths 16, 64 and 256 thinker tokens (tiny-qwen3-omni's
thinker never ends early), talker ``max_frames`` 512, one request at a time, p50 of the reps.

Target: first audio at 256 tokens ≤ 1.2x first audio at 16 tokens, streamed.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import msgspec

from benchmarks.common import Options, Report
from benchmarks.measure import Target, md_table
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Payload, StageInput, StageOutput, transfer_key
from omni_mesh.data_plane.tensors import array_from_tensor
from omni_mesh.engines.core import EngineCore
from tests.engines.helpers import stage_core, step_inline

PIPELINE = get_pipeline("qwen3-omni")
LENGTHS = (16, 64, 256)
MESSAGES = [{"role": "user", "content": "Tell me a long story about a small robot."}]


def _core(stage_id: int, **extras: Any) -> EngineCore:
    return stage_core(PIPELINE.name, stage_id, **extras)


def _step(core: EngineCore, *inputs: StageInput) -> list[StageOutput]:
    return step_inline(core, *inputs)


def _request(i: int, tokens: int) -> StageInput:
    fields = {"messages": json.dumps(MESSAGES), "max_tokens": tokens, "voice": "ethan"}
    return StageInput(
        pipeline=PIPELINE.name,
        request_id=f"r{i}",
        stage_id=0,
        deadline_ms=int((time.time() + 600) * 1000),
        seed=i,
        payload=Payload(fields=fields),  # type: ignore[arg-type]
    )


def first_audio(thinker: EngineCore, talker: EngineCore, si: StageInput) -> float:
    """Seconds from the request to the talker's first chunk of codes."""
    t0 = time.perf_counter()
    pending = _step(thinker, si)
    opened: StageInput | None = None
    while True:
        for out in pending:
            for n in out.next:
                if opened is None:
                    opened = msgspec.structs.replace(
                        n, stream_from="in-process" if not n.last else ""
                    )
                    talker_out = _step(talker, opened)
                    if any(o.next for o in talker_out):
                        return time.perf_counter() - t0
                else:
                    talker.feed(transfer_key(opened), n, array_from_tensor)
        if opened is not None and talker.running and any(o.next for o in _step(talker)):
            return time.perf_counter() - t0
        if opened is None and not thinker.running:
            raise RuntimeError("the thinker ended without an input for the talker")
        pending = _step(thinker) if thinker.running else []


def _drain(*cores: EngineCore) -> None:
    for core in cores:
        for key in [transfer_key(s.si) for s in core._running]:
            core.abort(key)


async def bench(opts: Options) -> Report:
    reps = opts.repetitions(5, 2)
    talker = _core(1, max_frames=512)
    modes = {
        "whole": _core(0, talker_chunk_tokens=0, max_tokens_limit=1024),
        "streamed": _core(0, talker_chunk_tokens=2, max_tokens_limit=1024),
    }
    figures: dict[tuple[str, int], float] = {}
    for tokens in LENGTHS:
        for mode, thinker in modes.items():
            times = []
            for rep in range(reps + 1):
                took = first_audio(thinker, talker, _request(rep, tokens))
                _drain(thinker, talker)
                if rep:  # the first is a warm-up
                    times.append(took)
            figures[(mode, tokens)] = statistics.median(times)
    rows = [
        [
            str(tokens),
            f"{figures[('whole', tokens)] * 1000:.1f}",
            f"{figures[('streamed', tokens)] * 1000:.1f}",
            f"{figures[('streamed', tokens)] / figures[('whole', tokens)]:.3f} x",
        ]
        for tokens in LENGTHS
    ]
    report = Report(
        "omni-handoff", "qwen3-omni: first audio against answer length, whole vs streamed hand-off"
    )
    report.add(
        md_table(
            [
                "thinker tokens",
                "whole: first codes ms",
                "streamed: first codes ms",
                "streamed / whole",
            ],
            rows,
            title=f"p50 of {reps} requests per cell (after a warm-up), tiny-qwen3-omni, "
            "engine cores in one process",
        )
    )
    growth = figures[("streamed", 256)] / figures[("streamed", 16)]
    report.targets.append(
        Target("first audio at 256 tokens / at 16 tokens, streamed", growth, 1.2, False, "x")
    )
    return report
