"""``POST /tokenize`` and ``POST /detokenize`` at the server root, as vLLM's OpenAI server has
them: forwarded to a ready worker that tokenizes (a specgate worker, or a vLLM server), whose
answer is the client's. The gateway holds no tokenizer (workers/server/tokenize.py has the shapes).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.fleet.worker_http import WorkerConnectError, WorkerStreamError
from gateway.state import STATE_KEY
from workers.api.errors import BadRequest, NotFound, Unavailable, WorkerFailed
from workers.api.web_common import read_json

TOKENIZING_PROTOCOLS = ("specgate", "vllm")  # a plain OpenAI server has no /tokenize


async def tokenize(request: web.Request) -> web.Response:
    return await _forward(request, "/tokenize")


async def detokenize(request: web.Request) -> web.Response:
    return await _forward(request, "/detokenize")


async def _forward(request: web.Request, path: str) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.pop("model", None)
    if model is not None and model != state.config.model.name:
        raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    ready = [h for h in state.fleet.workers.values() if h.status == "ready" and h.protocol in TOKENIZING_PROTOCOLS]
    if not ready:
        raise Unavailable("no worker that tokenizes is ready", retry_after_s=1.0)
    handle = min(ready, key=lambda h: h.load)
    # The model's name is left out: a worker's (a remote vLLM server's) may differ from the gateway's.
    try:
        response = await handle.http.post(path, orjson.dumps(body), connect_timeout=5,
                                          read_timeout=state.config.server.worker_timeout_s)
        try:
            data = await response.read()
        finally:
            response.release()
    except (WorkerConnectError, WorkerStreamError, TimeoutError) as exc:
        raise WorkerFailed(f"worker {handle.worker_id} did not answer {path}: {exc.__class__.__name__}") from None
    return web.Response(body=data, status=response.status, content_type="application/json")
