"""A gateway choosing the speculation method per session in front of a sim worker: an agent or
code-editing session ends on a lookup method, an open-chat session on the draft model or plain
(the sim's acceptance per method and category: docs/sim.md, "Methods")."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.procs import get_json, start_gateway, start_sim_worker, stop

REQUESTS = 10  # a session settles within this many (two explorations, then the priced choice)


@pytest.fixture
def gateway_port(tmp_path: Path) -> Iterator[int]:
    """A fresh gateway and worker per test: no evidence from another test's sessions."""
    log_dir = tmp_path
    worker, worker_port = start_sim_worker(log_dir, {"time_scale": 0.02, "seed": 3}, default_k=5)
    gateway = None
    try:
        assert get_json(f"http://127.0.0.1:{worker_port}/specgate/worker")["methods"] == ["draft", "ngram", "suffix"]
        gateway, port = start_gateway(log_dir, [worker_port], {"num_speculative_tokens": "auto",
                                                               "methods": ["draft", "ngram", "suffix"]})
        yield port
    finally:
        if gateway is not None:
            stop(gateway)
        stop(worker)


def modes(port: int, session: str, category: str) -> list[str]:
    out = []
    for turn in range(REQUESTS):
        body = json.dumps({"model": "specgate-demo", "prompt": f"[{category}] turn {turn}: self return the None",
                           "max_tokens": 48, "temperature": 0, "seed": turn}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json", "X-Session-ID": session})
        with urllib.request.urlopen(request, timeout=30) as response:
            out.append(response.headers["X-Specgate-Mode"])
            assert json.loads(response.read())["usage"]["completion_tokens"] == 48
    return out


@pytest.mark.parametrize("category", ["agent", "code_edit"])
def test_a_session_that_repeats_its_context_ends_on_a_lookup_method(gateway_port: int, category: str) -> None:
    seen = modes(gateway_port, f"lookup-{category}", category)
    assert seen[-1].startswith("speculative; method=") and seen[-1].split(";")[1].strip() in (
        "method=ngram", "method=suffix"), seen
    assert sum("method=suffix" in m or "method=ngram" in m for m in seen[-3:]) == 3, seen


def test_an_open_chat_session_ends_on_the_draft_or_plain(gateway_port: int) -> None:
    seen = modes(gateway_port, "open-chat", "chat")
    assert seen[-1].startswith("plain") or "method=draft" in seen[-1], seen
    assert not any("method=ngram" in m or "method=suffix" in m for m in seen[-3:]), seen


def test_an_open_chat_session_after_lookup_sessions_ends_on_the_draft_or_plain(gateway_port: int) -> None:
    for category in ("agent", "code_edit"):
        modes(gateway_port, f"before-{category}", category)
    seen = modes(gateway_port, "open-chat-after", "chat")
    assert seen[-1].startswith("plain") or "method=draft" in seen[-1], seen
