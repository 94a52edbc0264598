"""What a model server's answer tells the endpoint picker, read as Envoy streams it past.

Behind ``specgate serve`` the relay reads every worker chunk itself. Behind Envoy the endpoint
picker sees the response only through ext_proc: its headers, then its body in the pieces Envoy
forwards. ``ResponseReader`` turns those pieces into the same ``RawChunk``s the relay accounts,
so a session's estimate moves the same way behind either:

- a stream (``text/event-stream``): each complete SSE event as it arrives; only the start of an
  event cut between two pieces is held, never the stream;
- a whole JSON answer: its bytes, bounded, read once the answer is complete. A specgate
  worker's answer carries its steps in order (``Directive.step_log``), which are taken out of
  the answer the client gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.fleet.worker_stream import RawChunk
from workers.api.wire import DIRECTIVE_FIELD, StepReport, logged_steps

# A whole answer larger than this is relayed unread: its steps go unaccounted, as a stream's
# would if the worker sent no reports. Answers are a few KiB; this bounds the picker's memory.
MAX_ANSWER_BYTES = 8 << 20
MAX_EVENT_BYTES = 1 << 20  # an SSE event longer than this is skipped (no worker writes one)


@dataclass
class ResponseReader:
    """One response's feedback: feed it the headers' status and type, then the body's pieces."""

    status: int = 0
    streaming: bool = False
    _tail: bytes = b""  # the start of an SSE event cut between two body pieces
    _skipping: bool = False  # inside an over-long event: dropped up to its end
    _answer: bytearray = field(default_factory=bytearray)
    _answer_too_large: bool = False

    def headers(self, status: int, content_type: str) -> None:
        self.status = status
        self.streaming = content_type.split(";", 1)[0].strip().lower() == "text/event-stream"

    @property
    def ok(self) -> bool:
        return self.status == 200

    def stream_piece(self, data: bytes) -> list[RawChunk]:
        """Every complete event of a stream piece as a chunk (the ``[DONE]`` marker and error
        events are not chunks of the answer)."""
        if not self.ok or not self.streaming:
            return []
        *events, tail = (self._tail + data).split(b"\n\n")
        if self._skipping and events:
            events, self._skipping = events[1:], False
        if len(tail) > MAX_EVENT_BYTES:
            tail, self._skipping = b"", True
        self._tail = b"" if self._skipping else tail
        chunks = []
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (a specgate worker's token ids) and other fields
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(chunk, dict) and "error" not in chunk:
                    chunks.append(RawChunk(chunk, payload, None, StepReport.from_json(chunk.get(DIRECTIVE_FIELD))))
        return chunks

    def answer_piece(self, data: bytes) -> None:
        """A piece of a whole (non-streaming) answer, kept until the answer is complete."""
        if not self.ok or self.streaming or self._answer_too_large:
            return
        if len(self._answer) + len(data) > MAX_ANSWER_BYTES:
            self._answer_too_large = True
            self._answer.clear()
            return
        self._answer += data

    def whole_answer(self, data: bytes = b"") -> tuple[RawChunk | None, bytes | None]:
        """The complete answer as one chunk for the accounting (its steps in ``report``), and
        the answer's bytes without the step log for the client (None: leave it as it is)."""
        self.answer_piece(data)
        if not self.ok or self.streaming or self._answer_too_large or not self._answer:
            return None, None
        try:
            answer: Any = orjson.loads(bytes(self._answer))
        except orjson.JSONDecodeError:
            return None, None
        if not isinstance(answer, dict):
            return None, None
        log = answer.pop(DIRECTIVE_FIELD, None)
        report = logged_steps(log)
        stripped = orjson.dumps(answer) if log is not None else None
        return RawChunk(answer, None, None, report), stripped
