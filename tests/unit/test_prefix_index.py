"""The gateway's approximate prefix index (gateway/scheduling/plugins/prefix_index.py): blocks, hits, the bound."""

from __future__ import annotations

from gateway.scheduling.plugins.prefix_index import BLOCK_CHARS, PrefixIndex, prompt_blocks
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
    assert index.share("w0", turn1) == 1.0
    assert 0.0 < index.share("w0", turn2) < 1.0 and index.share("w0", turn2) == sum(
        1 for key in turn2 if key in set(turn1)) / len(turn2)
    assert index.share("w1", turn1) == 0.0 and index.share("w0", ()) == 0.0


def test_each_worker_keeps_at_most_its_bound_least_recently_used_first() -> None:
    index = PrefixIndex()
    old, new = chat("a" * BLOCK_CHARS * 6), chat("b" * BLOCK_CHARS * 6)
    index.record("w0", old, 8)
    index.record("w0", new, 8)
    assert index.sizes() == {"w0": 8}
    assert index.share("w0", new) == 1.0 and index.share("w0", old) == 0.0  # old's first blocks went first
    index.record("w0", chat("c" * BLOCK_CHARS * 100), 8)  # longer than the bound: its last 8 kept
    assert index.sizes() == {"w0": 8}
    index.forget("w0")
    assert index.sizes() == {} and index.share("w0", new) == 0.0
    off = PrefixIndex()
    off.record("w0", new, 0)
    assert off.sizes() == {}


def test_the_hold_learns_what_a_worker_reports_it_served_from_its_cache() -> None:
    index = PrefixIndex()
    turn1 = chat(SYSTEM, "When did it open? " * 8)
    turn2 = chat(SYSTEM, "When did it open? " * 8 + "And how long is it? " * 8)
    for worker in ("keeps", "forgets"):
        index.record(worker, turn1, 1000)
    share = index.share("keeps", turn2)
    assert index.hold("keeps") == 1.0  # no reports: as indexed
    # A request the index expected nothing of says nothing (and an unknown worker is ignored).
    index.observe("keeps", 0.0, 400, 0)
    index.observe("gone", share, 400, 0)
    assert (index.hold("keeps"), index.hold("forgets")) == (1.0, 1.0)
    for _ in range(20):
        index.observe("keeps", share, 400, 400)  # more than expected counts as expected: hold <= 1
        index.observe("forgets", share, 400, 0)  # a cache that is off, or restarted empty
    assert index.hold("keeps") == 1.0
    assert index.hold("forgets") < 0.05
    # One miss of a short prompt does not cut a worker off; a worker that serves again recovers.
    fresh = PrefixIndex()
    fresh.record("w", turn1, 1000)
    fresh.observe("w", 0.5, 40, 0)
    assert fresh.hold("w") > 0.9
    for _ in range(30):
        index.observe("forgets", share, 400, int(share * 400))
    assert index.hold("forgets") > 0.9
    index.forget("forgets")
    assert index.hold("forgets") == 1.0 and "forgets" not in index.sizes()


def test_a_coarser_cache_holds_its_share() -> None:
    # A worker that caches whole 128-token chunks serves 256 of an expected 300: its hold says so.
    index = PrefixIndex()
    index.record("w", chat(SYSTEM), 1000)
    for _ in range(50):
        index.observe("w", 0.75, 400, 256)
    assert abs(index.hold("w") - 256 / 300) < 0.01
