"""The sim worker's prefix cache: block-granular hits, LRU eviction under its token bound, off at
0, and the prefill it saves showing in the engine's first step (the request's TTFT)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.config.config import ConfigError, parse_config
from workers.api.sim_config import SimConfig, SimConfigError
from workers.engines.interface import GenerationRequest, StepEvent, StepStats
from workers.engines.sim.engine import SimEngine, SimSettings
from workers.engines.sim.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "models" / "demo-target"


def ids(n: int, start: int = 100) -> list[int]:
    return [start + i % 500 for i in range(n)]


def test_keys_are_a_chain_of_full_blocks() -> None:
    assert len(block_keys(ids(47))) == 2  # the partial block is left out
    a, b = block_keys(ids(32)), block_keys([7, *ids(31)])
    assert a[0] != b[0] and a[1] != b[1]  # a key stands for its whole prefix


@pytest.mark.parametrize(("cached_len", "prompt_len", "expected"), [
    (64, 100, 64),  # the cached prompt's blocks, all of them
    (70, 100, 64),  # its partial block was never cached
    (64, 50, 48),  # a shorter prompt: its own full blocks
    (64, 64, 48),  # the whole prompt cached: one block is left to prefill
    (0, 100, 0),
])
def test_hits_are_the_leading_full_blocks(cached_len: int, prompt_len: int, expected: int) -> None:
    cache = PrefixCache(1024)
    cache.insert(ids(cached_len))
    assert cache.lookup(ids(prompt_len)) == expected


def test_a_hit_stops_at_the_first_differing_block() -> None:
    cache = PrefixCache(1024)
    cache.insert(ids(64))
    prompt = ids(64)
    prompt[40] = 9999  # block 2 of 4 differs: blocks 0 and 1 hit, block 3 cannot (its chain differs)
    assert cache.lookup(prompt + ids(16)) == 2 * BLOCK_TOKENS


def test_eviction_keeps_the_bound_least_recent_first_and_tails_before_heads() -> None:
    cache = PrefixCache(4 * BLOCK_TOKENS)
    system = ids(2 * BLOCK_TOKENS)
    cache.insert(system + ids(2 * BLOCK_TOKENS, start=1000))  # full: 4 blocks
    cache.insert(system + ids(BLOCK_TOKENS, start=2000))  # 1 new block: the older tail goes
    assert cache.tokens_held == 4 * BLOCK_TOKENS
    assert cache.stats.evicted_blocks == 1
    assert cache.lookup(system + ids(BLOCK_TOKENS, start=2000) + [1]) == 3 * BLOCK_TOKENS
    # The first conversation lost its last block, kept its first after the shared prompt.
    assert cache.lookup(system + ids(2 * BLOCK_TOKENS, start=1000) + [1]) == 3 * BLOCK_TOKENS
    for n in range(10):  # many unrelated prompts: never more than the bound
        cache.insert(ids(3 * BLOCK_TOKENS, start=3000 + 100 * n))
        assert cache.tokens_held <= 4 * BLOCK_TOKENS
    assert cache.lookup([*system, 1]) == 0


def test_zero_tokens_is_off() -> None:
    cache = PrefixCache(0)
    cache.insert(ids(64))
    assert not cache.enabled and cache.lookup(ids(64)) == 0 and cache.tokens_held == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "big", True])
def test_the_bound_is_checked_naming_the_field(bad: object) -> None:
    with pytest.raises(SimConfigError) as caught:
        SimConfig.from_mapping({"prefix_cache_tokens": bad})
    assert caught.value.field == "prefix_cache_tokens"


def test_the_gateway_config_check_names_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"workers": {"engine": "sim", "sim": {"prefix_cache_tokens": -5}}}, REPO)
    assert caught.value.field == "workers.sim.prefix_cache_tokens"


def test_the_bound_is_read() -> None:
    assert SimConfig.from_mapping({"prefix_cache_tokens": 4096}).prefix_cache_tokens == 4096
    assert SimConfig.from_mapping({}).prefix_cache_tokens == 0


async def serve(config: SimConfig, prompts: list[list[int]]) -> list[tuple[float, list[StepEvent]]]:
    """Each prompt in turn, alone on the worker: its first step's modelled seconds (its TTFT, as
    the loop sleeps it) and its events."""
    steps: list[StepStats] = []
    engine = SimEngine(SimSettings(TOKENIZER_DIR, max_slots=8, max_k=4, config=config))
    await engine.start(steps.append)
    out = []
    try:
        for n, prompt in enumerate(prompts):
            before = len(steps)
            request = GenerationRequest(f"r{n}", prompt, max_tokens=20)
            events = [event async for event in engine.generate(request)]
            out.append((steps[before].step_s / config.time_scale, events))
    finally:
        await engine.stop()
    return out


def test_a_turn_whose_prefix_is_cached_starts_sooner_and_says_so() -> None:
    system = ids(3000)
    turn1, turn2 = system + ids(40, start=900), system + ids(40, start=950)
    config = replace(SimConfig(), time_scale=1e-6, prefix_cache_tokens=100_000)
    (cold_s, cold), (warm_s, warm) = asyncio.run(serve(config, [turn1, turn2]))
    assert cold[0].cached_tokens == 0
    assert warm[0].cached_tokens == 3000 - 3000 % BLOCK_TOKENS
    assert all(e.cached_tokens is None for e in warm[1:])  # the first event reports it
    assert warm_s < 0.5 * cold_s
    assert warm[0].cached_tokens is not None and warm[0].cached_tokens > 0

    off = replace(config, prefix_cache_tokens=0)
    (off1_s, off1), (off2_s, off2) = asyncio.run(serve(off, [turn1, turn2]))
    assert off2_s == pytest.approx(cold_s) and off1_s == pytest.approx(cold_s)
    assert all(e.cached_tokens is None for e in off1 + off2)
    # The cache changes timing only: the same tokens either way.
    assert [e.tokens for e in off2] == [e.tokens for e in warm]
