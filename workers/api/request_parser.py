"""The request parser: an OpenAI request body (``/v1/completions``, ``/v1/chat/completions``,
workers/api/schema.py) parsed once into a frozen ``CompletionRequest``; a bad field raises
``BadRequest`` naming it. Imports no torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from policies import bounded_repr, bounded_text
from workers.api.errors import BadRequest
from workers.api.limits import GREEDY_BELOW
from workers.api.request_fast import fast_body
from workers.api.schema import (
    DEFAULT_ONLY,
    FIELD_NAMES,
    MAX_STOP_SEQUENCES,
    ChatCompletionBody,
    CompletionBody,
)
from workers.api.wire import (
    CACHE_SALT_EMPTY,
    CACHE_SALT_FIELD,
    ChatMessage,
    CompletionRequest,
    Directive,
    RequestKind,
    ResumePoint,
    cache_salt_problem,
)

STREAM_OPTIONS_MESSAGE = "Stream options can only be defined when `stream=True`."  # vLLM's words, as OpenAI refuses it


def _path(loc: tuple[int | str, ...]) -> str:
    """An error location as the client wrote it: ``messages[0].content``."""
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else item)
    return out


def bad_request(exc: ValidationError) -> BadRequest:
    error = exc.errors(include_url=False, include_context=False)[0]
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":  # the unknown name last, after its fields (no union labels)
        kept = tuple(x for x in loc[:-1] if isinstance(x, int) or x in FIELD_NAMES)
        name = bounded_text(_path((*kept, loc[-1])), 100)
        return BadRequest(f"Unrecognized request argument supplied: {name}", param=name)
    # pydantic labels the member of a union in the location; the client's path ends before it.
    label = next((i for i, item in enumerate(loc) if isinstance(item, str) and item not in FIELD_NAMES), len(loc))
    names = [item for item in loc[:label] if isinstance(item, str)]
    param = _path(loc[:label])
    if names[:1] == [CACHE_SALT_FIELD]:  # vLLM's message, whatever the fault (type, length, a character)
        return BadRequest(cache_salt_problem(error["input"]) or CACHE_SALT_EMPTY, param=CACHE_SALT_FIELD)
    default_only = next((n for n in names if n in DEFAULT_ONLY), None)
    if default_only is not None:
        param = _path(loc[:loc.index(default_only) + 1])
        return BadRequest(f"'{param}' is not supported: only {DEFAULT_ONLY[default_only]} is accepted "
                          f"(got {bounded_repr(error['input'])})", param=param)
    if error["type"] == "missing":
        return BadRequest(f"'{param}' is required", param=param)
    if label < len(loc) and names and names[-1] in _UNION_SHAPES:
        return BadRequest(f"'{param}' must be {_UNION_SHAPES[names[-1]]}", param=param)
    return BadRequest(f"'{param}': {error['msg']} (got {bounded_repr(error['input'])})", param=param)


_UNION_SHAPES = {
    "prompt": "a string or a list of token ids (batches of several prompts are not supported)",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "stop": f"a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings",
}


def chat_messages(messages: Iterable[Any]) -> tuple[ChatMessage, ...]:
    """Validated messages as the chat template reads them: developer as system, text parts joined."""
    return tuple(ChatMessage("system" if m.role == "developer" else m.role,
                             m.content if isinstance(m.content, str) else "".join(p.text for p in m.content))
                 for m in messages)


def parse_request(kind: RequestKind, body: Any) -> CompletionRequest:
    """Validates a request body (see workers/api/schema.py) into a ``CompletionRequest``."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    if body.get("stream_options") and not body.get("stream"):  # vLLM's rule: {} and null pass
        raise BadRequest(STREAM_OPTIONS_MESSAGE, param="stream_options")
    # The usual body without pydantic (workers/api/request_fast.py); the rest, and every error, with it.
    parsed: Any = fast_body(kind, body)
    if parsed is None:
        try:
            parsed = ChatCompletionBody.model_validate(body) if kind == "chat" else CompletionBody.model_validate(body)
        except ValidationError as exc:
            raise bad_request(exc) from None
    prompt: str | list[int] | None = None
    messages: tuple[ChatMessage, ...] = ()
    max_tokens = parsed.max_tokens
    if kind != "chat":
        raw_prompt = parsed.prompt
        if isinstance(raw_prompt, list) and isinstance(raw_prompt[0], str | list):
            raw_prompt = raw_prompt[0]  # a batch of one
        prompt = raw_prompt if isinstance(raw_prompt, str) else list(raw_prompt)
    else:
        messages = chat_messages(parsed.messages)
        if parsed.max_completion_tokens is not None:
            max_tokens = parsed.max_completion_tokens
    stop = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    temperature = 1.0 if parsed.temperature is None else parsed.temperature
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    directive = parsed.specgate
    resume = None
    if directive is not None and directive.resume is not None:
        r = directive.resume
        resume = ResumePoint(tuple(r.prompt_ids), tuple(r.output_ids), r.text_sent)
    return CompletionRequest(
        kind=kind, model=parsed.model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        temperature=temperature, top_p=1.0 if parsed.top_p is None else parsed.top_p,
        top_k=max(0, parsed.top_k or 0), seed=parsed.seed, stop=stop, ignore_eos=bool(parsed.ignore_eos),
        min_tokens=parsed.min_tokens or 0, stream=bool(parsed.stream),
        include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage), user=parsed.user,
        directive=None if directive is None else Directive(directive.k, directive.max_batch, directive.batch_resume,
                                                       directive.max_step_drafts, resume, directive.cost_rule,
                                                       directive.coalesce_s, directive.whole_answer,
                                                       directive.step_log, directive.tree, directive.method),
        cache_salt=parsed.cache_salt, raw=body)
