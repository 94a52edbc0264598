"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's shapes: what a prompt is in this
model's tokens, and back. vLLM's bench client calls ``/tokenize`` first (to align its prompts);
the gateway forwards both to a worker, which has the tokenizer and the chat template.

Same request, same answer as vLLM's OpenAI server on the same model directory
(tests/e2e/vllm/test_vllm_conformance.py). Unknown fields are a 400, as everywhere in specgate;
a request's own ``chat_template`` is refused, as vLLM refuses it by default.
"""

from __future__ import annotations

from typing import Any, TypeVar

from aiohttp import web
from pydantic import ValidationError

from workers.api.errors import BadRequest, NotFound
from workers.api.request_parser import bad_request, chat_messages
from workers.api.schema import DetokenizeBody, TokenizeChatBody, TokenizeCompletionBody
from workers.api.web_common import read_json
from workers.server.context import CONTEXT_KEY, WorkerContext

FormT = TypeVar("FormT", TokenizeCompletionBody, TokenizeChatBody, DetokenizeBody)


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _parsed(ctx: WorkerContext, form: type[FormT], body: dict[str, Any]) -> FormT:
    """``body`` as ``form``, its model checked against this worker's."""
    try:
        parsed = form.model_validate(body)
    except ValidationError as exc:
        raise bad_request(exc) from None
    _check_model(ctx, parsed.model)
    return parsed


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    body = await _body(request)
    parsed: TokenizeChatBody | TokenizeCompletionBody = (
        _parsed(ctx, TokenizeChatBody, body) if "messages" in body else _parsed(ctx, TokenizeCompletionBody, body))
    codec = ctx.codec
    if isinstance(parsed, TokenizeChatBody):
        if parsed.add_generation_prompt and parsed.continue_final_message:
            raise BadRequest("add_generation_prompt and continue_final_message cannot both be true",
                             param="continue_final_message")
        messages = chat_messages(parsed.messages)
        try:
            text = codec.render_chat(messages, parsed.add_generation_prompt, parsed.continue_final_message)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from None
    else:
        text = parsed.prompt
    ids = codec.encode(text, add_special_tokens=parsed.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.engine.info.context_window, "tokens": ids,
                           "token_strs": codec.token_strs(ids) if parsed.return_token_strs else None}
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    parsed = _parsed(ctx, DetokenizeBody, await _body(request))
    vocab = ctx.engine.info.vocab_size
    if any(t >= vocab for t in parsed.tokens):
        raise BadRequest(f"token ids must be below the vocabulary size {vocab}", param="tokens")
    return web.json_response({"prompt": ctx.codec.decode(parsed.tokens, skip_special_tokens=False)})


def _check_model(ctx: WorkerContext, model: str | None) -> None:
    if model is not None and model != ctx.settings.served_model_name:
        raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
