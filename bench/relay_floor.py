"""The floor under the gateway's relay: aiohttp on uvloop passing requests through, nothing else.

    python -m bench.relay_floor --port P --upstream http://127.0.0.1:U

bench.overhead runs it as the path ``aiohttp_floor``, beside specgate and vllm-router, on the
same upstream in the same run. It has none of the gateway's work (no JSON parse, no session,
policy, metrics, logs or accounting): the request body goes to the upstream as it came, over
the gateway's own worker client (gateway/fleet/worker_http.py), and the upstream's body comes back
as it is read. What it adds to a request is what the gateway's architecture (aiohttp's server
on uvloop, one more loopback hop) costs on this machine before specgate does anything.
"""

from __future__ import annotations

import argparse

import uvloop
from aiohttp import web

from gateway.fleet.worker_http import Endpoint, WorkerHttp

UPSTREAM_KEY = web.AppKey("upstream", WorkerHttp)


async def _pass_through(request: web.Request) -> web.StreamResponse:
    upstream = await request.app[UPSTREAM_KEY].post(request.path, await request.read())
    content_type = upstream.headers.get("content-type", "application/json")
    if not content_type.startswith("text/event-stream"):
        body = await upstream.read()
        upstream.release()
        return web.Response(body=body, status=upstream.status, headers={"Content-Type": content_type})
    out = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
    await out.prepare(request)
    try:
        while data := await upstream.readany():
            await out.write(data)
    finally:
        upstream.release()
    await out.write_eof()
    return out


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def create_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM_KEY] = WorkerHttp(Endpoint.from_url(upstream))
    app.router.add_post("/{path:.*}", _pass_through)
    app.router.add_get("/health", _health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL")
    args = parser.parse_args()
    uvloop.install()
    web.run_app(create_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
