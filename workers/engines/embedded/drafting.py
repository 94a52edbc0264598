"""The engine's draft proposals (``SpeculativeEngine._propose``) outside its rules: greedy drafting
in one kernel call (the fast path), and one position's draft token by the request's sampling."""

from __future__ import annotations

import torch

from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import gumbel_max, probabilities, sample
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


def draft_token(seq: Sequence, logits: torch.Tensor, position: int) -> None:
    """logits (V,): the draft's proposal at draft position ``position`` of this step."""
    if seq.request.params.temperature <= 0.0:
        seq.drafts.append(int(logits.argmax()))
        return
    if seq.coupled:
        noise = seq.noise_at(position, logits.shape[-1])[None]
        seq.drafts.append(gumbel_max(logits[None], seq.request.params, noise)[0])
        return
    q = probabilities(logits, seq.request.params)
    seq.drafts.append(int(sample(q, seq.generator).item()))
    seq.draft_probs.append(q)
