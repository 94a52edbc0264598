"""Prefix reuse: a worker's prompt KV kept after the request, keyed by token blocks.

A prompt is prefilled in position-aligned chunks of ``PREFILL_CHUNK`` tokens, each a fused
forward of its own (``prefill_chunks``), so a chunk's keys and values are the same bits whatever
the prompt's length and whatever came from this cache. That is what makes reuse exact: a
request that finds its first chunks here copies them into its slot and prefills the rest in the
same chunks as a cold run, and its output is the cold run's, greedy and seeded, bit for bit.

Only full chunks of a prompt's fused prefill are kept (never tokens a decode or verification step
computed: those are row-invariant single positions, which a cold prefill computes otherwise).
Each block is keyed by a hash chain (its cache scope, its tokens and its parent's key) and holds
the target's K/V, and the draft's once the draft has caught up on it. The scope is the request's
``cache_salt`` (behind the gateway, the digest of its tenant and salt: gateway/tenancy.py): a
block is found only by a request of the scope that wrote it, compared in full, not by its hash.
The store is bounded in bytes (the tensors' own sizes), one bound for every scope, least recently
used first out; a lookup refreshes a chain from its tail to its head, so a shared system prompt
outlives the conversations that extended it, and a head never goes while its tail stays.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from workers.engines.embedded.forwards import single_row
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sequence import Row, Sequence

# Tokens per prefill chunk and per cached block. Each chunk is a forward of its own that reads every
# weight again, so smaller chunks cost more cold (`python -m bench.prefill_chunks`, SmolLM2-135M
# float32 on the AMX Xeon, one thread: 128 / 256 / 512 took 1.11 / 1.06 / 1.00x the one-shot time at
# 300 tokens and 1.15 / 0.97 / 0.98x at 1,000); larger ones reuse less, because a hit ends at a
# chunk boundary and a conversation's next turn prefills again, on average, half a chunk of what
# it already had. Sessions are what this gateway serves, so reuse wins: in `python -m bench.prefix
# --engine embedded` (5-turn chat, ~530-token prompts at turn 5) 256-token chunks left turn 5's
# TTFT at 0.59x no reuse, over issue 44's 0.5.
PREFILL_CHUNK = 128

BlockKey = int


@dataclass
class Block:
    key: BlockKey
    parent: BlockKey | None
    scope: str  # the cache scope of the request that wrote it ("" the default)
    tokens: tuple[int, ...]
    target: tuple[torch.Tensor, torch.Tensor]  # K, V: (layers, kv_heads, PREFILL_CHUNK, head_dim)
    draft: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        tensors = [*self.target, *(self.draft or ())]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefixStats:
    lookups: int = 0  # requests that looked (a prompt long enough to hold a chunk)
    hits: int = 0  # ...and found at least one chunk
    cached_tokens: int = 0  # prompt tokens not prefilled
    stored_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class PrefixCache:
    """The blocks, by key, least recently used first; ``bound_bytes`` 0 keeps nothing."""

    bound_bytes: int
    chunk: int = PREFILL_CHUNK
    blocks: OrderedDict[BlockKey, Block] = field(default_factory=OrderedDict)
    bytes_held: int = 0
    stats: PrefixStats = field(default_factory=PrefixStats)

    def chain(self, tokens: list[int], blocks: int, scope: str
              ) -> list[tuple[BlockKey, BlockKey | None, tuple[int, ...]]]:
        """(key, parent, tokens) of the first ``blocks`` full chunks of ``tokens`` in ``scope``."""
        out: list[tuple[BlockKey, BlockKey | None, tuple[int, ...]]] = []
        parent: BlockKey | None = None
        for b in range(blocks):
            piece = tuple(tokens[b * self.chunk:(b + 1) * self.chunk])
            key = hash((scope, parent, piece))
            out.append((key, parent, piece))
            parent = key
        return out

    def lookup(self, tokens: list[int], reusable: int, scope: str = "") -> list[Block]:
        """The cached blocks at the start of ``tokens`` that ``scope`` wrote, at most ``reusable``
        tokens' worth."""
        found: list[Block] = []
        if self.bound_bytes <= 0 or reusable < self.chunk:
            return found
        self.stats.lookups += 1
        for key, parent, piece in self.chain(tokens, reusable // self.chunk, scope):
            block = self.blocks.get(key)
            # The scope, tokens and parent, not the hash alone: a collision must not serve other
            # KV, least of all another tenant's.
            if block is None or block.parent != parent or block.scope != scope or block.tokens != piece:
                break
            found.append(block)
        self._refresh(found)
        if found:
            self.stats.hits += 1
            self.stats.cached_tokens += len(found) * self.chunk
        return found

    def store_target(self, tokens: list[int], computed: int, cache: KVCache, slot: int, scope: str = "") -> None:
        """Keeps the target's K/V of the full chunks among ``tokens[:computed]`` (a fused prefill
        just computed them in ``slot``, for a request of ``scope``) that are not held yet."""
        if self.bound_bytes <= 0:
            return
        held: list[Block] = []
        for b, (key, parent, piece) in enumerate(self.chain(tokens, computed // self.chunk, scope)):
            block = self.blocks.get(key)
            if block is None:
                block = Block(key, parent, scope, piece, _copy_out(cache, slot, b * self.chunk, self.chunk))
                # The chain so far most recent, its head last: room comes from other blocks, and
                # from this chain only tail first, so no block is ever kept without its head.
                self._refresh(held)
                if not self._make_room(block.nbytes) or (held and held[-1].key not in self.blocks):
                    break
                self.blocks[key] = block
                self.bytes_held += block.nbytes
                self.stats.stored_blocks += 1
            elif block.parent != parent or block.scope != scope or block.tokens != piece:
                break
            held.append(block)
        self._refresh([h for h in held if h.key in self.blocks])

    def store_draft(self, tokens: list[int], computed: int, cache: KVCache, slot: int, scope: str = "") -> None:
        """Adds the draft's K/V to the held blocks of ``scope`` among ``tokens[:computed]`` that lack it."""
        if self.bound_bytes <= 0:
            return
        held: list[Block] = []
        for key, parent, piece in self.chain(tokens, computed // self.chunk, scope):
            block = self.blocks.get(key)
            if block is None or block.parent != parent or block.scope != scope or block.tokens != piece:
                break
            held.append(block)
        self._refresh(held)  # as in store_target: room from this chain comes tail first
        for b, block in enumerate(held):
            if block.draft is not None:
                continue
            draft = _copy_out(cache, slot, b * self.chunk, self.chunk)
            grow = draft[0].nbytes + draft[1].nbytes
            if not self._make_room(grow) or block.key not in self.blocks:
                break
            block.draft = draft
            self.bytes_held += grow

    def _refresh(self, chain: list[Block]) -> None:
        for block in reversed(chain):  # the tail first: the head ends most recent, evicted last
            self.blocks.move_to_end(block.key)

    def _make_room(self, nbytes: int) -> bool:
        """Evicts least recently used blocks until ``nbytes`` more fit the bound (never held
        over it, even for a moment); False when they never could."""
        if nbytes > self.bound_bytes:
            return False
        while self.bytes_held + nbytes > self.bound_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.bytes_held -= block.nbytes
            self.stats.evicted_blocks += 1
        return True


def _copy_out(cache: KVCache, slot: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.stack([layer[slot, :, start:start + length] for layer in cache.k])
    v = torch.stack([layer[slot, :, start:start + length] for layer in cache.v])
    return k, v


def copy_in(cache: KVCache, slot: int, blocks: list[tuple[torch.Tensor, torch.Tensor]], chunk: int) -> None:
    """Writes blocks' K/V into ``slot`` from position 0 on, one chunk each."""
    for b, (k, v) in enumerate(blocks):
        for layer, (layer_k, layer_v) in enumerate(zip(cache.k, cache.v, strict=True)):
            layer_k[slot, :, b * chunk:(b + 1) * chunk] = k[layer]
            layer_v[slot, :, b * chunk:(b + 1) * chunk] = v[layer]


def prefill_chunks(model: LlamaForCausalLM, cache: KVCache, row: Row, chunk: int,
                   max_positions: int) -> torch.Tensor | None:
    """The row's first ``row.fused`` tokens, fused, in forwards that end at multiples of
    ``chunk`` (the cold run's chunks wherever the row starts: at 0, or after cached chunks).
    Returns the last chunk's logits (``row.n_logits``) when the fused tokens are the whole row;
    None when a row-invariant tail follows (the caller computes it)."""
    end = row.start + row.fused
    whole = row.fused == len(row.new_tokens)
    position, logits = row.start, None
    while position < end:
        stop = min((position // chunk + 1) * chunk, end)
        last = stop == end and whole
        piece = Row(row.slot, position, row.new_tokens[position - row.start:stop - row.start],
                    row.n_logits if last else 0)
        out = single_row(model, cache, piece, False, max_positions)
        if last:
            logits = out
        position = stop
    return logits


def reuse(prefix: PrefixCache, seq: Sequence, target_cache: KVCache, draft_cache: KVCache | None,
          fused_prompt: int) -> None:
    """A new sequence starts from the cached chunks of its prompt's fused part (``fused_prompt``
    tokens; a resumed request's output is computed row-invariant, never reused), leaving at least
    one of them to prefill: the target's K/V, and the draft's as far as the blocks hold it."""
    blocks = prefix.lookup(seq.tokens, fused_prompt - 1, seq.request.cache_scope)
    if not blocks:
        return
    copy_in(target_cache, seq.slot, [b.target for b in blocks], prefix.chunk)
    seq.target_len = seq.cached = len(blocks) * prefix.chunk
    if draft_cache is not None:
        drafted = []
        for block in blocks:
            if block.draft is None:
                break
            drafted.append(block.draft)
        copy_in(draft_cache, seq.slot, drafted, prefix.chunk)
        seq.draft_len = len(drafted) * prefix.chunk
