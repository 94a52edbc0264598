"""Prefix reuse (workers/engines/embedded/prefix_cache.py): a request that finds its prompt's first
chunks cached gives the output it gives cold, token for token, greedy and seeded, in every mode
(plain, K, trees, lookup, a mixed batch); the store keeps its byte bound, evicts a chain's tail
before its head, reuses a still-running sequence's prompt, and leaves a full-length prompt's last
chunk to compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from policies.tree import TreeShape
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.prefix_cache import PrefixCache
from workers.engines.embedded.sampling import SamplingParams

from .conftest import VOCAB
from .engine_runs import output_tokens, run_until_idle

CHUNK = 16  # small chunks: the tiny models' 192 positions hold several
MAX_K = 4
OUTPUT = 20
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=5)
_gen = torch.Generator().manual_seed(17)
SYSTEM = torch.randint(0, VOCAB, (40,), generator=_gen).tolist()  # 2.5 chunks shared by every prompt
TAILS = [torch.randint(0, VOCAB, (n,), generator=_gen).tolist() for n in (3, 17, 30)]
# The last: 2 cached chunks and 2 tokens left, fewer than ride in a decode forward: still a prefill.
PROMPTS = [SYSTEM + tail for tail in TAILS] + [SYSTEM[:34]]
MB = 1 << 20


def engine(models: tuple[LlamaForCausalLM, LlamaForCausalLM], cache_bytes: int, slots: int = 4,
           **kwargs: object) -> SpeculativeEngine:
    return SpeculativeEngine(*models, max_slots=slots, max_k=MAX_K, prefill_chunk=CHUNK,
                             prefix_cache_bytes=cache_bytes, **kwargs)  # type: ignore[arg-type]


def outputs(eng: SpeculativeEngine, requests: Sequence[GenerationRequest]) -> dict[str, list[int]]:
    for request in requests:
        eng.add(request)
    return {rid: output_tokens(events) for rid, events in run_until_idle(eng).items()}


def first_cached(eng: SpeculativeEngine, request: GenerationRequest) -> int | None:
    eng.add(request)
    events = run_until_idle(eng)[request.request_id]
    return events[0].cached_tokens


@pytest.fixture(scope="module")
def models(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    return target_model, draft_model


MODES: dict[str, dict[str, Any]] = {
    "plain": {"k": 0},
    "k1": {"k": 1},
    "k4": {"k": MAX_K},
    "tree": {"k": MAX_K, "tree": TreeShape.parse("2+2")},
    "ngram": {"k": MAX_K, "method": "ngram"},
}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", MODES)
def test_a_cached_prefix_changes_no_token(mode: str, params: SamplingParams,
                                          models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """Each prompt after a first one that shares its system prompt: the same tokens as a cold
    engine's and as an engine without a cache, and the hit reported."""
    def requests(tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", prompt, OUTPUT, params, **MODES[mode])
                for i, prompt in enumerate(PROMPTS)]
    off = engine(models, 0)
    cold = {rid[1:]: out for rid, out in outputs(off, requests("c")).items()}
    on = engine(models, 8 * MB)
    warm: dict[str, list[int]] = {}
    cached: list[int | None] = []
    for request in requests("w"):  # one at a time: each finds the ones before it cached
        cached.append(first_cached(on, request))
        warm[request.request_id[1:]] = []
    for request in requests("x"):  # again, all cached now, and output compared
        on.add(request)
    for rid, events in run_until_idle(on).items():
        warm[rid[1:]] = output_tokens(events)
    assert warm == cold
    assert cached[0] == 0 and all(c == 2 * CHUNK for c in cached[1:]), cached  # SYSTEM's 2 full chunks
    assert len(next(iter(cold.values()))) == OUTPUT


def test_a_mixed_batch_with_hits_is_the_cold_batch(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """Plain, drafted, tree and lookup sequences in one batch, some prompts cached: unchanged."""
    kinds = list(MODES.values())
    requests = [GenerationRequest(f"m{i}", PROMPTS[i % len(PROMPTS)], OUTPUT, GREEDY, **kinds[i % len(kinds)])
                for i in range(5)]
    cold = outputs(engine(models, 0, slots=5), requests)
    on = engine(models, 8 * MB, slots=5)
    outputs(on, [GenerationRequest("seed", PROMPTS[0], 4, GREEDY)])  # the system prompt cached
    assert outputs(on, requests) == cold
    assert on.prefix is not None and on.prefix.stats.hits == 5


def test_a_running_sequences_prompt_is_reused(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """The chunks go in once its prefill ran: a request arriving while it still decodes hits."""
    on = engine(models, 8 * MB)
    on.add(GenerationRequest("long", PROMPTS[2], 60, GREEDY, k=MAX_K))
    on.step()  # its prefill
    assert "long" in on._running
    second = GenerationRequest("second", PROMPTS[1], OUTPUT, GREEDY, k=MAX_K)
    on.add(second)
    by_id = run_until_idle(on)
    assert by_id["second"][0].cached_tokens == 2 * CHUNK
    alone = outputs(engine(models, 0), [GenerationRequest("second", PROMPTS[1], OUTPUT, GREEDY, k=MAX_K)])
    assert output_tokens(by_id["second"]) == alone["second"]


def test_a_prompt_of_whole_chunks_recomputes_its_last(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """A prompt exactly a cached one (3 whole chunks): 2 are reused, the last is prefilled (its
    last token's logits are the first output's)."""
    prompt = (SYSTEM + TAILS[2])[:3 * CHUNK]
    on = engine(models, 8 * MB)
    first = outputs(on, [GenerationRequest("a", prompt, OUTPUT, GREEDY, k=MAX_K)])["a"]
    assert first_cached(on, GenerationRequest("b", prompt, OUTPUT, GREEDY, k=MAX_K)) == 2 * CHUNK
    assert outputs(on, [GenerationRequest("c", prompt, OUTPUT, GREEDY, k=MAX_K)])["c"] == first


def test_a_resumed_request_reuses_only_its_prompt(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """A resumed request's output (computed row-invariant by its first worker) is never served
    from the cache: the hit stops within its prompt, and the continuation is the cold one's."""
    on, off = engine(models, 8 * MB), engine(models, 0)
    prompt = PROMPTS[1]
    full = outputs(off, [GenerationRequest("full", prompt, OUTPUT, GREEDY, k=MAX_K)])["full"]
    outputs(on, [GenerationRequest("warm", prompt + full[:20], 2, GREEDY)])  # caches the output as prompt
    resumed = SamplingParams(0.0, position_offset=10)
    request = GenerationRequest("r", prompt + full[:10], OUTPUT - 10, resumed, k=MAX_K, resumed_tokens=10)
    on.add(request)
    events = run_until_idle(on)["r"]
    assert events[0].cached_tokens == (len(prompt) - 1) // CHUNK * CHUNK  # within the prompt
    assert output_tokens(events) == full[10:]


def test_off_reports_nothing_and_on_reports_misses_as_zero(models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    off, on = engine(models, 0), engine(models, 8 * MB)
    assert off.prefix is None and first_cached(off, GenerationRequest("a", PROMPTS[0], 4, GREEDY)) is None
    assert first_cached(on, GenerationRequest("a", PROMPTS[0], 4, GREEDY)) == 0
    assert first_cached(on, GenerationRequest("short", [1, 2, 3], 4, GREEDY)) == 0  # no chunk to look up


def _store(cache: PrefixCache, kv: KVCache, tokens: list[int]) -> None:
    cache.store_target(tokens, len(tokens), kv, 0)


def test_the_bound_holds_and_a_chains_tail_goes_first(target_model: LlamaForCausalLM) -> None:
    kv = KVCache.allocate(target_model.cfg, 1, torch.float32, 192)
    block_bytes = 2 * target_model.cfg.num_hidden_layers * target_model.cfg.num_key_value_heads * CHUNK \
        * target_model.cfg.head_dim * 4
    cache = PrefixCache(5 * block_bytes, CHUNK)
    a = list(range(4 * CHUNK))  # a chain of 4 blocks
    _store(cache, kv, a)
    assert len(cache.blocks) == 4 and cache.bytes_held == 4 * block_bytes
    b = [VOCAB - 1] * (3 * CHUNK)  # 3 more: over the bound by 2
    _store(cache, kv, b)
    assert cache.bytes_held <= cache.bound_bytes and len(cache.blocks) == 5
    # a's tail went (its blocks were refreshed tail first: the head is the most recent of them)
    assert len(cache.lookup(a, len(a))) == 2 and len(cache.lookup(b, len(b))) == 3
    assert cache.stats.evicted_blocks == 2


def test_ten_thousand_sessions_stay_within_the_bound(target_model: LlamaForCausalLM) -> None:
    """Every session a new 3-chunk prompt with a shared first chunk: the bytes never pass the
    bound, and the shared head, looked up by every session, is never evicted."""
    kv = KVCache.allocate(target_model.cfg, 1, torch.float32, 192)
    bound = 1 * MB
    cache = PrefixCache(bound, CHUNK)
    head = [7] * CHUNK
    gen = torch.Generator().manual_seed(3)
    peak = 0
    for session in range(10_000):
        prompt = head + torch.randint(0, VOCAB, (2 * CHUNK,), generator=gen).tolist()
        found = cache.lookup(prompt, len(prompt) - 1)
        assert session == 0 or len(found) >= 1
        _store(cache, kv, prompt)
        peak = max(peak, cache.bytes_held)
        if session % 1000 == 0:  # no block held without its head
            assert all(b.parent is None or b.parent in cache.blocks for b in cache.blocks.values())
    assert peak <= bound
    print(f"10,000 sessions: peak {peak} bytes against a bound of {bound} ({len(cache.blocks)} blocks held)")


def _prompt_kv(eng: SpeculativeEngine, prompt: list[int]) -> list[torch.Tensor]:
    """The target's K/V of a one-token request's prompt, every layer, as its slot (0) holds them."""
    outputs(eng, [GenerationRequest(f"kv{len(prompt)}", prompt, 1, GREEDY)])
    cache = eng.target_cache
    return [t[0, :, :len(prompt)].clone() for t in (*cache.k, *cache.v)]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_hit_leaves_the_cache_bit_for_bit_as_cold(precision: str, models: tuple[LlamaForCausalLM, LlamaForCausalLM],
                                                    bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """The sharp form of the tests above (the tiny models' logits have no near-ties to flip): the
    prompt's keys and values after a hit are the cold prefill's, bit for bit, because both
    computed every chunk in the same forward; the tokens after them are prefilled as cold."""
    pair = models if precision == "float32" else bf16_models
    for prompt in PROMPTS[1:]:
        cold = _prompt_kv(engine(pair, 0, slots=1), prompt)
        on = engine(pair, 8 * MB, slots=1)
        outputs(on, [GenerationRequest("other", SYSTEM + TAILS[0], 2, GREEDY)])  # SYSTEM's chunks cached
        warm = _prompt_kv(on, prompt)
        assert on.prefix is not None and on.prefix.stats.hits >= 1
        assert all(torch.equal(a, b) for a, b in zip(warm, cold, strict=True)), len(prompt)


def test_a_bound_below_one_block_keeps_nothing(target_model: LlamaForCausalLM) -> None:
    kv = KVCache.allocate(target_model.cfg, 1, torch.float32, 192)
    cache = PrefixCache(1000, CHUNK)  # bytes: less than one block's K/V
    _store(cache, kv, list(range(3 * CHUNK)))
    assert not cache.blocks and cache.bytes_held == 0 and cache.lookup(list(range(3 * CHUNK)), 3 * CHUNK) == []


# -- cache scopes (issue 52: one tenant's prompts never show in another's answers) -------------------
def test_a_scope_never_reads_blocks_another_scope_wrote(target_model: LlamaForCausalLM) -> None:
    kv = KVCache.allocate(target_model.cfg, 1, torch.float32, 192)
    cache = PrefixCache(8 * MB, CHUNK)
    prompt = list(range(3 * CHUNK))
    cache.store_target(prompt, len(prompt), kv, 0, "tenant-a")
    assert len(cache.lookup(prompt, len(prompt), "tenant-a")) == 3  # its own scope hits
    assert cache.lookup(prompt, len(prompt), "tenant-b") == []  # another scope misses...
    assert cache.lookup(prompt, len(prompt)) == []  # ...and so does the default one
    cache.store_target(prompt, len(prompt), kv, 0, "tenant-b")  # each keeps its own copy
    assert len(cache.blocks) == 6 and {b.scope for b in cache.blocks.values()} == {"tenant-a", "tenant-b"}


def test_an_engine_shares_cached_prompts_within_a_scope_only(models: tuple[LlamaForCausalLM, LlamaForCausalLM]
                                                             ) -> None:
    eng = engine(models, 8 * MB)
    assert first_cached(eng, GenerationRequest("a1", PROMPTS[0], 4, GREEDY, cache_scope="a")) == 0
    assert first_cached(eng, GenerationRequest("b1", PROMPTS[1], 4, GREEDY, cache_scope="b")) == 0  # same system
    assert first_cached(eng, GenerationRequest("a2", PROMPTS[1], 4, GREEDY, cache_scope="a")) == 2 * CHUNK
    assert first_cached(eng, GenerationRequest("d1", PROMPTS[1], 4, GREEDY)) == 0


def test_many_scopes_share_one_bound(target_model: LlamaForCausalLM) -> None:
    """A tenant that sends the same prompt under ever new salts (scopes) cannot grow the cache
    past its one bound: the bytes stay within it and the oldest scopes' blocks go first."""
    kv = KVCache.allocate(target_model.cfg, 1, torch.float32, 192)
    bound = 1 * MB
    cache = PrefixCache(bound, CHUNK)
    prompt = list(range(3 * CHUNK))
    peak = 0
    for salt in range(2_000):
        cache.store_target(prompt, len(prompt), kv, 0, f"salt-{salt}")
        peak = max(peak, cache.bytes_held)
    assert peak <= bound and cache.stats.evicted_blocks > 0
    assert cache.lookup(prompt, len(prompt), "salt-0") == []
    assert len(cache.lookup(prompt, len(prompt), "salt-1999")) == 3
