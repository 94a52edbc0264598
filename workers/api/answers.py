"""Answer assembly: a stream of chunks folded into the non-streaming response object (so
streaming and non-streaming answers are built from the same chunks), and the ``usage`` field's
speculative counts. Imports no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workers.api.errors import WorkerFailed
from workers.api.wire import RequestKind


def speculative_usage(proposed: int, accepted: int, mode: str, speculative_steps: int | None = None,
                      plain_steps: int | None = None, tested: int | None = None) -> dict[str, Any]:
    """``mode`` is what was decided; the step counts say what ran (None: not known).
    ``acceptance_rate`` is vLLM's (accepted ÷ proposed); ``tested`` the drafts tested, so
    accepted ÷ tested is α, the per-draft acceptance the policy's floor reads (docs/policy.md)."""
    return {"proposed": proposed, "accepted": accepted, "tested": tested,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None, "mode": mode,
            "speculative_steps": speculative_steps, "plain_steps": plain_steps}


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
