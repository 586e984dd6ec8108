"""The pod's lean hop server (``sidecar/api/hop_server.py``): plain hops are served by it, and
any other request hands its connection to aiohttp, which answers it as before — on a real
stage pod, over raw loopback sockets, so that the bytes on the wire are what is tested."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from omni_mesh.data_plane import codec
from omni_mesh.data_plane.messages import HopResult, Payload, StageInput, Tensor
from omni_mesh.data_plane.signing import hop_token
from omni_mesh.sidecar.api.hop_server import parse_hop_head
from tests.procs import wait_until
from tests.sidecar.topology import SECRET, Topology

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = hop_token(SECRET.encode())
STEP_MS = 300  # stage 2's step: long enough to hang up on a hop in flight
BODY_LIMIT = 1 << 20  # the pod's --max-body-bytes


def test_a_plain_hop_head_is_taken_and_anything_else_is_not() -> None:
    plain = b"POST /v1/hop HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\nX-Omni-Hop-Token: ab"
    hop = parse_hop_head(plain)
    assert hop is not None and (hop.length, hop.token, hop.close) == (12, "ab", False)
    closing = parse_hop_head(plain + b"\r\nConnection: close")
    assert closing is not None and closing.close
    for other in (
        b"GET /v1/hop HTTP/1.1\r\nContent-Length: 0",
        b"POST /v1/hop?x=1 HTTP/1.1\r\nContent-Length: 0",
        b"POST /v1/hop HTTP/1.0\r\nContent-Length: 0",
        b"POST /v1/run HTTP/1.1\r\nContent-Length: 0",
        b"POST /v1/hop HTTP/1.1\r\nHost: x",  # no Content-Length
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: -1",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: 0\r\nTransfer-Encoding: chunked",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: 3\r\nContent-Encoding: gzip",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: 3\r\nno colon here",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length : 3",
        b"POST /v1/hop HTTP/1.1\r\nContent-Length: 3\r\n folded",
    ):
        assert parse_hop_head(other) is None, other


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Topology, str]]:
    log_dir: Path = tmp_path_factory.mktemp("hop-server")
    slow = json.dumps({"2": {"step_latency_ms": STEP_MS}})
    topo = Topology(
        "synthetic",
        [0, 0, 1],
        log_dir,
        api=False,
        extra_stage_args=["--stage-overrides", slow, "--max-body-bytes", str(BODY_LIMIT)],
    ).start(stages=[2])
    try:
        yield topo, topo.urls[2][0]
    finally:
        topo.close()


def _body(request_id: str, seed: int = 1) -> bytes:
    raw = np.full(64, seed % 251, dtype=np.uint8).tobytes()
    si = StageInput(
        pipeline="synthetic", request_id=request_id, stage_id=2, from_stage=1,
        deadline_ms=int((time.time() + 60) * 1000), seed=seed,
        payload=Payload(
            fields={"prompt": "x"},
            tensors={"data": Tensor(dtype="uint8", shape=(64,), data=memoryview(raw))},
        ),
    )  # fmt: skip
    return codec.encode(si)


def _hop(body: bytes, *, token: str = TOKEN, extra: str = "") -> bytes:
    head = (
        "POST /v1/hop HTTP/1.1\r\nHost: pod\r\nContent-Type: application/msgpack\r\n"
        f"X-Omni-Hop-Token: {token}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=20)
    sock.settimeout(20)
    return sock


class _Answers:
    """HTTP/1.1 answers read off one socket, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")

    def next(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self.file.readline().split()[1])
        headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self.file.readline(), 16):
                body += self.file.read(size)
                self.file.readline()
            self.file.readline()
        else:
            body = self.file.read(int(headers.get("content-length", "0")))
        return status, headers, body

    def closed(self) -> bool:
        return self.file.read(1) == b""


def _result(body: bytes, request_id: str) -> HopResult:
    result = codec.decode(body, HopResult)
    assert result.error is None and result.request_id == request_id
    assert set(result.outputs) == {2}
    return result


def test_hops_and_other_requests_share_a_connection(stage: tuple[Topology, str]) -> None:
    _, url = stage
    with _connect(url) as sock:
        answers = _Answers(sock)
        sock.sendall(_hop(_body("lean-1")))
        status, headers, body = answers.next()
        assert status == 200 and headers["content-type"] == "application/msgpack"
        assert "server" not in headers  # the lean server answered, not aiohttp
        _result(body, "lean-1")
        # Another route on the same connection: handed to aiohttp, which answers it…
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pod\r\n\r\n")
        status, headers, body = answers.next()
        assert status == 200 and "aiohttp" in headers["server"]
        assert json.loads(body)["status"] == "ok"
        # … and every later request of the connection, hops included.
        sock.sendall(_hop(_body("lean-2", 2)))
        status, headers, body = answers.next()
        assert status == 200 and "aiohttp" in headers["server"]
        assert _result(body, "lean-2").outputs == _result(_solo("lean-2", url, 2), "lean-2").outputs


def _solo(request_id: str, url: str, seed: int) -> bytes:
    with _connect(url) as sock:
        sock.sendall(_hop(_body(request_id, seed)))
        status, _, body = _Answers(sock).next()
        assert status == 200
        return body


def test_pipelined_hops_are_answered_in_order(stage: tuple[Topology, str]) -> None:
    _, url = stage
    with _connect(url) as sock:
        answers = _Answers(sock)
        sock.sendall(b"".join(_hop(_body(f"piped-{i}", i)) for i in range(3)))
        for i in range(3):
            status, headers, body = answers.next()
            assert status == 200 and "server" not in headers
            _result(body, f"piped-{i}")


def test_a_body_in_pieces_is_read_whole(stage: tuple[Topology, str]) -> None:
    _, url = stage
    data = _hop(_body("pieces"))
    with _connect(url) as sock:
        for cut in (10, 60, 120, len(data)):  # mid request line, mid head, mid body
            sock.sendall(data[:cut])
            data = data[cut:]
            time.sleep(0.02)
        status, _, body = _Answers(sock).next()
        assert status == 200
        _result(body, "pieces")


def test_a_chunked_hop_is_answered_by_aiohttp(stage: tuple[Topology, str]) -> None:
    _, url = stage
    body = _body("chunked")
    head = (
        "POST /v1/hop HTTP/1.1\r\nHost: pod\r\nContent-Type: application/msgpack\r\n"
        f"X-Omni-Hop-Token: {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with _connect(url) as sock:
        sock.sendall(head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        status, headers, answer = _Answers(sock).next()
        assert status == 200 and "aiohttp" in headers["server"]
        _result(answer, "chunked")


def test_bad_hops_get_the_errors_shape_and_close_the_connection(
    stage: tuple[Topology, str],
) -> None:
    _, url = stage
    big = b"\0" * (4 * BODY_LIMIT)  # more than the socket buffers hold
    cases = [
        (_hop(_body("forged"), token="0" * 64), 401, "X-Omni-Hop-Token"),
        # Refused on their heads; the bodies are read and dropped before the connection
        # closes, so the sender gets the answer, not a reset (a dead replica, to a hop client).
        (_hop(big, token="0" * 64), 401, "X-Omni-Hop-Token"),
        (_hop(big), 413, "limit"),
        # Over the limit, the body never sent: answered on its head (closed at the client's
        # end of the stream here, DISCARD_S at the latest).
        (_hop(b"").replace(b"Content-Length: 0", b"Content-Length: %d" % (1 << 30)), 413, "limit"),
    ]
    for request, status, needle in cases:
        with _connect(url) as sock:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            answers = _Answers(sock)
            got, headers, body = answers.next()
            assert got == status and headers["connection"] == "close"
            error = json.loads(body)["error"]
            assert error["code"] == status and needle in error["message"]
            assert answers.closed()
    # A body that is not a StageInput: 400 naming it; the connection stays usable.
    with _connect(url) as sock:
        answers = _Answers(sock)
        sock.sendall(_hop(msgspec.msgpack.encode({"pipeline": 3})))
        status, _, body = answers.next()
        assert status == 400 and "hop body" in json.loads(body)["error"]["message"]
        sock.sendall(_hop(_body("after-400")))
        assert answers.next()[0] == 200
    # A head that does not parse goes to aiohttp, which says what is wrong.
    with _connect(url) as sock:
        sock.sendall(b"POST /v1/hop HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        status, headers, _ = _Answers(sock).next()
        assert status == 400 and "aiohttp" in headers["server"]


def test_a_client_that_hangs_up_cancels_its_hop(stage: tuple[Topology, str]) -> None:
    topo, url = stage

    def cancelled() -> float:
        return topo.metric(url, "omni_stage_requests_total", route="hop", outcome="cancelled")

    before = cancelled()
    with _connect(url) as sock:
        sock.sendall(_hop(_body("hung-up")))
        wait_until(lambda: topo.metric(url, "omni_stage_in_flight") == 1, 10)
    wait_until(lambda: cancelled() == before + 1, 10)  # not answered: cancelled mid-step
    assert topo.metric(url, "omni_stage_in_flight") == 0
    _result(_solo("after-hang-up", url, 3), "after-hang-up")
