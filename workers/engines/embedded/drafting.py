"""Greedy drafting in one kernel call: the fast path of the engine's draft proposals
(``SpeculativeEngine._propose``), kept apart so the engine stays one screenful of rules."""

from __future__ import annotations

from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sequence import Sequence


def propose_greedy(draft: LlamaForCausalLM, cache: KVCache, in_one_call: bool, seqs: list[Sequence]) -> bool:
    """All K drafts of greedy sequences drafting the same K in one kernel call
    (``FusedForward.draft_greedy``); False where that does not apply (the per-position
    path then drafts). The same forwards and argmaxes as that path, so the same drafts;
    a batch that raises is drafted again per position, which rewrites the same cache
    positions and isolates the failing sequence."""
    fused, k = draft.fused, seqs[0].step_k
    # (A reduced-vocabulary draft's kernel argmax is a head row, not a token to feed back.)
    if fused is None or draft.vocab_ids is not None or not in_one_call or any(
            s.step_k != k or s.request.params.temperature > 0.0 for s in seqs):
        return False
    # The first forward catches the draft cache up: 1-2 tokens, more after a plain spell or
    # on a prompt; the kernel's attention serves rows up to a length (native_forward).
    rows = [s.tokens[s.draft_len:] for s in seqs]
    if max(map(len, rows)) > draft.native_attention_max_tokens:
        return False
    try:
        drafts = fused.draft_greedy(rows, cache.k, cache.v, [s.slot for s in seqs],
                                    [s.draft_len for s in seqs], k)
    except Exception:
        return False
    for seq, row, row_drafts in zip(seqs, rows, drafts, strict=True):
        seq.draft_len += len(row) + k - 1
        seq.drafts = row_drafts
    return True
