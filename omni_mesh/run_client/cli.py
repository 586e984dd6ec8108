"""``omni-run``: run a pipeline through ``/v1/run``, one stage call at a time.

    omni-run --pipeline tiny-omni --url http://127.0.0.1:8000 --prompt "Hello" -o hello.wav
    omni-run --pipeline tiny-tts --stage-urls 0=http://h0:8001,1=http://h1:8002 --voice vivian
    omni-run --pipeline tiny-image --control-plane http://127.0.0.1:7700 --size 64 --msgpack

Parses the flags, prints one line per stage call and the text outputs, writes media outputs;
the loop itself is :class:`omni_mesh.run_client.client.RunClient`. A stage that streams
(``async_chunk``) hands on one input per chunk: each chunk's call gets its own line
(``code2wav chunk 3``), and the written output is the stage's chunks joined (one WAV).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from omni_mesh.configs.pipeline_spec import PipelineError, PipelineSpec
from omni_mesh.configs.registry import get_pipeline, load_pipeline_modules, pipeline_modules_from
from omni_mesh.configs.settings import ControlPlaneClientSettings, LogLevel
from omni_mesh.configs.settings_flags import add_pipeline_module_flag
from omni_mesh.data_plane.messages import Prompt, RunOutputBin
from omni_mesh.run_client.client import (
    ControlPlaneDiscovery,
    FixedUrls,
    RunClient,
    RunClientError,
    RunTrace,
    StageCall,
    StageResolver,
    StageUrls,
    write_outputs,
)

PROMPT_FLAGS = ("seed", "voice", "max_tokens", "size", "steps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-run", description="Run a pipeline through /v1/run, one stage call at a time."
    )
    p.add_argument("--pipeline", required=True, help="registered pipeline name")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--url", action="append", help="API server base URL (repeat for several: round robin)"
    )
    where.add_argument("--stage-urls", help="one base URL per stage: 0=URL,1=URL,...")
    where.add_argument(
        "--control-plane", help="omni-cp URL(s), comma-separated: discover a replica per stage"
    )
    p.add_argument("--cp-token", help="bearer token for the control plane (or OMNI_CP_AUTH_TOKEN)")
    p.add_argument("--prompt", default="Hello, how are you today?", help="the prompt text")
    p.add_argument("--voice", help="voice (speech pipelines)")
    p.add_argument("--seed", type=int, help="seed; the same seed gives the same output")
    p.add_argument("--max-tokens", type=int, help="token budget of AR stages")
    p.add_argument("--size", type=int, help="image size in pixels (image pipelines)")
    p.add_argument("--steps", type=int, help="denoising steps (image pipelines)")
    p.add_argument("--msgpack", action="store_true", help="send and accept application/msgpack")
    p.add_argument("-o", "--output", type=Path, help="media output file (default output.wav/png)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per call (default 300)")
    p.add_argument("--log-level", type=LogLevel, default=LogLevel.WARNING, help="log level")
    add_pipeline_module_flag(p)
    return p


def parse_stage_urls(text: str, pipeline: PipelineSpec) -> dict[int, str]:
    """``0=URL,1=URL`` → {0: URL, 1: URL}; every stage of the pipeline needs one."""
    urls: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, url = item.partition("=")
        if not sep or not key.strip().isdigit():
            raise ValueError(f"--stage-urls: expected STAGE=URL, got {item!r}")
        stage_id = int(key)
        if stage_id not in pipeline.stage_ids:
            raise ValueError(
                f"--stage-urls: pipeline {pipeline.name!r} has no stage {stage_id} "
                f"(stages: {sorted(pipeline.stage_ids)})"
            )
        urls[stage_id] = check_url(url.strip(), "--stage-urls")
    missing = sorted(pipeline.stage_ids - urls.keys())
    if missing:
        names = ", ".join(f"{k} ({pipeline.stage(k).name})" for k in missing)
        raise ValueError(f"--stage-urls: no URL for stage {names}")
    return urls


def check_url(url: str, flag: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http(s)://host:port URL")
    return url


def build_prompt(args: argparse.Namespace, pipeline: PipelineSpec) -> Prompt:
    fields: dict[str, object] = {"prompt": args.prompt}
    for name in PROMPT_FLAGS:
        value = getattr(args, name)
        if value is None:
            continue
        if name not in pipeline.prompt_fields:
            raise ValueError(
                f"--{name.replace('_', '-')}: pipeline {pipeline.name!r} does not take it "
                f"(it takes: {', '.join(pipeline.prompt_fields)})"
            )
        fields[name] = value
    try:
        return msgspec.convert(fields, Prompt)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad prompt: {exc}") from None


def build_resolver(args: argparse.Namespace, pipeline: PipelineSpec) -> StageResolver:
    if args.url:
        return FixedUrls([check_url(u, "--url") for u in args.url])
    if args.stage_urls:
        return StageUrls(parse_stage_urls(args.stage_urls, pipeline))
    cps = [check_url(u.strip(), "--control-plane") for u in args.control_plane.split(",")]
    token = args.cp_token or ControlPlaneClientSettings().token
    return ControlPlaneDiscovery(cps, pipeline.name, token=token, timeout_s=min(args.timeout, 30))


# ---- output ------------------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def describe_output(out: RunOutputBin) -> str:
    if out.text is not None and out.data is None:
        return f"{out.kind} {len(out.text)} chars"
    return f"{out.kind} {format_bytes(len(out.data or b''))}"


def format_call(call: StageCall, stages: int) -> str:
    parts = [f"{call.seconds:.2f}s"]
    parts += [describe_output(out) for _, out in sorted(call.outputs.items())]
    targets = sorted({k for k, _ in call.next_inputs})
    size = format_bytes(call.next_input_bytes)
    if len(call.next_inputs) == 1:
        parts.append(f"{size} stage_input")
    elif len(targets) == 1:
        parts.append(
            f"{size} in {len(call.next_inputs)} stage_inputs (chunks) to stage {targets[0]}"
        )
    elif call.next_inputs:
        to = ", ".join(str(k) for k, _ in call.next_inputs)
        parts.append(f"{size} stage_inputs to stages {to}")
    if call.streamed:  # one of a stream's chunk calls: more calls than stages
        head = f"[{call.index}] {call.stage_name} chunk {call.chunk} @ {call.url}"
    else:
        head = f"[{call.index}/{stages}] {call.stage_name} @ {call.url}"
    return f"{head} {', '.join(parts)}"


def report(trace: RunTrace, pipeline: PipelineSpec, output: Path | None) -> None:
    for stage_id, out in sorted(trace.outputs.items()):
        if out.text is not None:
            print(f"{pipeline.stage(stage_id).name} text: {out.text}")
    paths = write_outputs(trace.outputs, output)
    saved = f", saved to {', '.join(str(p) for p in paths.values())}" if paths else ""
    print(
        f"Total {trace.seconds:.2f}s, {len(trace.calls)} calls, "
        f"request_id {trace.request_id}{saved}"
    )


async def _run(
    args: argparse.Namespace, pipeline: PipelineSpec, resolver: StageResolver, prompt: Prompt
) -> int:
    def progress(call: StageCall) -> None:
        print(format_call(call, len(pipeline.stages)), flush=True)

    async with RunClient(
        pipeline, resolver, msgpack=args.msgpack, timeout_s=args.timeout, on_call=progress
    ) as client:
        try:
            trace = await client.run(prompt)
        except RunClientError as exc:
            print(f"omni-run: {exc}", file=sys.stderr)
            return 1
    try:
        report(trace, pipeline, args.output)
    except OSError as exc:
        print(f"omni-run: cannot write the output: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.as_int, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        load_pipeline_modules(pipeline_modules_from(args.pipeline_module, os.environ))
        pipeline = get_pipeline(args.pipeline)
        prompt = build_prompt(args, pipeline)
        resolver = build_resolver(args, pipeline)
    except (PipelineError, ValueError) as exc:
        parser.error(str(exc))
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return asyncio.run(_run(args, pipeline, resolver, prompt))


if __name__ == "__main__":
    sys.exit(main())
