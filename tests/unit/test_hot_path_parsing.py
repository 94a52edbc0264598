"""The relay's fast paths decide as the general ones did: request JSON (orjson first, the
standard parser for what orjson refuses), the text log line, the per-request line written in
batches, and a coalesced chunk's reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from typing import Any

import pytest

from gateway.relay.migration import StreamIds
from workers.api import wire
from workers.api.limits import MAX_JSON_DEPTH, InputRefused, loads_json
from workers.api.logs import JsonFormatter, RequestLog, TextFormatter, decision_var, request_id_var, session_var
from workers.api.wire import StepReport


def _standard(raw: bytes) -> Any:
    return json.loads(raw.decode(json.detect_encoding(raw), "surrogatepass"))


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "x", "max_tokens": 4}',
    b'{"seed": 123456789012345678}',  # 18 digits: orjson's own path, exact
    b'{"seed": 1234567890123456789}',  # 19 digits: the standard parser decides (may exceed 64 bits)
    b'{"seed": 18446744073709551616}',
    b'{"seed": -9223372036854775809}',
    b'{"prompt": [123456789012345678901234567890]}',
    b'{"temperature": 0.30000000000000004, "top_p": 1e-7}',
    b'{"temperature": 1e400}',  # overflows to inf on the standard parser; the API refuses it later
    b'\xef\xbb\xbf{"model": "m"}',  # a byte order mark
    '{"model": "m"}'.encode("utf-16"),
    b'{"a": 1, "a": 2}',
    b'{"prompt": "\\u00e9\\n\\t\\"", "stop": ["\\u2028"]}',
    b'  [1, 2.5, true, null, "s"]\n',
])
def test_request_json_parses_as_the_standard_parser(raw: bytes) -> None:
    parsed = loads_json(raw)
    assert parsed == _standard(raw)
    assert json.dumps(parsed, sort_keys=True) == json.dumps(_standard(raw), sort_keys=True)  # ints stay ints


@pytest.mark.parametrize(("raw", "needle"), [
    (b"[" * MAX_JSON_DEPTH + b"[]" + b"]" * MAX_JSON_DEPTH, "nested"),  # short: orjson parses it
    (b"[" * 5000 + b"]" * 5000, "nested"),  # beyond orjson's own limit: the standard parser
    (b'{"top_p": NaN}', "NaN"),
    (b'{"top_p": -Infinity}', "Infinity"),
    (b'{"prompt": "\xff"}', "UTF-8"),
    (b'{"prompt": "x",}', "JSON"),
    (b"", "JSON"),
])
def test_request_json_refusals_are_unchanged(raw: bytes, needle: str) -> None:
    with pytest.raises(InputRefused, match=needle):
        loads_json(raw)


def test_depth_limit_holds_at_the_boundary() -> None:
    nested: Any = []
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = [nested]
    assert loads_json(json.dumps(nested).encode()) == nested
    with pytest.raises(InputRefused, match="nested"):
        loads_json(json.dumps([nested]).encode())


def _records() -> list[logging.LogRecord]:
    log = logging.getLogger("gateway.relay.relay")
    records = [log.makeRecord("gateway.relay.relay", logging.INFO, "", 0, "%s request on %s done in %.3f s",
                              ("completion", "sim-0", 0.00123), None),
               log.makeRecord("gateway.relay.relay", logging.WARNING, "", 0, "no args", (), None,
                              sinfo="Stack (most recent call last):\n  here")]
    try:
        raise ValueError("boom")
    except ValueError:
        records.append(log.makeRecord("gateway.fleet", logging.ERROR, "", 0, "failed: %r", ("x",), sys.exc_info()))
    later = log.makeRecord("gateway.relay.relay", logging.INFO, "", 0, "a second later", (), None)
    later.created, later.msecs = records[0].created + 1.0, 7.0
    return [*records, later, records[0]]


def test_text_log_lines_are_the_generic_formatters() -> None:
    generic = logging.Formatter("%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    fast = TextFormatter("gateway")
    for record in _records():
        expected = generic.format(record)
        record.exc_text = None  # each formatter renders the traceback itself
        assert fast.format(record) == expected


def test_later_step_reports_are_shared_and_exact() -> None:
    step = {"proposed": 0, "accepted": 0, "batch_depth": 3, "k": 0, "tokens": 1}
    raw = {"proposed": 4, "accepted": 2, "batch_depth": 3, "k": 4, "tokens": 3, "held_s": 0.01,
           "then": [step, dict(step), {**step, "proposed": 4, "accepted": 4, "k": 4, "tokens": 5},
                    {**step, "late_steps": [[4, 1, 2]]}, {"proposed": [1]}, "junk"]}
    report = StepReport.from_json(raw)
    assert report is not None
    first, second, third, late = report.then
    assert first is second  # equal reports, one object
    assert first == StepReport(0, 0, 3, 0, 1)
    assert third == StepReport(4, 4, 3, 4, 5)
    assert late.late_steps[0].count == 2
    again = StepReport.from_json(raw)
    assert again is not None and again.then == report.then and again.then[0] is first


def test_later_step_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "_LATER_STEPS", {})
    monkeypatch.setattr(wire, "_LATER_STEPS_MAX", 8)
    steps = [{"proposed": 0, "accepted": 0, "batch_depth": depth, "k": 0, "tokens": 1} for depth in range(20)]
    report = StepReport.from_json({"proposed": 0, "accepted": 0, "batch_depth": 1, "k": 0, "tokens": 1,
                                   "then": steps})
    assert report is not None and [s.batch_depth for s in report.then] == list(range(20))
    assert len(wire._LATER_STEPS) <= 8


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _request_logger(name: str) -> tuple[logging.Logger, _Collect]:
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = _Collect()
    logger.handlers[:] = [handler]
    return logger, handler


def test_request_lines_keep_their_time_and_request_context() -> None:
    logger, handler = _request_logger("test.request_log.context")
    request_log = RequestLog(logger)
    tokens = [var.set(value) for var, value in ((request_id_var, "r" * 32), (session_var, "s-1"),
                                                 (decision_var, "plain; reason=temperature"))]
    try:
        before = time.time()
        request_log.info("%s request on %s done in %.3f s", "completion", "worker-0", 0.25)
        after = time.time()
    finally:
        for var, token in zip((request_id_var, session_var, decision_var), tokens, strict=True):
            var.reset(token)
    assert handler.records == []  # nothing is written in the request
    time.sleep(0.01)
    request_log.flush()
    (record,) = handler.records
    assert before <= record.created <= after and record.msecs == int((record.created % 1) * 1000)
    assert record.getMessage() == "completion request on worker-0 done in 0.250 s"
    assert record.name == logger.name and record.levelno == logging.INFO
    # Formatted now, outside the request, the line still names it.
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["request_id"], entry["session"], entry["decision"]) == ("r" * 32, "s-1", "plain; reason=temperature")
    text = TextFormatter("gateway").format(record)
    assert text.startswith(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)))


def test_request_log_writes_the_rest_when_its_task_ends() -> None:
    logger, handler = _request_logger("test.request_log.task")
    request_log = RequestLog(logger, flush_s=30)

    async def scenario() -> None:
        task = asyncio.create_task(request_log.run())
        await asyncio.sleep(0)
        for i in range(3):
            request_log.info("line %d", i)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert [r.getMessage() for r in handler.records] == ["line 0", "line 1", "line 2"]


def test_request_log_flushes_on_its_period_and_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    logger, handler = _request_logger("test.request_log.period")
    request_log = RequestLog(logger, flush_s=0.01)

    async def scenario() -> None:
        task = asyncio.create_task(request_log.run())
        request_log.info("soon")
        await asyncio.sleep(0.1)
        assert [r.getMessage() for r in handler.records] == ["soon"]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    monkeypatch.setattr(RequestLog, "MAX_PENDING", 3)
    full = RequestLog(logger, flush_s=30)
    for i in range(3):
        full.info("full %d", i)
    assert [r.getMessage() for r in handler.records][-3:] == ["full 0", "full 1", "full 2"]  # no task needed


def test_request_log_keeps_nothing_below_its_level() -> None:
    logger, handler = _request_logger("test.request_log.level")
    logger.setLevel(logging.WARNING)
    request_log = RequestLog(logger)
    request_log.info("dropped")
    request_log.flush()
    assert handler.records == []


def test_bracket_count_only_skips_what_cannot_be_deep() -> None:
    shallow = {"prompt": "[" * (MAX_JSON_DEPTH * 2), "messages": [{"content": "{}"}]}  # brackets in text
    assert loads_json(json.dumps(shallow).encode()) == shallow
    deep: Any = "x"
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = {"a": deep}
    with pytest.raises(InputRefused, match="nested"):
        loads_json(json.dumps(deep).encode("utf-16"))  # the standard parser's path, counted in its bytes


def test_request_log_running_writes_the_rest_as_it_ends() -> None:
    logger, handler = _request_logger("test.request_log.running")
    request_log = RequestLog(logger, flush_s=30)

    async def scenario() -> None:
        async with request_log.running():
            request_log.info("inside %d", 1)
            await asyncio.sleep(0)
            assert handler.records == []  # a 30 s period: nothing written yet

    asyncio.run(scenario())
    assert [r.getMessage() for r in handler.records] == ["inside 1"]


def test_stream_ids_parse_only_when_asked_and_as_before() -> None:
    """A stream's token ids stay as the worker's bytes until a migration asks for them; then
    they are what parsing each event's ids comment as it came gave (gateway/relay/migration.py)."""
    ids = StreamIds()
    ids.add(b'{"token_ids":[5,6],"prompt_ids":[1,2,3]}', True)
    ids.add(None, False)  # a chunk without text or ids (usage): nothing to keep
    ids.add(b'{"token_ids":[7]}', True)
    ids.add(b'{"prompt_ids":[9]}', False)  # only the first prompt counts
    assert ids._pending and len(ids._pending) == 3  # nothing parsed yet
    assert ids.prompt == [1, 2, 3] and ids.output == [5, 6, 7] and ids.complete
    ids.add(b'{"token_ids":[8]}', True)  # parsed on the next ask, appended in order
    assert ids.output == [5, 6, 7, 8]
    for broken in (None, b"{not json", b"[1]", b'{"token_ids": "x"}'):
        gapped = StreamIds()
        gapped.add(b'{"token_ids":[5],"prompt_ids":[1]}', True)
        gapped.add(broken, True)  # text whose ids are missing or unreadable: cannot resume
        assert gapped.output == [5] and gapped.prompt == [1] and not gapped.complete


@pytest.mark.parametrize(("raw", "where"), [
    (b'{"prompt": "x\\ud800y"}', "prompt"),  # a lone surrogate: valid JSON, no text
    (b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[0].content[0].text"),
    (b'{"stop": ["a", "\\ud800\\ud800"]}', "stop[1]"),
])
def test_lone_surrogates_are_refused_naming_the_field(raw: bytes, where: str) -> None:
    with pytest.raises(InputRefused, match="lone surrogate") as info:
        loads_json(raw)
    assert info.value.param == where
    assert loads_json(b'{"prompt": "x\\ud83d\\ude00y"}') == {"prompt": "x\U0001f600y"}  # a pair is a character
    assert loads_json(b'{"user": "x\\ud800y"}') == {"user": "x\ud800y"}  # no tokenizer reads a user: kept
