"""Lookup methods on a real embedded worker process (the demo pair), driven with the gateway's
directive directly: ``"specgate": {"k": 6, "method": "ngram"}`` proposes from the context, its
steps report the proposals, and the text is the plain request's; a bad method is a 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import start_tcp_worker, worker_sse_events
from workers.api.wire import DIRECTIVE_FIELD, SESSION_HEADER, StepReport

# A prompt that repeats itself: the demo target continues the pattern, and lookup finds it.
CODE = "".join(f"def field_{i}(self):\n    return self._field_{i}\n\n" for i in range(10))
PROMPT = CODE + "def field_10(self):\n"
BODY = {"model": "specgate-demo", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, port = start_tcp_worker(tmp_path_factory.mktemp("lookup-worker"), "--max-slots", "4")
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=30)


def _post(url: str, body: dict[str, Any], session: str | None = None) -> str:
    headers = {"Content-Type": "application/json", **({SESSION_HEADER: session} if session else {})}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        raw: bytes = response.read()
        return raw.decode()


def _run(url: str, directive: dict[str, Any], session: str | None = None) -> tuple[str, list[int], list[StepReport],
                                                                                   dict[str, Any]]:
    """(text, token ids, step reports, usage) of one streamed request."""
    events = worker_sse_events(_post(url, {**BODY, "specgate": directive}, session))
    reports = [StepReport.from_json(chunk[DIRECTIVE_FIELD]) for chunk, _ in events if DIRECTIVE_FIELD in chunk]
    steps = [step for report in reports if report is not None for step in report.steps()]
    text = "".join(chunk["choices"][0]["text"] for chunk, _ in events if chunk["choices"])
    return text, [i for _, ids in events for i in ids], steps, events[-1][0]["usage"]


def test_the_worker_lists_its_methods(worker: str) -> None:
    with urllib.request.urlopen(worker + "/specgate/worker", timeout=10) as response:
        assert json.loads(response.read())["methods"] == ["draft", "ngram", "suffix"]


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_a_method_proposes_and_the_text_is_plains(worker: str, method: str) -> None:
    plain_text, plain_ids, plain_steps, _ = _run(worker, {"k": 0})
    assert plain_text and all(s.proposed == 0 for s in plain_steps)
    text, ids, steps, usage = _run(worker, {"k": 6, "method": method}, session=f"lookup-{method}")
    assert (text, ids) == (plain_text, plain_ids)
    spec = usage["speculative"]
    assert sum(s.proposed for s in steps) == spec["proposed"] > 0, (method, spec)
    assert sum(s.accepted for s in steps) == spec["accepted"] > 0, (method, spec)
    assert all(s.proposed <= 6 for s in steps)


@pytest.mark.parametrize(("directive", "message"), [
    ({"k": 6, "method": "eagle"}, "specgate.method"),
    ({"k": 6, "method": 3}, "specgate.method"),
    ({"k": 2, "tree": "2+1", "method": "ngram"}, "a token tree is drafted by the draft model, not ngram"),
])
def test_a_bad_method_is_a_400(worker: str, directive: dict[str, Any], message: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        # Not streamed, so without stream_options (which asks for a stream: a 400 of its own).
        _post(worker, {**{k: v for k, v in BODY.items() if k != "stream_options"}, "stream": False,
                       "specgate": directive})
    body = json.loads(info.value.read())
    assert info.value.code == 400 and message in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"
