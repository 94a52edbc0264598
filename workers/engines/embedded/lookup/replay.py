"""Shadow evidence: what a lookup method a request did not run would have done on its output.

At T=0 the output is the same whatever proposes (verification is bit-identical to plain
decoding), and a seeded request's is too (Gumbel-max sampling coupled across modes: a proposal
stands while it equals the emitted token, ``sampling.gumbel_max``). So once a request finishes,
the steps a lookup method would have run on it can be replayed exactly, at no model cost: walk
the output as that method's steps would, proposing from the context so far (prompt and output,
as ``LookupProposer`` sees it), a proposal's accepted drafts its prefix that matches the output,
and the step's emitted tokens those plus one. The counts equal, step for step, what running the
method reports (``tests/unit/engine/test_shadow_replay.py``), except where the engine's step
rules cut the real K mid-request (the batch's ``step_depth``, a live ``set_k``), which the
replay does not see: it caps each proposal at the K the request ended with.

An unseeded request sampled at T > 0 gets none: there point-mass verification accepts x with
the target's probability of x, not iff x is the emitted token, and a replay would be an
estimate (docs/methods.md "Shadow evidence").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from policies.methods import METHODS, Method, is_lookup
from workers.api.generation import ShadowSteps
from workers.api.wire import shadow_of
from workers.engines.embedded.lookup.ngram import NgramIndex
from workers.engines.embedded.lookup.proposer import LookupProposer
from workers.engines.embedded.lookup.suffix import SequenceKeys
from workers.engines.embedded.sequence import Sequence as EngineSequence

Propose = Callable[[Sequence[int], int], list[int]]


def replay_steps(propose: Propose, prompt: Sequence[int], output: Sequence[int], stop_token: int | None, k: int,
                 plain_prefix: int, max_tokens: int, max_positions: int) -> list[tuple[int, int]]:
    """The (proposed, accepted) steps a lookup method's ``propose`` would have run on ``output``.

    ``plain_prefix``: output positions the engine decodes plain whatever the method (the
    prefill's token, positions below ``min_tokens``). ``stop_token``: the EOS the output ended
    on, which a proposal may match (it is generated, never part of the output). Each proposal is
    capped as the engine's ``_room`` caps a step: at ``k``, one below the tokens ``max_tokens``
    leaves, and the cache's room."""
    reference = [*output, stop_token] if stop_token is not None else list(output)
    context = list(prompt)  # grows as the walk does: a slice per step would copy the context each time
    steps: list[tuple[int, int]] = []
    p = 0
    while p < len(output):
        cap = min(k, max_tokens - p - 1, max_positions - len(context) - 1)
        proposal = propose(context, cap) if p >= plain_prefix and cap > 0 else []
        accepted = 0
        for token in proposal:
            if p + accepted >= len(reference) or reference[p + accepted] != token:
                break
            accepted += 1
        steps.append((len(proposal), accepted))
        advance = min(accepted + 1, len(output) - p)
        context.extend(output[p:p + advance])
        p += advance
    return steps


def _proposer_for(lookup: LookupProposer, method: Method, session: str | None, scope: str) -> Propose:
    """A fresh per-sequence index for ``method``, as a running sequence's would be; the suffix
    store is read as it stands (before this request's own documents join it) and left untouched."""
    if method == "ngram":
        index = NgramIndex(lookup.settings.prompt_lookup_min, lookup.settings.prompt_lookup_max)
        return index.propose
    keys = SequenceKeys()
    return lambda tokens, k: lookup.suffix.propose(tokens, session, k, keys, touch=False, scope=scope)


def shadow_at_finish(lookup: LookupProposer, seq: EngineSequence, stop_token: int | None, max_k: int,
                     max_positions: int, prefilled: bool) -> tuple[ShadowSteps, ...]:
    """Shadow evidence for each lookup method the finished ``seq`` did not run, or () where a
    replay would not be exact (an unseeded request sampled at T > 0).

    Capped at the K the sequence ran with (a plain one's: ``max_k``); ``prefilled``: its first
    step was a prefill, plain whatever the method (``SpeculativeEngine._prefilling``)."""
    request, params = seq.request, seq.request.params
    if params.temperature > 0.0 and params.seed is None:
        return ()
    ran = request.method if seq.k > 0 and is_lookup(request.method) else None
    plain_prefix = max(int(prefilled), params.min_tokens - params.position_offset)
    output = seq.tokens[len(request.prompt_ids):]
    out = []
    for method in METHODS:
        if is_lookup(method) and method != ran:
            propose = _proposer_for(lookup, method, request.session, request.cache_scope)
            steps = replay_steps(propose, request.prompt_ids, output,
                                 stop_token, seq.k if seq.k > 0 else max_k, plain_prefix, request.max_tokens,
                                 max_positions)
            out.append(shadow_of(method, steps))
    return tuple(out)
