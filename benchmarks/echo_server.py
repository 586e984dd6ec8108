"""The physical limit of a hop: a bare aiohttp server on uvloop that reads the POST body and
answers a fixed body of ``--response-bytes`` bytes. Run as its own process:

    python -m benchmarks.echo_server --port P --response-bytes N
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import uvloop
from aiohttp import web


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--response-bytes", type=int, default=256)
    args = p.parse_args(argv)
    answer = b"x" * args.response_bytes

    async def echo(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/msgpack")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/echo", echo)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"echo server on 127.0.0.1:{args.port}", flush=True)
        await stop.wait()
        await runner.cleanup()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
