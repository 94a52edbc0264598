"""Limits on what input may do: JSON depth, request-body time, sampling values. Imports no torch.

Each limit turns an input that would otherwise cost a 500, a stall or a poisoned batch into
a clear client error. The HTTP layers (gateway and worker) use the JSON and body limits; the
engine checks sampling parameters itself as well, so no caller can hand a kernel a value it
cannot handle (a NaN distribution fails every sequence sampled in the same call).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # the engine's type; importing it here would pull torch into the gateway
    from workers.api.generation import SamplingParams


def physical_memory_mb() -> float:
    """This machine's physical memory, in MiB: the most a local worker's prefix cache may hold
    (``workers.prefix_cache_mb``, checked by the gateway's config and by the worker at start)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)


def prefix_cache_problem(megabytes: float) -> str | None:
    """Why a prefix cache bound is refused, or None."""
    if not math.isfinite(megabytes) or megabytes < 0:
        return "must be a number >= 0 (0: no prefix reuse)"
    physical = physical_memory_mb()
    if megabytes > physical:
        return f"is more than this machine's physical memory ({physical:.0f} MiB)"
    return None


MAX_JSON_DEPTH = 64  # an OpenAI request nests 5 levels (messages[i].content[j].text)
DEFAULT_BODY_TIMEOUT_S = 30.0  # a body not fully received by then gets a 408
# Temperatures below this decode greedily, as in vLLM: logits divided by less overflow float32
# to inf, and softmax turns that into NaN.
GREEDY_BELOW = 1e-5
# top_p below this keeps the top token alone, as any smaller positive top_p does (the top token's
# probability is at least 1/V >= 1e-6). Smaller values round to 0 in float32, which keeps nothing
# and samples from NaN, so they are raised to this.
MIN_TOP_P = 1e-6


class InputRefused(ValueError):
    """The input breaks a limit; the message says which (HTTP layers answer 400), ``param``
    the field where one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _refuse_constant(name: str) -> Any:
    raise InputRefused(f"{name} is not valid JSON")


# One decoder for every body: json.loads with an argument builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


# A run of 19 digits may be an integer beyond 64 bits, which orjson reads as a float where the
# standard parser keeps it exact (a seed or token id out of range must be refused, not rounded).
_LONG_DIGITS = re.compile(rb"\d{19}")


def loads_json(raw: bytes) -> Any:
    """Parses a request body: UTF-8 JSON, no NaN/Infinity, nested at most MAX_JSON_DEPTH deep.

    orjson first, since every request pays this twice (gateway and worker). Whatever orjson
    refuses (a byte order mark, UTF-16, a lone surrogate, NaN, a number that overflows to
    inf, invalid UTF-8) and bodies with long digit runs go to the standard parser, which
    decides as before (tests/unit/test_hot_path_parsing.py holds the two to the same answers).
    """
    # Fewer brackets than the limit cannot nest deeper than it (in any encoding, every "[" and
    # "{" holds its byte): the usual request skips the walk, which cost more than its parse.
    shallow = isinstance(raw, bytes | bytearray) and raw.count(b"[") + raw.count(b"{") < MAX_JSON_DEPTH
    if isinstance(raw, bytes) and _LONG_DIGITS.search(raw) is None:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if not shallow and not _depth_within(value, MAX_JSON_DEPTH):
                raise InputRefused(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
            return value
    try:
        # Decoded as json.loads decodes bytes (its encoding detection, BOM included).
        text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes | bytearray) else raw
        value = _DECODER.decode(text)
    except RecursionError:  # the C scanner recurses per level: thousands of levels end here
        raise InputRefused(f"JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    except UnicodeDecodeError:
        raise InputRefused("request body is not valid UTF-8") from None
    except ValueError as exc:  # JSONDecodeError, and integers of more than 4300 digits
        raise InputRefused(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not shallow and not _depth_within(value, MAX_JSON_DEPTH):
        raise InputRefused(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
    # Escapes of lone surrogates ("\ud800") parse, but are no text: a tokenizer cannot take
    # them. Only bodies orjson refused can hold one (it refuses them all). Other fields (a
    # ``user`` that keys a session) may hold them, as JSON allows.
    where = _lone_surrogate({k: v for k, v in value.items() if k in TOKENIZED_FIELDS}) if type(value) is dict else None
    if where is not None:
        raise InputRefused(f"{where or 'the body'} holds a lone surrogate escape (such as \\ud800): "
                           "not valid Unicode text", param=where or None)
    return value


# The request fields whose text reaches a tokenizer.
TOKENIZED_FIELDS = frozenset({"prompt", "messages", "stop", "suffix"})


def _lone_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key holding a lone surrogate;
    None when there is none. Iterative, like ``_depth_within``."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if type(item) is str:
            if not _encodable(item):
                return path
        elif type(item) is dict:
            for key, child in item.items():
                if not _encodable(key):
                    return f"{path}.{key!a}" if path else repr(key)
                stack.append((child, f"{path}.{key}" if path else key))
        elif type(item) is list:
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_CONTAINERS = (dict, list)  # what json.loads builds (exactly these types)


def _depth_within(value: Any, limit: int) -> bool:
    """Iterative (a recursive walk is what the limit protects against); a comprehension skims
    long scalar lists (a prompt of token ids) at C speed."""
    stack: list[tuple[Any, int]] = [(value, 1)] if type(value) in _CONTAINERS else []
    while stack:
        item, depth = stack.pop()
        nested = [c for c in (item.values() if type(item) is dict else item) if type(c) in _CONTAINERS]
        if nested and depth >= limit:
            return False
        stack.extend((child, depth + 1) for child in nested)
    return True


def check_sampling(params: SamplingParams) -> SamplingParams:
    """Raises ValueError for sampling values no kernel should see; makes tiny temperatures greedy.

    The API layer refuses these first (workers/api/schema.py); this is the engine's own guard,
    whoever its caller is.
    """
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise InputRefused(f"temperature must be a finite number >= 0, got {params.temperature!r}")
    if not 0 < params.top_p <= 1:  # also false for NaN
        raise InputRefused(f"top_p must be in (0, 1], got {params.top_p!r}")
    if params.top_k < -1:
        raise InputRefused(f"top_k must be -1, 0 or positive, got {params.top_k!r}")
    if 0 < params.temperature < GREEDY_BELOW:
        params = replace(params, temperature=0.0)
    if params.top_p < MIN_TOP_P:
        params = replace(params, top_p=MIN_TOP_P)
    return params
