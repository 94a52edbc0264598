"""The gateway's approximate prefix index (gateway/fleet/prefix_index.py): blocks, hits, the bound."""

from __future__ import annotations

from gateway.fleet.prefix_index import BLOCK_CHARS, PrefixIndex, prompt_blocks
from workers.api.request_parser import parse_request

SYSTEM = "You answer questions about the Hollins Bridge. " * 20  # 940 characters: 7 blocks of its own


def chat(*contents: str) -> tuple[int, ...]:
    messages = [{"role": "system" if i == 0 else "user", "content": c} for i, c in enumerate(contents)]
    return prompt_blocks(parse_request("chat", {"model": "m", "messages": messages}))


def test_blocks_are_a_hash_chain_of_the_prompt_text() -> None:
    a, b = chat(SYSTEM, "When did it open?"), chat(SYSTEM, "How long is it? " * 10)
    shared = len(SYSTEM) // BLOCK_CHARS
    assert a[:shared] == b[:shared]  # the same system prompt: the same leading keys
    assert chat("x" * 10) == ()  # shorter than a block: nothing to index
    # A key stands for the whole prefix: the same block after a different start has another key.
    assert chat("y" + SYSTEM)[-1] not in set(a)
    completion = prompt_blocks(parse_request("completion", {"model": "m", "prompt": SYSTEM}))
    assert len(completion) == len(SYSTEM) // BLOCK_CHARS


def test_the_hit_is_the_leading_share_seen() -> None:
    index = PrefixIndex()
    turn1 = chat(SYSTEM, "When did it open? " * 8)
    turn2 = chat(SYSTEM, "When did it open? " * 8 + "And how long is it? " * 8)
    index.record("w0", turn1, 1000)
    assert index.hit("w0", turn1) == 1.0
    assert 0.0 < index.hit("w0", turn2) < 1.0 and index.hit("w0", turn2) == sum(
        1 for key in turn2 if key in set(turn1)) / len(turn2)
    assert index.hit("w1", turn1) == 0.0 and index.hit("w0", ()) == 0.0


def test_each_worker_keeps_at_most_its_bound_least_recently_used_first() -> None:
    index = PrefixIndex()
    old, new = chat("a" * BLOCK_CHARS * 6), chat("b" * BLOCK_CHARS * 6)
    index.record("w0", old, 8)
    index.record("w0", new, 8)
    assert index.sizes() == {"w0": 8}
    assert index.hit("w0", new) == 1.0 and index.hit("w0", old) == 0.0  # old's first blocks went first
    index.record("w0", chat("c" * BLOCK_CHARS * 100), 8)  # longer than the bound: its last 8 kept
    assert index.sizes() == {"w0": 8}
    index.forget("w0")
    assert index.sizes() == {} and index.hit("w0", new) == 0.0
    off = PrefixIndex()
    off.record("w0", new, 0)
    assert off.sizes() == {}
