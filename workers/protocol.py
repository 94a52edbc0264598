"""The wire protocol between clients, the gateway and workers. Imports no torch.

- The OpenAI request schema (``/v1/completions``, ``/v1/chat/completions``), parsed once into a
  frozen ``CompletionRequest``; a bad field raises ``BadRequest`` naming it.
- One error hierarchy: each ``ApiError`` carries its HTTP status and OpenAI error type, and
  says whether the client or a worker is at fault.
- The specgate extension fields: the gateway's ``specgate`` directive in a request (mode, K,
  batch thresholds) and the per-chunk ``specgate`` step report from a worker.
- ``assemble``: folds a stream of chunks into the non-streaming response object, so streaming
  and non-streaming answers are built from the same chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from workers.engine_api import SpecSteps

RequestKind = Literal["chat", "completion"]
MAX_STOP_SEQUENCES = 4
DIRECTIVE_FIELD = "specgate"
# Towards a vLLM server with specgate's scheduler plugin the directive travels in vLLM's own
# per-request extension field, under the plugin's names (workers/vllm_plugin/specgate_vllm/rules.py).
VLLM_XARGS_FIELD = "vllm_xargs"
VLLM_SPEC_K, VLLM_MAX_BATCH, VLLM_BATCH_RESUME = "spec_k", "spec_max_batch", "spec_batch_resume"


# -- errors -------------------------------------------------------------------------------------
class ApiError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    client_fault: ClassVar[bool] = False

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class BadRequest(ApiError):
    status, error_type, client_fault = 400, "invalid_request_error", True


class NotFound(ApiError):
    status, error_type, client_fault = 404, "invalid_request_error", True


class MethodNotAllowed(ApiError):
    status, error_type, client_fault = 405, "invalid_request_error", True


class PayloadTooLarge(ApiError):
    status, error_type, client_fault = 413, "invalid_request_error", True


class Overloaded(ApiError):
    """Too many requests queued: retry later (Retry-After says when)."""

    status, error_type, client_fault = 429, "rate_limit_error", False


class Unavailable(ApiError):
    """No worker can take the request now."""

    status, error_type, client_fault = 503, "server_error", False


class WorkerFailed(ApiError):
    status, error_type, client_fault = 502, "server_error", False


class WorkerTimeout(ApiError):
    status, error_type, client_fault = 504, "server_error", False


# -- requests -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Directive:
    """The gateway's decision for one request, carried to the worker in ``specgate``."""

    k: int  # drafts per step; 0 = plain
    max_batch: int  # the worker goes plain for a step while its batch depth is above this
    batch_resume: int  # ...until it falls below this
    max_step_drafts: int = 0  # drafts per step across the batch before K shrinks (0: no limit)

    def to_json(self) -> dict[str, int]:
        out = {"k": self.k, "max_batch": self.max_batch, "batch_resume": self.batch_resume}
        if self.max_step_drafts:
            out["max_step_drafts"] = self.max_step_drafts
        return out


def vllm_xargs(directive: Directive) -> dict[str, int]:
    return {VLLM_SPEC_K: directive.k, VLLM_MAX_BATCH: directive.max_batch, VLLM_BATCH_RESUME: directive.batch_resume}


@dataclass(frozen=True)
class CompletionRequest:
    kind: RequestKind
    model: str
    prompt: str | list[int] | None = None  # completions
    messages: tuple[ChatMessage, ...] = ()  # chat
    max_tokens: int | None = None  # None: up to the context window
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's name); 0 disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    directive: Directive | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {value!r}", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {value!r}", param=name)
    return value


def _text_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # the content-parts form: only text parts are supported
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest("only text content parts are supported", param=f"{param}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"'{param}' must be a string or a list of text parts", param=param)


def parse_request(kind: RequestKind, body: Any) -> CompletionRequest:
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] = []
    if kind == "completion":
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list) and len(raw_prompt) == 1 and isinstance(raw_prompt[0], str | list):
            raw_prompt = raw_prompt[0]  # a batch of one
        if isinstance(raw_prompt, str):
            prompt = raw_prompt
        elif isinstance(raw_prompt, list) and raw_prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw_prompt):
            prompt = list(raw_prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (batches of several prompts "
                             "are not supported)", param="prompt")
    else:
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        for i, message in enumerate(raw_messages):
            if not isinstance(message, Mapping):
                raise BadRequest("each message must be an object", param=f"messages[{i}]")
            role = message.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise BadRequest(f"unsupported role {role!r}", param=f"messages[{i}].role")
            messages.append(ChatMessage(role, _text_content(message.get("content"), f"messages[{i}].content")))
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 20) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 20)
    n = _integer(body, "n", 1, 1 << 20)
    if n is not None and n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    for unsupported in ("logprobs", "echo", "best_of", "tools", "functions", "logit_bias"):
        if body.get(unsupported) not in (None, False, 0, [], {}):
            raise BadRequest(f"'{unsupported}' is not supported", param=unsupported)
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _number(body, penalty, 0.0, -2.0, 2.0) != 0.0:
            raise BadRequest(f"'{penalty}' is not supported (must be 0)", param=penalty)
    stop_raw = body.get("stop")
    stop: tuple[str, ...] = ()
    if isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(stop_raw)
    elif stop_raw is not None:
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
        raise BadRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    return CompletionRequest(
        kind=kind, model=model, prompt=prompt, messages=tuple(messages), max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", -1, 1 << 20) or 0, seed=seed, stop=stop, stream=bool(stream),
        include_usage=bool(options and options.get("include_usage")), user=user,
        directive=_parse_directive(body.get(DIRECTIVE_FIELD)), raw=body)


def _parse_directive(raw: Any) -> Directive | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise BadRequest(f"'{DIRECTIVE_FIELD}' must be an object", param=DIRECTIVE_FIELD)
    k = _integer(raw, "k", 0, 64)
    max_batch = _integer(raw, "max_batch", 1, 1 << 20)
    batch_resume = _integer(raw, "batch_resume", 1, 1 << 20)
    return Directive(k or 0, max_batch or (1 << 20), batch_resume or (1 << 20),
                     _integer(raw, "max_step_drafts", 0, 1 << 20) or 0)


# -- responses ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepReport:
    """The per-chunk ``specgate`` field a worker attaches: what the step behind it did."""

    proposed: int  # drafts proposed in the step behind this chunk
    accepted: int  # drafts accepted
    batch_depth: int  # the worker's running sequences at that step
    k: int  # K used at that step (0: plain)
    tokens: int  # tokens the step emitted
    # Steps whose acceptance the engine learned late (vLLM reports it when a request ends):
    # ``count`` steps of ``proposed`` drafts with ``accepted`` accepted each.
    late_steps: tuple[SpecSteps, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"proposed": self.proposed, "accepted": self.accepted, "batch_depth": self.batch_depth,
                               "k": self.k, "tokens": self.tokens}
        if self.late_steps:
            out["late_steps"] = [[g.proposed, g.accepted, g.count] for g in self.late_steps]
        return out

    @classmethod
    def from_json(cls, raw: Any) -> StepReport | None:
        if not isinstance(raw, Mapping):
            return None
        try:
            late = tuple(SpecSteps(int(p), int(a), int(c)) for p, a, c in raw.get("late_steps") or ())
            return cls(int(raw["proposed"]), int(raw["accepted"]), int(raw["batch_depth"]), int(raw["k"]),
                       int(raw["tokens"]), late)
        except (KeyError, TypeError, ValueError):
            return None


def vllm_step_report(chunk: Mapping[str, Any], k: int) -> StepReport | None:
    """A vLLM server's final usage chunk as a step report: its per-request speculative metrics
    (``--per-request-spec-decode-metrics``), whose histogram counts steps by drafts accepted."""
    metrics = chunk.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, Mapping) else None
    if not isinstance(spec, Mapping):
        return None
    groups: dict[tuple[int, int], int] = {}
    drafted, accepted = spec.get("per_step_drafted"), spec.get("per_step_accepted")
    try:
        if isinstance(drafted, list) and isinstance(accepted, list):
            for d, a in zip(drafted, accepted, strict=False):
                if int(d) > 0:
                    groups[(int(d), int(a))] = groups.get((int(d), int(a)), 0) + 1
        else:
            # Summary level: every speculative step of a request drafted min(K, engine K).
            step_k = min(k, int(spec.get("num_spec_tokens", k)))
            for j, count in enumerate(spec.get("acceptance_histogram") or []):
                if int(count) > 0 and step_k > 0:
                    groups[(step_k, min(j, step_k))] = groups.get((step_k, min(j, step_k)), 0) + int(count)
    except (TypeError, ValueError):
        return None
    late = tuple(SpecSteps(d, a, c) for (d, a), c in sorted(groups.items()))
    return StepReport(0, 0, 0, 0, 0, late)


def speculative_usage(proposed: int, accepted: int, mode: str) -> dict[str, Any]:
    return {"proposed": proposed, "accepted": accepted,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None, "mode": mode}


def chunk_text(kind: RequestKind, chunk: Mapping[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if kind == "chat":
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def assemble(kind: RequestKind, chunks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Folds streamed chunks into the non-streaming response object."""
    if not chunks:
        raise WorkerFailed("worker returned no output")
    first = chunks[0]
    text = "".join(chunk_text(kind, c) for c in chunks)
    finish_reason = None
    usage = None
    for chunk in chunks:
        for streamed in chunk.get("choices") or []:
            finish_reason = streamed.get("finish_reason") or finish_reason
        usage = chunk.get("usage") or usage
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": first.get("id"), "object": obj, "created": first.get("created"), "model": first.get("model"),
            "choices": [choice], "usage": usage}
