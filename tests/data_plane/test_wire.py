"""``wire.read_body`` / ``read_response`` against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import os
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from omni_mesh.data_plane.constants import MSGPACK
from omni_mesh.data_plane.wire import (
    ResponseTooLarge,
    read_body,
    read_response,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MiB = 1 << 20
BIG = 16 * MiB
SMALL_LIMIT = MiB


async def _digest(request: web.Request, limit: int) -> web.Response:
    body = await read_body(request, max_bytes=limit)
    return web.json_response({"n": len(body), "sha": hashlib.sha256(body).hexdigest()})


async def big(request: web.Request) -> web.Response:
    return await _digest(request, 32 * MiB)


async def small(request: web.Request) -> web.Response:
    return await _digest(request, SMALL_LIMIT)


async def blob(request: web.Request) -> web.StreamResponse:
    n = int(request.query["n"])
    if "chunked" not in request.query:
        return web.Response(body=b"z" * n)
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for _ in range(n // 4096):
        await resp.write(b"z" * 4096)
    await resp.write_eof()
    return resp


@pytest.fixture
async def url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/big", big)
    app.router.add_post("/small", small)
    app.router.add_get("/blob", blob)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
        sock.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_reads_a_16_mib_body(url: str, session: aiohttp.ClientSession) -> None:
    data = os.urandom(BIG)
    headers = {"Content-Type": MSGPACK}
    # (io.BytesIO: aiohttp warns about raw bytes bodies over 1 MiB)
    async with session.post(f"{url}/big", data=io.BytesIO(data), headers=headers) as r:
        assert r.status == 200
        assert await r.json() == {"n": BIG, "sha": hashlib.sha256(data).hexdigest()}


async def test_over_the_limit_is_413_before_reading(
    url: str, session: aiohttp.ClientSession
) -> None:
    async with session.post(f"{url}/small", data=io.BytesIO(b"x" * (SMALL_LIMIT + 1))) as r:
        assert r.status == 413
        assert f"request body is {SMALL_LIMIT + 1} bytes, the limit is {SMALL_LIMIT}" in (
            await r.text()
        )


async def test_exactly_the_limit_is_fine(url: str, session: aiohttp.ClientSession) -> None:
    async with session.post(f"{url}/small", data=io.BytesIO(b"x" * SMALL_LIMIT)) as r:
        assert r.status == 200 and (await r.json())["n"] == SMALL_LIMIT


async def _chunks(total: int, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    for _ in range(total // size):
        yield b"c" * size


async def test_chunked_bodies_are_read_with_the_limit(
    url: str, session: aiohttp.ClientSession
) -> None:
    async with session.post(f"{url}/small", data=_chunks(SMALL_LIMIT // 2)) as r:
        assert r.status == 200 and (await r.json())["n"] == SMALL_LIMIT // 2
    async with session.post(f"{url}/small", data=_chunks(2 * SMALL_LIMIT)) as r:
        assert r.status == 413
        assert "at least" in await r.text()


async def test_a_compressed_body_is_bounded_after_inflating(
    url: str, session: aiohttp.ClientSession
) -> None:
    bomb = gzip.compress(bytes(4 * SMALL_LIMIT))
    assert len(bomb) < SMALL_LIMIT
    headers = {"Content-Encoding": "gzip"}
    async with session.post(f"{url}/small", data=bomb, headers=headers) as r:
        assert r.status == 413
    ok = gzip.compress(bytes(SMALL_LIMIT // 2))
    async with session.post(f"{url}/small", data=ok, headers=headers) as r:
        assert r.status == 200 and (await r.json())["n"] == SMALL_LIMIT // 2


async def _raw_request(url: str, head: str) -> str:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode())
        await writer.drain()
        return (await reader.read(4096)).decode(errors="replace")
    finally:
        writer.close()
        await writer.wait_closed()


async def test_msgpack_without_content_length_is_400(url: str) -> None:
    head = (
        f"POST /small HTTP/1.1\r\nHost: x\r\nContent-Type: {MSGPACK}\r\nConnection: close\r\n\r\n"
    )
    answer = await _raw_request(url, head)
    assert answer.startswith("HTTP/1.1 400")
    assert "needs a Content-Length" in answer


async def test_json_without_body_is_empty(url: str) -> None:
    head = "POST /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer = await _raw_request(url, head)
    assert answer.startswith("HTTP/1.1 200") and '"n": 0' in answer


async def test_invalid_content_length_is_400(url: str) -> None:
    head = "POST /small HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\nConnection: close\r\n\r\n"
    assert (await _raw_request(url, head)).split(" ", 2)[1] == "400"  # aiohttp's parser


@pytest.mark.parametrize("chunked", [False, True], ids=["sized", "chunked"])
async def test_read_response(url: str, session: aiohttp.ClientSession, chunked: bool) -> None:
    query = "&chunked=1" if chunked else ""
    async with session.get(f"{url}/blob?n={BIG}{query}") as r:
        body = await read_response(r, max_bytes=BIG)
    assert len(body) == BIG and body == b"z" * BIG
    async with session.get(f"{url}/blob?n={2 * SMALL_LIMIT}{query}") as r:
        with pytest.raises(ResponseTooLarge, match=f"the limit is {SMALL_LIMIT}"):
            await read_response(r, max_bytes=SMALL_LIMIT)
