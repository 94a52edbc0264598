"""bench.methods' workload (bench/data/method_sessions.jsonl) and its pure helpers."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.methods import KINDS, copyable, interleaved, load_sessions
from bench.procs import method_of


def test_the_sessions_cover_every_kind_with_several_turns() -> None:
    sessions = load_sessions()
    assert len({s.id for s in sessions}) == len(sessions)
    counts = Counter(s.kind for s in sessions)
    assert set(counts) == set(KINDS) and min(counts.values()) >= 3
    assert all(len(s.turns) >= 3 and s.system for s in sessions)
    for session in sessions:
        first = session.turns[0]
        if session.kind == "code_edit":  # the answer repeats the function it is given
            assert "```python\n" in first and first.count("\n") >= 8
        if session.kind == "rag":  # one worked exchange quoting another passage, then the session's
            assert first.startswith("Passage:\n") and len(first) > 400
            roles = [role for role, _ in session.examples]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
            assert all(content.startswith('The passage says: "') for role, content in session.examples
                       if role == "assistant")
        else:
            assert session.examples == ()
        if session.kind == "agent":
            assert all("Tool output:\n{" in turn for turn in session.turns)


def test_the_kinds_take_turns() -> None:
    order = [s.kind for s in interleaved(load_sessions(), 2, 1)]
    assert order == [*KINDS, *KINDS]
    cut = interleaved(load_sessions(), None, 1)
    assert all(len(s.turns) == 1 for s in cut)
    assert all(s.examples for s in cut if s.kind == "rag")  # cutting turns keeps the worked exchange


@pytest.mark.parametrize(("header", "method"), [
    ("speculative; method=ngram; k=8; reason=default", "ngram"),
    ("speculative; method=suffix; k=4; reason=explore", "suffix"),
    ("speculative; k=6; reason=default", "draft"),
    ("speculative; tree=2x2+3; reason=default", "draft"),
    ("plain; reason=no_gain", "plain"),
])
def test_method_of_reads_the_mode_header(header: str, method: str) -> None:
    assert method_of(header) == method


@pytest.mark.parametrize(("context", "answer", "hits"), [
    ([1, 2, 3, 4, 5], [2, 3, 4, 5], 2),  # a quote: every token after its first two
    ([1, 2, 3, 4, 5], [9, 8, 7, 6], 0),  # nothing to copy
    ([1, 2, 3, 1, 2, 7], [1, 2, 7], 1),  # the most recent occurrence decides: (1, 2) -> 7, not 3
    ([1, 2, 3, 4, 5], [2, 3, 4, 9, 2, 3, 9], 1),  # the answer's own 2-grams count once said: (2, 3) -> 4 again
    ([], [5, 5, 5, 5], 1),  # the answer repeating itself: the 4th token follows (5, 5) as the 3rd did
])
def test_copyable_counts_what_a_prompt_lookup_would_propose_right(context: list[int], answer: list[int],
                                                                  hits: int) -> None:
    assert copyable(context, answer) == hits
