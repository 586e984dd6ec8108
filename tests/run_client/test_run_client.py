"""The ``/v1/run`` client loop against a real aiohttp server faking the stages' far side
(chains, fan-out, a streamed stage's chunks), and the ``omni-up`` / ``omni-run`` flag checks."""

from __future__ import annotations

import asyncio
import base64
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane import media
from omni_mesh.data_plane.messages import (
    NextInput,
    NextInputBin,
    Prompt,
    RunOutput,
    RunOutputBin,
    RunRequest,
    RunRequestBin,
    RunResponse,
    RunResponseBin,
)
from omni_mesh.launcher import cli as cli_up
from omni_mesh.launcher import local_deploy
from omni_mesh.launcher.supervisor import free_port
from omni_mesh.run_client import cli as cli_run
from omni_mesh.run_client.client import (
    MAX_PARALLEL_CALLS,
    ControlPlaneDiscovery,
    DiscoveryError,
    FixedUrls,
    RunClient,
    StageCall,
    StageCallError,
    StageUrls,
    output_paths,
)

pytestmark = pytest.mark.timeout(60)

TINY_OMNI = get_pipeline("tiny-omni")
FAN_OUT = PipelineSpec(
    name="fan-out-test",
    stages=(
        StageSpec(stage_id=0, name="root", engine="x:Y"),
        StageSpec(
            stage_id=1, name="left", engine="x:Y", sources=(0,), final_output=OutputKind.TEXT
        ),
        StageSpec(
            stage_id=2, name="right", engine="x:Y", sources=(0,), final_output=OutputKind.AUDIO
        ),
    ),
)
WAV = b"RIFF\x00\x00\x00\x00WAVEfmt fake audio"
MSGPACK = "application/msgpack"


@dataclass
class FakeStages:
    """The far side of ``/v1/run`` for a 3-stage pipeline, chain (0→1→2) or fan-out (0→1, 0→2).

    Opaque inputs are ``s<k>:<prompt>``; a stage checks it got back exactly what it handed out.
    ``serves``: the stages this server accepts (400 for others), like a headless instance."""

    serves: frozenset[int] = frozenset({0, 1, 2})
    fan_out: bool = False
    chunks: int = 0  # > 0: stage 1 streams, one stage-2 input per chunk (async_chunk)
    calls: list[tuple[int, str]] = field(default_factory=list)  # (stage id, content type)
    in_flight: int = 0
    most_in_flight: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        binary = request.content_type == MSGPACK
        body = await request.read()
        req: RunRequest | RunRequestBin = (
            msgspec.msgpack.decode(body, type=RunRequestBin)
            if binary
            else msgspec.json.decode(body, type=RunRequest)
        )
        self.calls.append((req.stage_id, request.content_type))
        if self.chunks and req.stage_id:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.02)
                return self.chunked(req, binary)
            finally:
                self.in_flight -= 1
        if req.stage_id not in self.serves:
            return error(400, f"stage_id: this instance runs stage {min(self.serves)} only")
        if req.stage_id == 0:
            if not isinstance(req.stage_input, Prompt):
                return error(400, "stage_input: stage 0 takes a prompt object")
            if req.stage_input.prompt == "fail":
                return error(400, "stage_input.voice: field not accepted by pipeline")
            text = req.stage_input.prompt
            nexts = [1, 2] if self.fan_out else [1]
            return answer(binary, 0, nexts, text, RunOutputBin("text", text=text.upper()))
        raw = req.stage_input if binary else base64.b64decode(str(req.stage_input))
        prefix = f"s{req.stage_id}:".encode()
        if not isinstance(raw, bytes) or not raw.startswith(prefix):
            return error(400, f"stage_input: not an input of stage {req.stage_id}")
        text = raw[len(prefix) :].decode()
        if req.stage_id == 1 and not self.fan_out:
            return answer(binary, 1, [2], text, None)
        if req.stage_id == 1:
            return answer(binary, 1, [], text, RunOutputBin("text", text=f"left {text}"))
        audio = RunOutputBin(
            "audio", data=WAV, mime_type="audio/wav", fields={"sample_rate": 24000}
        )
        return answer(binary, 2, [], text, audio)

    def chunked(self, req: RunRequest | RunRequestBin, binary: bool) -> web.Response:
        """Stage 1 answers one stage-2 input per chunk; stage 2 answers chunk c's audio."""
        raw = req.stage_input if binary else base64.b64decode(str(req.stage_input))
        assert isinstance(raw, bytes)
        if req.stage_id == 1:
            inputs = [f"s2:{c}".encode() for c in range(self.chunks)]
            if binary:
                rb = RunResponseBin(1, "req-1", next=[NextInputBin(2, v) for v in inputs])
                return web.Response(body=msgspec.msgpack.encode(rb), content_type=MSGPACK)
            nexts = [NextInput(2, base64.b64encode(v).decode()) for v in inputs]
            rj = RunResponse(1, "req-1", next=nexts)
            return web.Response(body=msgspec.json.encode(rj), content_type="application/json")
        chunk = int(raw.decode().removeprefix("s2:"))
        wav = media.wav_bytes(chunk_wave(chunk), 24000)
        if binary:
            out = RunOutputBin("audio", data=wav, mime_type="audio/wav")
            rb = RunResponseBin(2, "req-1", chunk=chunk, output=out)
            return web.Response(body=msgspec.msgpack.encode(rb), content_type=MSGPACK)
        data = base64.b64encode(wav).decode()
        rj = RunResponse(2, "req-1", chunk=chunk, output=RunOutput("audio", data=data))
        rj.output.mime_type = "audio/wav"  # type: ignore[union-attr]
        return web.Response(body=msgspec.json.encode(rj), content_type="application/json")


def chunk_wave(chunk: int) -> np.ndarray:
    return np.full(240, (chunk + 1) / 16, dtype=np.float32)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def answer(
    binary: bool, stage_id: int, nexts: list[int], text: str, out: RunOutputBin | None
) -> web.Response:
    inputs = {k: f"s{k}:{text}".encode() for k in nexts}
    if binary:
        rb = RunResponseBin(stage_id=stage_id, request_id="req-1", output=out)
        if len(nexts) == 1:
            rb.next_stage_id, rb.stage_input = nexts[0], inputs[nexts[0]]
        elif nexts:
            rb.next = [NextInputBin(k, v) for k, v in inputs.items()]
        return web.Response(body=msgspec.msgpack.encode(rb), content_type=MSGPACK)
    b64 = {k: base64.b64encode(v).decode() for k, v in inputs.items()}
    rj = RunResponse(stage_id=stage_id, request_id="req-1")
    if out is not None:
        data = None if out.data is None else base64.b64encode(out.data).decode()
        rj.output = RunOutput(out.kind, out.text, data, out.mime_type, out.fields)
    if len(nexts) == 1:
        rj.next_stage_id, rj.stage_input = nexts[0], b64[nexts[0]]
    elif nexts:
        rj.next = [NextInput(k, v) for k, v in b64.items()]
    return web.Response(body=msgspec.json.encode(rj), content_type="application/json")


Serve = Callable[[FakeStages], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start a real HTTP server on a free loopback port for a fake; yields its base URL."""
    servers: list[TestServer] = []

    async def start(fake: FakeStages) -> str:
        app = web.Application()
        app.router.add_post("/v1/run", fake.handle)
        server = TestServer(app, host="127.0.0.1", port=free_port())
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


# ---- the loop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_follows_next_stage_id_to_the_end(serve: Serve, binary: bool) -> None:
    fake = FakeStages()
    url = await serve(fake)
    seen: list[StageCall] = []
    async with RunClient(TINY_OMNI, FixedUrls([url]), msgpack=binary, on_call=seen.append) as c:
        trace = await c.run(Prompt(prompt="hello", seed=7))

    assert [s for s, _ in fake.calls] == [0, 1, 2]
    assert {ct for _, ct in fake.calls} == {MSGPACK if binary else "application/json"}
    assert trace.request_id == "req-1"
    assert trace.outputs[0].text == "HELLO"
    assert trace.outputs[2] == RunOutputBin(
        "audio", data=WAV, mime_type="audio/wav", fields={"sample_rate": 24000}
    )
    assert [c.stage_id for c in trace.calls] == [0, 1, 2] and seen == trace.calls
    assert [c.stage_name for c in trace.calls] == ["thinker", "talker", "code2wav"]
    assert trace.calls[0].next_inputs == ((1, len(b"s1:hello") if binary else 12),)
    assert trace.calls[2].next_inputs == () and trace.calls[2].url == url


async def test_stage_urls_send_each_stage_to_its_own_server(serve: Serve) -> None:
    fakes = [FakeStages(serves=frozenset({k})) for k in range(3)]
    urls = {k: await serve(f) for k, f in enumerate(fakes)}
    async with RunClient(TINY_OMNI, StageUrls(urls)) as client:
        trace = await client.run(Prompt(prompt="hi"))
    assert [[s for s, _ in f.calls] for f in fakes] == [[0], [1], [2]]
    assert [c.url for c in trace.calls] == [urls[0], urls[1], urls[2]]


async def test_fan_out_runs_every_branch(serve: Serve) -> None:
    fake = FakeStages(fan_out=True)
    url = await serve(fake)
    async with RunClient(FAN_OUT, FixedUrls([url])) as client:
        trace = await client.run(Prompt(prompt="go"))
    assert sorted(s for s, _ in fake.calls) == [0, 1, 2]
    assert trace.calls[0].next_inputs == ((1, 8), (2, 8))  # base64 of b"s1:go"
    assert trace.outputs[0].text == "GO" and trace.outputs[1].text == "left go"
    assert trace.outputs[2].data == WAV


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_a_streamed_stage_has_every_chunk_run_and_joined(serve: Serve, binary: bool) -> None:
    fake = FakeStages(chunks=9)
    url = await serve(fake)
    async with RunClient(TINY_OMNI, FixedUrls([url]), msgpack=binary) as client:
        trace = await client.run(Prompt(prompt="hi"))
    assert [s for s, _ in fake.calls].count(2) == 9
    assert 1 < fake.most_in_flight <= MAX_PARALLEL_CALLS  # concurrent, and bounded
    whole = np.concatenate([chunk_wave(c) for c in range(9)])
    assert trace.outputs[2].data == media.wav_bytes(whole, 24000)  # in chunk order
    chunk_calls = [c for c in trace.calls if c.stage_id == 2]
    assert sorted(c.chunk for c in chunk_calls) == list(range(9))
    assert all(c.streamed for c in chunk_calls)
    assert next(c.next_inputs for c in trace.calls if c.stage_id == 1) == tuple(
        (2, 4 if binary else 8) for _ in range(9)
    )
    assert "chunk 3" in cli_run.format_call(next(c for c in chunk_calls if c.chunk == 3), 3)
    line = cli_run.format_call(next(c for c in trace.calls if c.stage_id == 1), 3)
    assert line.endswith("in 9 stage_inputs (chunks) to stage 2")


async def test_a_next_stage_that_does_not_follow_is_refused(serve: Serve) -> None:
    fake = FakeStages()
    url = await serve(fake)
    backwards = PipelineSpec(
        name="backwards",
        stages=(
            StageSpec(stage_id=0, name="a", engine="x:Y"),
            StageSpec(stage_id=1, name="b", engine="x:Y", sources=(0,)),
            StageSpec(
                stage_id=2, name="c", engine="x:Y", sources=(0,), final_output=OutputKind.AUDIO
            ),
        ),
    )
    async with RunClient(backwards, FixedUrls([url])) as client:
        with pytest.raises(StageCallError, match=r"stage\(s\) \[2\], which do not follow 1"):
            await client.run(Prompt(prompt="hi"))


async def test_error_answer_raises_with_the_server_message(serve: Serve) -> None:
    url = await serve(FakeStages())
    async with RunClient(TINY_OMNI, FixedUrls([url])) as client:
        with pytest.raises(StageCallError) as err:
            await client.run(Prompt(prompt="fail"))
    assert err.value.status == 400
    assert err.value.message == "stage_input.voice: field not accepted by pipeline"
    assert str(err.value).startswith(f"stage 0 (thinker) @ {url}: HTTP 400: stage_input.voice")


async def test_wrong_server_for_a_stage_is_an_error_naming_the_stage(serve: Serve) -> None:
    only_stage_0 = await serve(FakeStages(serves=frozenset({0})))
    async with RunClient(TINY_OMNI, FixedUrls([only_stage_0])) as client:
        with pytest.raises(StageCallError, match=r"stage 1 \(talker\) .* runs stage 0 only"):
            await client.run(Prompt(prompt="hi"))


async def test_unreachable_stage_is_an_error_without_status() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with RunClient(TINY_OMNI, FixedUrls([url]), timeout_s=5) as client:
        with pytest.raises(StageCallError) as err:
            await client.run(Prompt(prompt="hi"))
    assert err.value.status is None and "no answer" in str(err.value)


async def test_control_plane_discovery_finds_a_replica_per_stage(serve: Serve) -> None:
    fake = FakeStages()
    stage_url = await serve(fake)
    pools: dict[int, list[str] | None] = {0: [stage_url], 1: [stage_url], 2: [stage_url]}

    async def instances(request: web.Request) -> web.Response:
        stage_id = int(request.match_info["stage"])
        if pools[stage_id] is None:
            return web.json_response({"version": "not an int"})
        listed = [instance(request.match_info["p"], stage_id, a) for a in pools[stage_id] or ()]
        return web.json_response({"pipeline": "tiny-omni", "stage_id": stage_id, "version": 3,
                                  "instances": listed})  # fmt: skip

    app = web.Application()
    app.router.add_get("/v1/pipelines/{p}/stages/{stage}/instances", instances)
    cp = TestServer(app, host="127.0.0.1", port=free_port())
    await cp.start_server()
    try:
        discovery = ControlPlaneDiscovery(str(cp.make_url("")), "tiny-omni")
        async with RunClient(TINY_OMNI, discovery) as client:
            trace = await client.run(Prompt(prompt="hi"))
            assert [s for s, _ in fake.calls] == [0, 1, 2] and 2 in trace.outputs
            pools[1] = []
            with pytest.raises(DiscoveryError, match="no healthy replica of stage 1"):
                await client.run(Prompt(prompt="hi"))
            pools[1] = None
            with pytest.raises(DiscoveryError, match="discovery of stage 1: unexpected answer"):
                await client.run(Prompt(prompt="hi"))
    finally:
        await cp.close()


def instance(pipeline: str, stage_id: int, address: str) -> dict[str, object]:
    return {
        "instance_id": f"i-{stage_id}",
        "pipeline": pipeline,
        "stage_id": stage_id,
        "address": address,
        "host_id": "127.0.0.1",
        "capacity": 8,
        "state": "healthy",
        "epoch": 1,
        "registered_at_ms": 1,
        "last_heartbeat_ms": 2,
        "heartbeat_age_ms": 5,
    }


def test_output_paths_default_by_kind_and_number_several() -> None:
    audio = RunOutputBin("audio", data=b"a", mime_type="audio/wav")
    image = RunOutputBin("image", data=b"i", mime_type="image/png")
    text = RunOutputBin("text", text="t")
    assert output_paths({0: text, 2: audio}, None) == {2: Path("output.wav")}
    assert output_paths({1: image}, Path("x/cat.png")) == {1: Path("x/cat.png")}
    assert output_paths({1: image, 2: audio}, Path("out.bin")) == {
        1: Path("out-1.bin"),
        2: Path("out-2.bin"),
    }


# ---- the CLIs ----------------------------------------------------------------------------------


async def run_cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "omni_mesh.run_client.cli", *args,
        cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.integration
async def test_omni_run_prints_each_stage_and_writes_the_audio(
    serve: Serve, tmp_path: Path
) -> None:
    url = await serve(FakeStages())
    rc, out, err = await run_cli("--pipeline", "tiny-omni", "--url", url, cwd=tmp_path)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"[1/3] thinker @ {url} ")
    assert lines[0].endswith("s, text 25 chars, 40 B stage_input")  # base64 of 28 bytes
    assert lines[2].startswith(f"[3/3] code2wav @ {url} ")
    assert lines[2].endswith(f"s, audio {len(WAV)} B")
    assert "thinker text: HELLO, HOW ARE YOU TODAY?" in out
    assert lines[-1].startswith("Total ") and lines[-1].endswith("saved to output.wav")
    assert (tmp_path / "output.wav").read_bytes() == WAV


@pytest.mark.integration
async def test_omni_run_stage_error_exits_1_with_the_message(serve: Serve, tmp_path: Path) -> None:
    url = await serve(FakeStages())
    args = ("--pipeline", "tiny-omni", "--url", url, "--prompt", "fail", "--msgpack")
    rc, _, err = await run_cli(*args, cwd=tmp_path)
    assert rc == 1
    assert "HTTP 400: stage_input.voice: field not accepted by pipeline" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "1:2"], "gives 2 count(s) but pipeline 'tiny-omni' has 3 stages"),
        (["--replicas", "1:0:1"], "count for stage 1 (talker) must be an integer from 1"),
        (["--replicas", "1:two:1"], "count for stage 1 (talker)"),
        (["--stage-overrides", "[1]"], "--stage-overrides"),
        (["--secret", "short"], "--secret: must be at least 16 characters"),
        (["--port", "70000"], "--port / OMNI_UP_PORT: Input should be less than or equal to 65535"),
    ],
)
def test_omni_up_rejects_bad_flags_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_up.main(["--pipeline", "tiny-omni", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_omni_up_rejects_an_unknown_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_up.main(["--pipeline", "no-such-pipeline"])
    assert exit_.value.code == 2
    assert "unknown pipeline 'no-such-pipeline' (registered: " in capsys.readouterr().err


def test_omni_up_replicas_default_to_the_deploy_config() -> None:
    config = cli_up.parse_args(["--pipeline", "tiny-omni"], {})
    assert config.replicas == (1, 1, 1) and config.secret_source == "generated for this run"
    assert len(config.secret) == 64
    config = cli_up.parse_args(["--pipeline", "tiny-tts", "--replicas", "2:3"], {})
    assert config.replica_spec == "2:3"
    plans = local_deploy.plan_stages(config, "http://127.0.0.1:7700")
    assert [p.name for p in plans] == [
        "stage0-talker-0", "stage0-talker-1",
        "stage1-code2wav-0", "stage1-code2wav-1", "stage1-code2wav-2",
        "api-server",
    ]  # fmt: skip
    assert "--headless" in plans[0].argv and "--api-only" in plans[-1].argv
    assert plans[-1].ready_url == "http://127.0.0.1:8000/health"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pipeline", "tiny-image", "--url", "http://h:1", "--voice", "v"], "--voice"),
        (["--pipeline", "tiny-omni", "--stage-urls", "0=http://h:1,1=http://h:2"], "stage 2"),
        (["--pipeline", "tiny-omni", "--url", "ftp://h"], "not an http(s)://host:port URL"),
        (["--pipeline", "tiny-image", "--url", "http://h:1", "--size", "8"], "bad prompt"),
        (["--pipeline", "nope", "--url", "http://h:1"], "unknown pipeline"),
    ],
)
def test_omni_run_rejects_bad_flags_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_run.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
