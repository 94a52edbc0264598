"""The sim worker's prefix cache: which token blocks a GPU worker still holds KV for. Pure: no clock, no I/O.

A vLLM-style automatic prefix cache, modelled by its keys alone (the sim has no KV to keep): a
sequence's tokens in blocks of ``BLOCK_TOKENS``, each block's key a hash of its tokens and the
key before it (a hash chain, so a key stands for the whole prefix up to it). A request's cached
prefix is its leading blocks found here, up to the first miss; the engine charges prefill only
for the rest (``SimEngine._seq``). The bound is in tokens (``workers.sim.prefix_cache_tokens``):
past it the least recently used blocks go first, a chain's last block before its first (so a
shared system prompt outlives the conversations that extended it, as vLLM frees a request's
blocks tail first). 0 tokens: no cache, every request prefills its whole prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16  # vLLM's default KV block size


def block_keys(token_ids: Sequence[int], scope: str = "") -> list[int]:
    """The hash chain of ``token_ids``'s full blocks (a trailing partial block is never cached:
    vLLM caches full blocks only), rooted in the request's cache scope as vLLM roots its first
    block's hash in the request's ``cache_salt``: another scope's same tokens have other keys."""
    keys: list[int] = []
    key = hash(("scope", scope)) if scope else 0
    for start in range(0, len(token_ids) - len(token_ids) % BLOCK_TOKENS, BLOCK_TOKENS):
        key = hash((key, tuple(token_ids[start:start + BLOCK_TOKENS])))
        keys.append(key)
    return keys


@dataclass
class PrefixCacheStats:
    """Counters since start (``/specgate/worker``'s ``sim.prefix_cache``)."""

    lookups: int = 0
    hits: int = 0  # lookups that found at least one block
    cached_tokens: int = 0  # prompt tokens whose prefill was skipped
    prompt_tokens: int = 0  # prompt tokens looked up
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_blocks = max(0, max_tokens) // BLOCK_TOKENS
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def tokens_held(self) -> int:
        return len(self._blocks) * BLOCK_TOKENS

    def lookup(self, prompt_ids: Sequence[int], scope: str = "") -> int:
        """Prompt tokens already cached: its leading blocks held here, up to the first miss. At
        least one prompt token is always left to prefill (its logits make the first output
        token), so a prompt cached whole gives back its last block. The hit blocks become the
        most recently used."""
        if not self.enabled:
            return 0
        matched: list[int] = []
        for key in block_keys(prompt_ids, scope):
            if key not in self._blocks:
                break
            matched.append(key)
        if matched and len(matched) * BLOCK_TOKENS >= len(prompt_ids):
            matched.pop()
        self._touch(matched)
        cached = len(matched) * BLOCK_TOKENS
        self.stats.lookups += 1
        self.stats.hits += cached > 0
        self.stats.cached_tokens += cached
        self.stats.prompt_tokens += len(prompt_ids)
        return cached

    def insert(self, token_ids: Sequence[int], scope: str = "") -> None:
        """The worker now holds KV for ``token_ids``'s full blocks (a prompt once prefilled; a
        prompt and its output once finished), in the request's cache scope."""
        if not self.enabled:
            return
        keys = block_keys(token_ids, scope)[:self.max_blocks]  # a sequence longer than the cache keeps its head
        self._touch(keys)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.stats.evicted_blocks += 1

    def _touch(self, keys: Sequence[int]) -> None:
        # Last block first, so a chain's head ends most recent and its tail is evicted first.
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)

    def view(self, kv_bytes_per_token: float) -> dict[str, int | float]:
        s = self.stats
        return {"max_tokens": self.max_blocks * BLOCK_TOKENS, "tokens_held": self.tokens_held,
                "bytes_held": int(self.tokens_held * kv_bytes_per_token), "lookups": s.lookups, "hits": s.hits,
                "cached_tokens": s.cached_tokens, "prompt_tokens": s.prompt_tokens,
                "hit_token_share": round(s.cached_tokens / s.prompt_tokens, 4) if s.prompt_tokens else 0.0,
                "evicted_blocks": s.evicted_blocks}
