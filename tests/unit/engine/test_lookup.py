"""Lookup proposers (prompt lookup, suffix matching) and their point-mass verification: what
they propose, their bounds, and that every method's output is the target's."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from tests.unit.engine.engine_runs import GREEDY, PROMPTS, generate, output_tokens, run_until_idle
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.lookup import suffix as suffix_module
from workers.engines.embedded.lookup.ngram import NgramIndex
from workers.engines.embedded.lookup.proposer import LookupProposer
from workers.engines.embedded.lookup.suffix import KEY_LEN, SequenceKeys, SuffixStore
from workers.engines.embedded.sampling import SamplingParams, verify_point_mass

from .conftest import ChiSquare, GreedyReference

MAX_K = 6


# -- prompt lookup ------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # the 3-gram 1 2 3 occurred before: what followed it
    ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 2, [5, 1]),  # the most recent occurrence wins
    ([7, 2, 3, 4, 8, 2, 3, 6, 9, 2, 3], 1, [6]),  # no 3-gram match: the 2-gram 2 3, most recent
    ([1, 2, 3, 4], 4, []),  # nothing repeats
    ([5, 6, 5], 4, []),  # a 1-gram would match, but prompt_lookup_min is 2
    ([1, 2, 3, 1, 2], 8, [3, 1, 2, 3, 1, 2, 3, 1]),  # past the context's end the match continues itself
])
def test_prompt_lookup_proposes_what_followed_the_latest_match(tokens: list[int], k: int,
                                                               expected: list[int]) -> None:
    assert NgramIndex(2, 5).propose(tokens, k) == expected


def test_prompt_lookup_is_incremental_and_bounded_by_k() -> None:
    index = NgramIndex(2, 5)
    tokens = [3] * 50  # one repeated token: every n-gram matches
    assert index.propose(tokens, 4) == [3, 3, 3, 3]
    tokens += [3] * 10
    assert index.propose(tokens, 8) == [3] * 8
    tokens += [4, 5, 6, 3, 3]
    assert index.propose(tokens, 3) == [4, 5, 6]  # only "3 3" matches: the run ended with it, then 4 5 6
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(3, 2)


# -- suffix matching ---------------------------------------------------------------------------
def test_suffix_proposes_the_most_frequent_continuation_of_the_longest_match() -> None:
    store = SuffixStore()
    for output in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9, 2, 3, 4, 8, 8]):
        store.add(output, "s", shared=True)
    # "2 3 4" matches all three; "1 2 3 4" only the first two: they decide, 5 then a split (6 or 7).
    assert store.propose([0, 1, 2, 3, 4], "s", 8) == [5, 6]
    assert store.propose([0, 9, 2, 3, 4], "s", 8) == [8, 8]
    assert store.propose([0, 9, 2, 3, 4], "s", 1) == [8]  # bounded by K
    assert store.propose([0, 0, 0, 1], "s", 8) == []  # no key of three tokens matches


def test_suffix_proposals_grow_with_the_match() -> None:
    store = SuffixStore()
    doc = list(range(100, 140))
    store.add(doc, None, shared=True)
    short = store.propose([1, 2, 100, 101, 102], None, 16)  # a 3-token match: at most 6 proposed
    long = store.propose(list(range(100, 112)), None, 16)  # a 12-token match: up to K
    assert short == list(range(103, 109)) and long == list(range(112, 128))


def test_a_prompt_is_matched_for_its_own_session_only() -> None:
    store = SuffixStore()
    store.add([1, 2, 3, 4, 5, 6], "alice", shared=False)
    assert store.propose([0, 1, 2, 3], "alice", 3) == [4, 5, 6]
    assert store.propose([0, 1, 2, 3], "bob", 3) == []
    assert store.propose([0, 1, 2, 3], None, 3) == []


def test_suffix_matches_the_sequence_itself() -> None:
    keys, tokens = SequenceKeys(), [5, 6, 7, 8, 9, 5, 6, 7]
    assert SuffixStore().propose(tokens, None, 4, keys) == [8, 9, 5, 6]


def test_the_store_stays_within_its_bound_and_eviction_cleans_the_index() -> None:
    store = SuffixStore(max_bytes=3 * SuffixStore.largest_cost(20, "s"))
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 1000, (20,), generator=gen).tolist() for _ in range(10)]
    for doc in docs:
        store.add(doc, "s", shared=True)
        assert store.memory_bytes() <= store.max_bytes
    assert store.documents == 3
    assert store.propose(docs[-1][:10], "s", 4) == docs[-1][10:14]  # the newest kept
    assert store.propose(docs[0][:10], "s", 4) == []  # the oldest evicted, its keys with it
    store.add(list(range(10_000)), "s", shared=True)  # larger than the whole bound: not kept
    assert store.documents == 3
    for _ in docs[-3:]:  # evicting every document leaves no entry behind
        store._evict(next(iter(store._documents)))
    assert store.memory_bytes() == 0 and not store._index


def test_eviction_is_least_recently_used() -> None:
    """A document that supplied a proposal counts as used: the oldest unused one goes first."""
    store = SuffixStore(max_bytes=3 * SuffixStore.largest_cost(20, "s"))
    docs = [list(range(100 * i, 100 * i + 20)) for i in range(4)]
    for doc in docs[:3]:
        store.add(doc, "s", shared=True)
    assert store.propose(docs[0][:8], "s", 4) == docs[0][8:12]  # the oldest, used
    store.add(docs[3], "s", shared=True)
    assert store.documents == 3
    assert store.propose(docs[1][:8], "s", 4) == []  # the least recently used went
    assert store.propose(docs[0][:8], "s", 4) == docs[0][8:12]


def _allocated(fill: Callable[[SuffixStore], None], max_bytes: int = 1 << 40) -> tuple[int, SuffixStore]:
    """What the store holds after ``fill``, as tracemalloc counts it (its own allocations only:
    the documents' token lists are made before)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = SuffixStore(max_bytes)
        fill(store)
        return tracemalloc.get_traced_memory()[0] - before, store
    finally:
        tracemalloc.stop()


def _random_docs(count: int, length: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(49_152) for _ in range(length)] for _ in range(count)]


TINY, LONG, REPEATED = _random_docs(4000, KEY_LEN + 1, 4), _random_docs(1, 50_000, 5), _random_docs(1, 500, 6) * 40
_CHURN = _random_docs(2000, 40, 7)


@pytest.mark.parametrize(("case", "fill", "max_bytes"), [
    # The worst per token: a key each, and a fresh session id each (as a request's header is).
    ("tiny documents", lambda store: [store.add(d, f"session-{i:032d}", shared=True) for i, d in enumerate(TINY)],
     1 << 40),
    ("all keys new", lambda store: store.add(LONG[0], None, shared=True), 1 << 40),
    ("repetitive (occurrences pushed out)", lambda store: [store.add(d, "s", shared=False) for d in REPEATED], 1 << 40),
    # Churn: documents evicted all along, their keys deleted (the dict keeps its table).
    ("evicting", lambda store: [store.add(d, f"s{i}", shared=True) for i, d in enumerate(_CHURN)], 300_000),
])
def test_the_memory_accounting_is_an_upper_bound(case: str, fill: Callable[[SuffixStore], None],
                                                max_bytes: int) -> None:
    """The formula (suffix.py's docstring) against what Python allocated, measured."""
    allocated, store = _allocated(fill, max_bytes)
    assert store.memory_bytes() <= max_bytes
    print(f"{case}: allocated {allocated} bytes, accounted {store.memory_bytes()}")
    assert allocated <= store.memory_bytes(), (case, allocated, store.memory_bytes())
    if case == "all keys new":
        assert store.memory_bytes() <= 1.5 * allocated  # and not far above it


def test_ten_thousand_sessions_stay_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    bound = 4 << 20
    store = SuffixStore(max_bytes=bound)
    gen = torch.Generator().manual_seed(2)
    peak = 0
    for session in range(10_000):
        prompt = torch.randint(0, 49_152, (24,), generator=gen).tolist()
        store.add(prompt, f"s{session}", shared=False)
        store.add(prompt[:8] + torch.randint(0, 49_152, (16,), generator=gen).tolist(), f"s{session}", shared=True)
        peak = max(peak, store.memory_bytes())
    assert peak <= bound and store.documents < 20_000
    print(f"suffix store after 10,000 sessions: {store.memory_bytes()} bytes (bound {bound}), "
          f"{store.documents} documents")
    assert suffix_module.DEFAULT_MAX_BYTES == 64 << 20


# -- point-mass verification -------------------------------------------------------------------
def test_point_mass_verification_samples_the_target(chi_square: ChiSquare) -> None:
    """Whatever is proposed, the first emitted token is distributed as p (x accepted with p(x);
    rejected: p without x, renormalised)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 12, generator=gen) * 2.0, dim=-1)
    for proposal in (int(p[0].argmax()), int(p[0].argmin()), 5):
        draws = [verify_point_mass([proposal], p, gen).tokens[0] for _ in range(20_000)]
        assert chi_square(draws, p[0]) > 1e-3, proposal
        accepted = Counter(draws)[proposal] / len(draws)
        assert abs(accepted - float(p[0, proposal])) < 0.02


# -- the engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_parity_with_each_lookup_method(method: str, target_model: LlamaForCausalLM,
                                               draft_model: LlamaForCausalLM,
                                               greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    proposed = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        max_tokens = 24 + i % 9
        events = generate(engine, GenerationRequest(f"p{i}", prompt, max_tokens, GREEDY, k=MAX_K,
                                                    method=method, session="s"))  # type: ignore[arg-type]
        assert output_tokens(events) == greedy_reference(prompt, max_tokens), f"prompt {i}"
        assert all(e.proposed <= min(MAX_K, max_tokens - 1) for e in events)
        proposed += sum(e.proposed for e in events)
        accepted += sum(e.accepted for e in events)
    # The tiny target falls into loops: lookup finds them, and both outcomes happen.
    assert 0 < accepted < proposed
    assert engine.lookup is not None and engine.lookup.suffix.documents > 0  # finished requests joined the store
    assert not engine.lookup._ngrams and not engine.lookup._keys  # per-sequence indexes freed


def test_a_mixed_batch_of_methods_and_plain_decodes_as_plain(target_model: LlamaForCausalLM,
                                                             draft_model: LlamaForCausalLM,
                                                             greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=4, max_k=MAX_K)
    plans = [("draft", MAX_K), ("ngram", MAX_K), ("suffix", MAX_K), ("draft", 0)] * 3
    for i, (method, k) in enumerate(plans):
        engine.add(GenerationRequest(f"m{i}", PROMPTS[i], 30, GREEDY, k=k, method=method))  # type: ignore[arg-type]
    runs = run_until_idle(engine)
    for i, (method, k) in enumerate(plans):
        assert output_tokens(runs[f"m{i}"]) == greedy_reference(PROMPTS[i], 30), (i, method)
        if k == 0:
            assert all(e.proposed == 0 for e in runs[f"m{i}"])
    assert max(len({e.request_id for e in step}) for step in [runs[r] for r in runs]) >= 1
    assert any(e.proposed > 0 for i in (1, 5, 9) for e in runs[f"m{i}"])  # ngram proposed in the batch


def test_seeded_output_is_the_same_with_every_method(target_model: LlamaForCausalLM,
                                                     draft_model: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=MAX_K)
    params = SamplingParams(temperature=1.0, seed=11)
    outputs = {method: output_tokens(generate(engine, GenerationRequest(f"x-{method}", PROMPTS[3], 40, params,
                                                                        k=0 if method == "plain" else MAX_K,
                                                                        method="draft" if method == "plain"
                                                                        else method)))  # type: ignore[arg-type]
               for method in ("plain", "draft", "ngram", "suffix")}
    assert len({tuple(tokens) for tokens in outputs.values()}) == 1, outputs


def test_unseeded_sampling_with_lookup_matches_the_target(target_model: LlamaForCausalLM,
                                                          draft_model: LlamaForCausalLM, chi_square: ChiSquare) -> None:
    """The first token after a short looping prompt (it rides the first decode step, no prefill
    of its own), many times over: lookup proposes one, and the emitted token's distribution is
    still the target's."""
    prompt = [4, 9, 4, 9]
    engine = SpeculativeEngine(target_model, draft_model, max_slots=8, max_k=2)
    with torch.inference_mode():
        p = torch.softmax(target_model.forward_train(torch.tensor([prompt]))[0, -1].float(), dim=-1)
    draws, proposed = [], 0
    for i in range(1500):
        events = generate(engine, GenerationRequest(f"u{i}", prompt, 2, SamplingParams(temperature=1.0), k=2,
                                                    method="ngram"))
        draws.append(output_tokens(events)[0])
        proposed += sum(e.proposed for e in events)
    assert proposed > 0
    assert chi_square(draws, p) > 1e-3


# -- cache scopes (issue 52) --------------------------------------------------------------------
def test_documents_are_matched_within_their_scope_only() -> None:
    """An output is every session's of its scope, never another scope's; a prompt is its own
    session's within its scope (the same session id under two scopes: two sessions)."""
    store = SuffixStore()
    store.add([1, 2, 3, 4, 5, 6], "s", shared=True, scope="a")
    store.add([11, 12, 13, 14, 15, 16], "s", shared=False, scope="a")
    assert store.propose([0, 1, 2, 3], "other", 3, scope="a") == [4, 5, 6]
    assert store.propose([0, 1, 2, 3], "other", 3, scope="b") == []
    assert store.propose([0, 1, 2, 3], "other", 3) == []  # the default scope is a scope too
    assert store.propose([0, 11, 12, 13], "s", 3, scope="a") == [14, 15, 16]
    assert store.propose([0, 11, 12, 13], "s", 3, scope="b") == []


def test_many_scopes_share_one_bound() -> None:
    bound = 1 << 20
    store = SuffixStore(max_bytes=bound)
    document = list(range(200))
    peak = 0
    for salt in range(5_000):  # one tenant, ever new salts, the same text
        store.add(document, "s", shared=True, scope=f"{salt:032x}")
        peak = max(peak, store.memory_bytes())
    assert peak <= bound and store.documents < 5_000
    assert store.propose(document[:20], None, 4, scope=f"{4_999:032x}") == document[20:24]
    assert store.propose(document[:20], None, 4, scope=f"{0:032x}") == []  # evicted, not leaked


def test_the_proposer_keeps_each_requests_documents_in_its_scope() -> None:
    lookup = LookupProposer()
    prompt, output = list(range(50, 80)), list(range(80, 120))
    lookup.finished("a1", prompt, output, "sess", scope="tenant-a")
    context = prompt + output[:10]
    assert lookup.propose("a2", "suffix", context, "sess", 8, scope="tenant-a") == output[10:18]
    assert lookup.propose("b1", "suffix", context, "sess", 8, scope="tenant-b") == []
