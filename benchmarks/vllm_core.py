"""The vLLM stage's engine-process path against vLLM's engine alone, in one process: tiny-llm's
stage as its engine process runs it (``EngineCore.advance`` over the vLLM engine, every row's
output a chunk of one token, each step's outputs encoded as the one ``Results`` frame the
process sends) against ``LLMEngine.step`` looped on the same engine, the same 16 x 64-token
greedy requests added at once. What the fabric adds between vLLM's step and the engine
channel, without the sidecar, HTTP or a client on the machine's other core (``vllm`` measures
the whole deployment).

Target (issue 33 item 2, for this part of the path): ≥ 0.95x vLLM's engine alone.
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import Options, Report
from benchmarks.measure import Target, md_table
from omni_mesh.configs.loader import bundled_deploy_path, load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import framing
from omni_mesh.data_plane.messages import Payload, Result, Results, SamplingParams, StageInput
from omni_mesh.engines.base import EngineContext
from omni_mesh.engines.core import EngineCore
from tests.engines.helpers import step_inline

ROWS = 16
TOKENS = 64


def _request(i: int) -> StageInput:
    return StageInput(
        pipeline="tiny-llm",
        request_id=f"r{i}-{time.time_ns()}",
        stage_id=0,
        deadline_ms=int((time.time() + 600) * 1000),
        seed=i,
        sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        payload=Payload(fields={"prompt": f"request number {i}"}),  # type: ignore[arg-type]
    )


def through_core(core: EngineCore) -> float:
    """Tokens/s of ``ROWS`` requests through the engine core, each step's outputs framed."""
    t0 = time.perf_counter()
    outputs = step_inline(core, *[_request(i) for i in range(ROWS)])
    count = len(outputs)
    while core.running:
        step = step_inline(core)
        framing.encode_frame(Results(results=[Result(output=o, key="k") for o in step]))
        count += len(step)
    return ROWS * TOKENS / (time.perf_counter() - t0)


def alone(core: EngineCore) -> float:
    """Tokens/s of the same requests with ``LLMEngine.step`` alone."""
    from vllm import SamplingParams as VllmSampling

    llm = core.engine._llm  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for i in range(ROWS):
        params = VllmSampling(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        llm.add_request(f"x{i}-{time.time_ns()}", {"prompt": f"request number {i}"}, params)
    while llm.has_unfinished_requests():
        llm.step()
    return ROWS * TOKENS / (time.perf_counter() - t0)


async def bench(opts: Options) -> Report:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = get_pipeline("tiny-llm")
    deploy = load_deploy_config(bundled_deploy_path("tiny-llm"), spec)
    ctx = EngineContext(spec, spec.stage(0), deploy.stage(0), async_chunk=True)
    core = EngineCore.build(ctx)
    core.engine.load()
    reps = opts.repetitions(7, 3)
    through_core(core), alone(core)  # warm-up
    mine, theirs = [], []
    for _ in range(reps):  # alternating, so both see the same machine
        mine.append(through_core(core))
        theirs.append(alone(core))
    a, b = statistics.median(mine), statistics.median(theirs)
    report = Report("vllm-core", "the vLLM stage's engine-process path vs LLMEngine.step alone")
    report.add(
        md_table(
            ["path", "tokens/s (p50)"],
            [["EngineCore + Results frames", f"{a:,.0f}"], ["LLMEngine.step alone", f"{b:,.0f}"]],
            title=f"tiny-llm, {ROWS} rows x {TOKENS} tokens, greedy, {reps} runs each, in-process",
        )
    )
    report.targets.append(Target("engine-process path / LLMEngine alone", a / b, 0.95, True, "x"))
    core.engine.close()
    return report
