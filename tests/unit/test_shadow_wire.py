"""Shadow evidence on the worker-to-gateway wire (``StepReport.shadow``): written, read back,
inside a coalesced chunk, and what a malformed one reads as."""

from __future__ import annotations

import orjson

from workers.api.generation import ShadowSteps, SpecSteps, step_runs
from workers.api.wire import StepReport, shadow_of


def test_steps_travel_as_runs_in_order() -> None:
    steps = [(0, 0), (0, 0), (4, 4), (4, 1), (4, 1), (0, 0)]
    shadow = shadow_of("suffix", steps)
    assert shadow.runs == (SpecSteps(0, 0, 2), SpecSteps(4, 4, 1), SpecSteps(4, 1, 2), SpecSteps(0, 0, 1))
    assert list(shadow.steps()) == steps
    counts = shadow.counts()
    assert (counts.steps, counts.proposed, counts.accepted, counts.tested, counts.speculative_steps) == (6, 12, 6, 8, 3)
    assert step_runs([]) == ()


def test_a_report_carries_its_shadow_there_and_back() -> None:
    report = StepReport(0, 0, 1, 0, 1, shadow=(shadow_of("ngram", [(0, 0), (3, 2)]), shadow_of("suffix", [(0, 0)])))
    raw = orjson.loads(orjson.dumps(report.to_json()))
    assert raw["shadow"] == {"ngram": [[0, 0, 1], [3, 2, 1]], "suffix": [[0, 0, 1]]}
    assert StepReport.from_json(raw) == report
    coalesced = StepReport.from_json({**StepReport(2, 1, 1, 2, 2).to_json(), "then": [raw]})
    assert coalesced is not None and coalesced.steps()[-1].shadow == report.shadow


def test_an_unknown_method_or_a_malformed_run_is_left_out() -> None:
    raw = {**StepReport(0, 0, 1, 0, 1).to_json(),
           "shadow": {"draft": [[1, 1, 1]], "bogus": [[1, 1, 1]], "ngram": [["x", 0, 1]], "suffix": [[2, 1, 3]]}}
    report = StepReport.from_json(raw)
    assert report is not None and report.shadow == (ShadowSteps("suffix", (SpecSteps(2, 1, 3),)),)


def test_a_stored_session_keeps_its_shadow_steps_and_an_older_one_has_none() -> None:
    from collections import deque

    from gateway.sessions.store import dump_session, parse_session
    from gateway.sessions.table import Session
    from policies import PolicyConfig
    from policies.speculation import observe_lookup

    session = Session("s", last_seen=1.0, history=deque(maxlen=4))
    state = observe_lookup(session.policy_state, "ngram", [(4, 3), (0, 0)], PolicyConfig())
    session.policy_state = observe_lookup(state, "suffix", [(4, 4)] * 3, PolicyConfig(), shadow=True)
    stored = orjson.loads(dump_session(session))
    # The 11th field: shadow steps; the 12th-14th: their drafts (proposed, accepted, tested), apart.
    assert [x[10:] for x in stored["methods"]["lookups"]] == [[0, 0, 0, 0], [3, 12, 12, 12]]
    assert [x[4:6] for x in stored["methods"]["lookups"]] == [[4, 3], [0, 0]]  # the drafts that ran
    assert parse_session(orjson.dumps(stored))[0].lookups == session.policy_state.lookups
    older = [x[:11] for x in stored["methods"]["lookups"]]  # as stored before the shadow drafts were apart
    stored["methods"]["lookups"] = older
    assert [x.shadow_steps for x in parse_session(orjson.dumps(stored))[0].lookups] == [0, 3]
    stored["methods"]["lookups"] = [x[:10] for x in older]  # as stored before shadow
    assert [x.shadow_steps for x in parse_session(orjson.dumps(stored))[0].lookups] == [0, 0]


def test_a_first_step_carries_what_the_prefix_cache_served() -> None:
    report = StepReport(0, 0, 1, 0, 1, cached=(300, 256))
    raw = orjson.loads(orjson.dumps(report.to_json()))
    assert raw["cached"] == [300, 256] and StepReport.from_json(raw) == report
    coalesced = StepReport.from_json({**raw, "then": [StepReport(0, 0, 1, 0, 1).to_json()]})
    assert coalesced is not None and coalesced.cached == (300, 256) and coalesced.then[0].cached is None
    assert "cached" not in StepReport(0, 0, 1, 0, 1).to_json()
    # Counts no worker could mean read as no report, and the step itself still reads.
    for bad in ([300, 301], [-1, 0], [300], "300", [300.0, 2], [True, 0], None):
        parsed = StepReport.from_json({**raw, "cached": bad})
        assert parsed is not None and parsed.cached is None, bad
