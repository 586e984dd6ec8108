"""The model's own time to a realtime response's first audio, with no fabric: qwen3-omni's three
stage engines in this one process, each through its :class:`EngineCore` (the code the engine
processes run) with plain in-memory tensors, one torch thread each as in the pods, stepped back
to back: the thinker until it hands the talker its input, the talker's first chunk, code2wav's
decode of that chunk. The input is what a realtime response sends the thinker for a committed
spoken turn: the user's audio as an ``input_audio`` WAV part of the chat messages.

``python -m benchmarks.realtime_reference --reps N --max-tokens M --audio-file F`` prints one JSON
object: the seconds of each repetition, its split by stage, and the thinker's token count;
``--serve`` runs one repetition per line read (the benchmark interleaves them with its turns).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.messages import Prompt, StageInput, StageOutput, Tensor
from omni_mesh.data_plane.tensors import array_from_tensor, tensor_from_array
from omni_mesh.engines.base import EngineContext
from omni_mesh.engines.core import EngineCore
from omni_mesh.sidecar.api.realtime.conversation import Item, audio_part, model_messages
from omni_mesh.sidecar.inputs import entry_input

PIPELINE = "qwen3-omni"
RATE = 24_000  # the session's pcm input rate: the committed audio part's rate


def _write(arr: np.ndarray, owner: str) -> Tensor:
    return tensor_from_array(np.array(arr, copy=True))


def _step(core: EngineCore, inputs: list[StageInput]) -> list[StageOutput]:
    now = time.monotonic()
    outs = [out for _, out in core.advance([(x, now) for x in inputs], array_from_tensor, _write)]
    for out in outs:
        if out.error is not None:
            raise RuntimeError(f"stage {core.stage.stage_id}: {out.error.message}")
    return outs


def cores() -> list[EngineCore]:
    spec = get_pipeline(PIPELINE)
    deploy = load_deploy_config(None, spec)
    built = []
    for stage in spec.stages:
        ctx = EngineContext(spec, stage, deploy.stage(stage.stage_id), async_chunk=True)
        core = EngineCore.build(ctx)
        core.engine.load()
        built.append(core)
    return built


def thinker_input(samples: np.ndarray, max_tokens: int, seed: int) -> StageInput:
    spec = get_pipeline(PIPELINE)
    user = Item(id=f"item_{seed}", role="user", parts=[audio_part(samples, RATE)])
    prompt, messages = model_messages([user], "", audio_in=True)
    si = entry_input(
        spec,
        Prompt(prompt=prompt, max_tokens=max_tokens, seed=seed, request_id=f"ref{seed}"),
        timeout_s=600,
    )
    si.payload.fields = {**si.payload.fields, "messages": json.dumps(messages)}
    return si


def first_audio(stages: list[EngineCore], si: StageInput) -> tuple[list[float], int]:
    """Seconds of each stage from the thinker's input to code2wav's first audio chunk (the
    thinker until it hands on, the talker's first chunk, code2wav's decode of it), and the
    thinker's token count; every stream is closed afterwards."""
    thinker, talker, code2wav = stages
    t0 = time.perf_counter()
    outs = _step(thinker, [si])
    while not any(out.next for out in outs):
        outs = _step(thinker, [])
    (to_talker,) = [n for out in outs for n in out.next]
    text = [out for out in outs if out.final is not None][-1].final
    tokens = int(text.fields.get("completion_tokens", 0)) if text is not None else 0
    t1 = time.perf_counter()
    outs = _step(talker, [to_talker])
    while not any(out.next for out in outs):
        outs = _step(talker, [])
    (to_code2wav,) = [n for out in outs for n in out.next][:1]
    t2 = time.perf_counter()
    audio = _step(code2wav, [to_code2wav])
    t3 = time.perf_counter()
    if not audio or audio[0].final is None:
        raise RuntimeError("code2wav gave no audio for the first chunk")
    for core in stages:
        for key in [s.si.request_id for s in core._running]:
            core.abort(key)
    return [t1 - t0, t2 - t1, t3 - t2], tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.realtime_reference")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--audio-file", required=True, help="int16 PCM at 24 kHz, raw")
    p.add_argument(
        "--serve",
        action="store_true",
        help="after loading, print 'ready'; then one repetition per stdin line (its seed), "
        "one JSON line each (the benchmark interleaves them with the fabric's turns)",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as each engine process runs
    samples = np.fromfile(args.audio_file, dtype="<i2")
    stages = cores()
    first_audio(stages, thinker_input(samples, args.max_tokens, 10_000))  # warm-up
    if args.serve:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        for line in sys.stdin:
            split, tokens = first_audio(stages, thinker_input(samples, args.max_tokens, int(line)))
            sys.stdout.write(json.dumps({"stages": split, "tokens": tokens}) + "\n")
            sys.stdout.flush()
        return 0
    result: dict[str, Any] = {"seconds": [], "stages": [], "tokens": []}
    for rep in range(args.reps):
        split, tokens = first_audio(stages, thinker_input(samples, args.max_tokens, rep))
        result["seconds"].append(sum(split))
        result["stages"].append(split)
        result["tokens"].append(tokens)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
