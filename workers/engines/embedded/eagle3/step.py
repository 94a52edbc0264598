"""The ``eagle3`` method in the engine's step: the target's states kept per sequence until the head
reads them, the head's chain of K drafts, and the rewind after verification.

Per sequence (``Sequence.head_len``, ``Sequence.aux_pending``): the head's K/V holds real entries
(from the target's states) for positions < head_len; ``aux_pending`` holds the target's states for
positions head_len .. target_len - 1, which every target forward of the sequence extends (prefill,
verification, plain steps) and verification cuts back to the accepted prefix. A drafting step first
catches the head up on those positions (its entry at t reads the state at t and token t + 1), whose
last output proposes the first draft; each later draft feeds back the head's own output. The chain's
own entries sit past head_len and are overwritten by the next catch-up, as the draft model's are.

Prefix reuse: an ``eagle3`` request does not start from cached prompt K/V (the cache holds no target
states to catch the head up on); it prefills and its chunks are still stored for other requests.
"""

from __future__ import annotations

import torch

from workers.engines.embedded.aux_states import AuxCapture
from workers.engines.embedded.drafting import draft_token
from workers.engines.embedded.eagle3.head import Eagle3Head
from workers.engines.embedded.sequence import Sequence

METHOD = "eagle3"


def uses_head(seq: Sequence) -> bool:
    return seq.request.method == METHOD


def step_k(seq: Sequence, k: int) -> int:
    """The step's K: none before the target has computed a position the head can read (a short
    prompt's first step rides in the batch unprefilled: its states come with that step)."""
    return k if seq.target_len > seq.head_len else 0


def capture_for(head: Eagle3Head | None, seqs: list[Sequence]) -> AuxCapture | None:
    """A capture for the step's target forwards where a sequence drafts with the head (else None:
    the forwards copy nothing)."""
    if head is None or not any(uses_head(s) for s in seqs):
        return None
    return AuxCapture(head.layer_ids)


def collect(capture: AuxCapture, seqs: list[Sequence]) -> None:
    """The states the step's target forwards recorded, into their sequences' ``aux_pending``
    (rows of other sequences are dropped). A row rewrites from its start: stale states of rejected
    drafts, or a row computed again after a failed batch, are replaced."""
    by_slot = {s.slot: s for s in seqs if uses_head(s)}
    for slot, start, states in capture.take():
        seq = by_slot.get(slot)
        if seq is None:
            continue
        keep = start - seq.head_len
        if keep < 0 or keep > len(seq.aux_pending):
            raise RuntimeError(f"target states at {start} do not follow the head's {seq.head_len} + "
                               f"{len(seq.aux_pending)} positions")
        seq.aux_pending = torch.cat([seq.aux_pending[:keep], states]) if keep else states


def rewind(seq: Sequence) -> None:
    """After verification: keep the states of the accepted prefix only (positions < target_len)."""
    seq.aux_pending = seq.aux_pending[:max(0, seq.target_len - seq.head_len)]


def propose(head: Eagle3Head, vocab: int, seqs: list[Sequence], failed: dict[str, Exception]) -> None:
    for seq in seqs:
        try:
            _propose_one(head, vocab, seq)
        except Exception as exc:
            failed[seq.request.request_id] = exc


def _propose_one(head: Eagle3Head, vocab: int, seq: Sequence) -> None:
    start, end = seq.head_len, seq.target_len
    if len(seq.aux_pending) != end - start or end <= start:
        raise RuntimeError(f"the head lacks the target's states for positions {start}..{end - 1} "
                           f"({len(seq.aux_pending)} kept)")
    logits, out = head.forward(seq.slot, start, seq.aux_pending, seq.tokens[start + 1:end + 1], fused=True)
    seq.head_len, seq.aux_pending = end, seq.aux_pending[end - start:]
    greedy = seq.request.params.temperature <= 0.0
    for j in range(seq.step_k):
        if greedy and head.vocab_ids is not None:
            seq.drafts.append(int(head.vocab_ids[int(logits[0].argmax())]))
        else:
            draft_token(seq, head.full_vocab_logits(logits, vocab)[0], j)
        if j + 1 < seq.step_k:
            logits, out = head.forward(seq.slot, end + j, out[-1:], [seq.drafts[-1]], fused=False)
