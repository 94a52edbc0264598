"""workers/api/request_fast.py: the usual body validated without pydantic accepts only what
pydantic accepts and builds the same request; the bodies clients and the gateway send take it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import workers.api.request_parser
from workers.api.errors import ApiError
from workers.api.request_fast import fast_body
from workers.api.request_parser import parse_request
from workers.api.wire import CompletionRequest

# Values near every limit, of every JSON type, for any field.
EDGES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 64, 65, 1 << 20, (1 << 20) + 1, 1 << 63, (1 << 63) - 1, -(1 << 63),
    -(1 << 63) - 1, 0.0, 1e-6, 0.5, 1.0, 2.0, 2.0000001, -0.0, 60.0, 60.5, 1e308, float("nan"), float("inf"),
    "", "x", "[chat] hello there", "developer", "user", "assistant", "system", "tool", [], ["a"], ["", "b"],
    ["a"] * 5, [1, 2], [[1]], {}, {"include_usage": True}, {"include_usage": 1}, {"include_obfuscation": False},
    {"include_usage": None}, {"other": 1}, {"k": 4, "max_batch": 64, "batch_resume": 48},
    {"k": 65}, {"k": 0, "coalesce_s": 0.05, "whole_answer": True, "cost_rule": True, "max_step_drafts": 8},
    {"k": 1, "resume": {"prompt_ids": [1], "output_ids": []}}, {"k": True}, {"coalesce_s": 61}, {"k": None},
    {"k": 5, "tree": "2x2+3"}, {"k": 4, "tree": "2x2+3"}, {"k": 1, "tree": "9"}, {"k": 1, "tree": 3},
    {"k": 0, "tree": None}, {"k": 1, "tree": "+1"}, {"k": 1, "tree": "2" * 50},
    {"k": 6, "method": "ngram"}, {"k": 6, "method": "eagle"}, {"k": 2, "tree": "2+1", "method": "suffix"},
    {"k": 2, "tree": "2+1", "method": "draft"}, {"method": None}, {"method": 1},
    {"role": "user", "content": "hi"}, [{"role": "user", "content": "hi"}],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user"}],
    [{"role": "robot", "content": "hi"}], [{"role": ["user"], "content": "hi"}],
    [{"role": "user", "content": "hi", "name": "n"}],
]
# Values each field takes in the usual bodies, so that generated bodies are often wholly valid.
VALID: dict[str, list[Any]] = {
    "model": ["specgate-demo"], "prompt": ["p", ""], "max_tokens": [1, 4, 1 << 20],
    "max_completion_tokens": [1, 8], "temperature": [0, 0.0, 0.7, 1, 1.0, 2], "top_p": [0.5, 1, 1.0],
    "top_k": [-1, 0, 40], "seed": [0, 7, -(1 << 63)], "stop": ["\n", ["a", "b"], []], "stream": [True, False],
    "stream_options": [{"include_usage": True}, {}, {"include_usage": None, "include_obfuscation": True}],
    "user": ["u", ""], "messages": [[{"role": "user", "content": "hi"}]],
    "specgate": [{"k": 4, "max_batch": 64, "batch_resume": 48}, {"k": 0, "coalesce_s": 0.05, "whole_answer": True},
                 {"cost_rule": True, "max_step_drafts": 8}, {}, {"k": 4, "tree": "2+3", "cost_rule": True},
                 {"k": 6, "method": "ngram"}, {"k": 6, "method": "suffix"}, {"k": 4, "method": "draft"}],
}


_COMMON = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user",
           "specgate"]


def _valid(required: dict[str, str], optional: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({key: st.sampled_from(VALID[name]) for key, name in required.items()},
                                 optional={name: st.sampled_from(VALID[name]) for name in optional})


# (kind, a valid body of that kind): completions with a text prompt, chats of text messages.
KIND_BODY = st.one_of(
    st.tuples(st.just("completion"), _valid({"model": "model", "prompt": "prompt"}, _COMMON)),
    st.tuples(st.just("chat"), _valid({"model": "model", "messages": "messages"}, [*_COMMON, "max_completion_tokens"])),
)
_M = 1 << 20
# Each field's values on either side of its limits (workers/api/schema.py).
BOUNDARY: dict[str, list[Any]] = {
    "model": ["", "m"], "prompt": ["", "p"], "max_tokens": [0, 1, _M, _M + 1], "max_completion_tokens": [0, 1, _M + 1],
    "temperature": [-1e-9, 0, 2, 2.0000001, 3], "top_p": [0, 0.0, 1e-9, 1, 1.0000001], "top_k": [-2, -1, _M, _M + 1],
    "seed": [-(1 << 63) - 1, -(1 << 63), (1 << 63) - 1, 1 << 63], "stop": ["", [""], ["a"] * 4, ["a"] * 5],
    "stream": [0, 1], "stream_options": [{"include_usage": 0}, {"include_obfuscation": 1}, {"x": True}],
    "user": [1], "messages": [[], [{"role": "user", "content": 1}], [{"role": "developer", "content": ""}]],
    "specgate": [{"k": 64}, {"k": 65}, {"k": -1}, {"k": 1.0}, {"max_batch": 0}, {"max_batch": _M},
                 {"max_batch": _M + 1}, {"batch_resume": 0}, {"batch_resume": _M + 1}, {"max_step_drafts": -1},
                 {"max_step_drafts": _M}, {"max_step_drafts": _M + 1}, {"coalesce_s": 60}, {"coalesce_s": 60.01},
                 {"coalesce_s": -1}, {"coalesce_s": 1}, {"whole_answer": 1}, {"cost_rule": 0}, {"other": 1},
                 {"method": "Ngram"}, {"method": ""}, {"method": ["ngram"]},
                 {"k": 3, "tree": "2+2", "method": "ngram"}],
}
# One field set to a value near its limits or to anything at all, or the body left alone.
CHANGE = st.one_of(st.none(), st.sampled_from(list(BOUNDARY)).flatmap(
    lambda name: st.tuples(st.just(name), st.one_of(st.sampled_from(BOUNDARY[name]), st.sampled_from(BOUNDARY[name]),
                                                    st.sampled_from(EDGES), st.integers(), st.floats()))),
    st.tuples(st.sampled_from(["n", "logprobs", "vllm_xargs", "extra", "echo"]), st.sampled_from(EDGES)))


def _pydantic_only(kind: str, body: Any, monkeypatch: pytest.MonkeyPatch) -> CompletionRequest | ApiError:
    with monkeypatch.context() as patch:
        patch.setattr(workers.api.request_parser, "fast_body", lambda kind, body: None)
        try:
            return parse_request(kind, body)  # type: ignore[arg-type]
        except ApiError as error:
            return error


def _fields(req: CompletionRequest) -> dict[str, Any]:
    values = {name: getattr(req, name) for name in CompletionRequest.__dataclass_fields__ if name != "raw"}
    return {name: (type(value), value) for name, value in values.items()}  # 1 and 1.0 are not the same here


@settings(max_examples=3000, deadline=None)
@given(kind_body=KIND_BODY, change=CHANGE)
def test_the_fast_path_accepts_only_what_pydantic_accepts_and_builds_the_same(
        kind_body: tuple[str, dict[str, Any]], change: tuple[str, Any] | None) -> None:
    kind, body = kind_body
    if change is not None:
        body = {**body, change[0]: change[1]}
    fast = fast_body(kind, body)
    with pytest.MonkeyPatch.context() as monkeypatch:
        reference = _pydantic_only(kind, body, monkeypatch)
    if fast is None:
        return  # pydantic decided, as before
    assert isinstance(reference, CompletionRequest), (body, reference)
    assert _fields(parse_request(kind, body)) == _fields(reference)  # type: ignore[arg-type]


BASES = {"completion": {"model": "m", "prompt": "p", "max_tokens": 4, "temperature": 1.0},
         "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}}


@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize(("name", "value"), [(name, value) for name, values in BOUNDARY.items() for value in values])
def test_every_limit_is_pydantics(kind: str, name: str, value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    body = {**BASES[kind], name: value}
    reference = _pydantic_only(kind, body, monkeypatch)
    if fast_body(kind, body) is None:
        return
    assert isinstance(reference, CompletionRequest), (body, reference)
    assert _fields(parse_request(kind, body)) == _fields(reference)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "body"), [
    ("completion", {"model": "specgate-demo", "prompt": "[chat] hello there", "max_tokens": 4, "temperature": 1.0}),
    ("completion", {"model": "m", "prompt": "p", "max_tokens": 16, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "seed": 7, "stop": ["\n\n"], "top_p": 0.9,
                    "user": "u"}),
    ("chat", {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hi"}], "max_completion_tokens": 8}),
    # What the gateway sends its workers: streamed, with usage, and its directive.
    ("completion", {"model": "m", "prompt": "p", "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True},
                    "specgate": {"k": 0, "max_batch": 64, "batch_resume": 56, "coalesce_s": 0.05,
                                 "whole_answer": True}}),
])
def test_the_usual_bodies_take_the_fast_path(kind: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert fast_body(kind, body) is not None
    reference = _pydantic_only(kind, body, monkeypatch)
    assert isinstance(reference, CompletionRequest)
    assert _fields(parse_request(kind, body)) == _fields(reference)  # type: ignore[arg-type]
