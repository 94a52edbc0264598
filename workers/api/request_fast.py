"""The usual request validated without pydantic: what ``protocol.parse_request`` tries first.

Every request is validated twice, by the gateway and by its worker, and in a sequential
request through the gateway each runs with its caches cold (the client's and the other
process's turns came between): pydantic's validation there cost several times what the same
call costs warm, a visible share of the gateway's added latency (docs/relay-overhead.md).

The bodies clients and the gateway send are nearly all alike: a completion with a text prompt
or a chat of text messages, a few sampling fields, and the gateway's directive. Those are
checked here field by field, with the limits ``workers/api/schema.py`` declares and pydantic's
strict rules (no bool for a number, an int for a float is the float). Anything else (another
field, another type, a value out of range, a prompt of token ids, content parts, a resume)
returns None and goes to pydantic, which decides as before and words the error. So this path
only accepts what pydantic accepts, and builds what it builds: tests/unit/test_request_fast.py
holds the two to the same answers over generated bodies.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args

from policies.methods import is_method
from policies.tree import TreeShapeError, parse_shape
from workers.api.schema import (
    MAX_COALESCE_S,
    MAX_DIRECTIVE_COUNT,
    MAX_DIRECTIVE_K,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    MAX_TREE_TEXT,
    Directive,
    Message,
    StreamOptions,
)
from workers.api.wire import cache_salt_problem

_SEED = 1 << 63
# The models' own declarations: the roles a message may have, a directive's defaults.
_ROLES = frozenset(get_args(Message.model_fields["role"].annotation))
_DIRECTIVE_DEFAULTS = {name: field.default for name, field in Directive.model_fields.items()}
_STREAM_OPTIONS = frozenset(StreamOptions.model_fields)


class _Refused(Exception):
    """Not the usual shape: pydantic decides."""


def _int(value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _Refused
    return value


def _float(value: Any, low: float, high: float, low_open: bool = False) -> float:
    # pydantic's strict float takes an int (as the float) but never a bool; NaN fails the range.
    if type(value) is not float and type(value) is not int:
        raise _Refused
    if not (low < value <= high if low_open else low <= value <= high):
        raise _Refused
    return float(value)


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _Refused
    return value


def _text(value: Any, min_length: int = 0) -> str:
    if type(value) is not str or len(value) < min_length:
        raise _Refused
    return value


def _cache_salt(value: Any) -> str:
    if cache_salt_problem(value) is not None:  # None never comes here (absent fields are skipped)
        raise _Refused
    return str(value)


def _stop(value: Any) -> str | list[str]:
    if type(value) is list and len(value) <= MAX_STOP_SEQUENCES:
        return [_text(item, 1) for item in value]
    return _text(value, 1)


def _stream_options(value: Any) -> SimpleNamespace:
    if type(value) is not dict or not value.keys() <= _STREAM_OPTIONS:
        raise _Refused
    out = SimpleNamespace(**dict.fromkeys(_STREAM_OPTIONS))
    for key, v in value.items():
        setattr(out, key, None if v is None else _bool(v))
    return out


def _directive(value: Any) -> SimpleNamespace:
    if type(value) is not dict or "resume" in value:
        raise _Refused
    out = SimpleNamespace(**_DIRECTIVE_DEFAULTS)
    for key, v in value.items():
        if key == "k":
            out.k = _int(v, 0, MAX_DIRECTIVE_K)
        elif key in ("max_batch", "batch_resume"):
            setattr(out, key, _int(v, 1, MAX_DIRECTIVE_COUNT))
        elif key == "max_step_drafts":
            out.max_step_drafts = _int(v, 0, MAX_DIRECTIVE_COUNT)
        elif key in ("cost_rule", "whole_answer", "step_log"):
            setattr(out, key, _bool(v))
        elif key == "coalesce_s":
            out.coalesce_s = _float(v, 0, MAX_COALESCE_S)
        elif key == "tree":
            out.tree = _tree(v)
        elif key == "method":
            out.method = _method(v)
        else:
            raise _Refused
    if out.tree is not None and (parse_shape(out.tree).depth != out.k or out.method not in (None, "draft")):
        raise _Refused  # pydantic words the error
    return out


def _method(value: Any) -> str | None:
    if value is None or (type(value) is str and is_method(value)):
        return value
    raise _Refused


def _tree(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not str or len(value) > MAX_TREE_TEXT:
        raise _Refused
    try:
        parse_shape(value)
    except TreeShapeError:
        raise _Refused from None
    return value


def _message(value: Any) -> SimpleNamespace:
    if (type(value) is not dict or value.keys() != {"role", "content"} or type(value["role"]) is not str
            or value["role"] not in _ROLES):
        raise _Refused
    return SimpleNamespace(role=value["role"], content=_text(value["content"]))


_FIELDS: dict[str, Any] = {
    "max_tokens": lambda v: _int(v, 1, MAX_TOKENS_LIMIT),
    "max_completion_tokens": lambda v: _int(v, 1, MAX_TOKENS_LIMIT),
    "temperature": lambda v: _float(v, 0, MAX_TEMPERATURE),
    "top_p": lambda v: _float(v, 0, 1, low_open=True),
    "top_k": lambda v: _int(v, -1, MAX_TOP_K),
    "seed": lambda v: _int(v, -_SEED, _SEED - 1),
    "ignore_eos": _bool,
    "min_tokens": lambda v: _int(v, 0, MAX_TOKENS_LIMIT),
    "stop": _stop,
    "stream": _bool,
    "stream_options": _stream_options,
    "user": _text,
    "specgate": _directive,
    "cache_salt": _cache_salt,
}
# The fields each kind takes: model, its prompt or messages, and the optional ones above (the
# chat's max_completion_tokens is its own); an optional field absent is None, as in pydantic's model.
_COMPLETION_FIELDS = frozenset(("model", "prompt", *_FIELDS)) - {"max_completion_tokens"}
_CHAT_FIELDS = frozenset(("model", "messages", *_FIELDS))


def fast_body(kind: str, body: Any) -> SimpleNamespace | None:
    """The validated body, with the attributes parse_request reads from pydantic's model, or
    None when it is not the usual shape."""
    fields = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
    if type(body) is not dict or not body.keys() <= fields or (body.get("stream_options") and not body.get("stream")):
        return None
    out = SimpleNamespace(**dict.fromkeys(_FIELDS))
    try:
        out.model = _text(body["model"], 1)
        if kind == "chat":
            messages = body["messages"]
            if type(messages) is not list or not messages:
                return None
            out.messages = [_message(m) for m in messages]
        else:
            out.prompt = _text(body["prompt"])
        for key, value in body.items():
            check = _FIELDS.get(key)
            if check is not None and value is not None:
                setattr(out, key, check(value))
    except (_Refused, KeyError):
        return None
    return out
