"""Which worker has seen which prompt prefixes: the gateway's approximate, bounded index.

The gateway knows no tokenizer, so it indexes prompt *text*: a request's messages (role and
content) or prompt, in blocks of ``BLOCK_CHARS`` characters, each block's key a hash of the
block and the key before it (a hash chain, so a key stands for the whole prefix up to it). After
a request goes to a worker, its keys are recorded under that worker; a new request's expected
prefix hit on a worker is the share of its leading blocks found there, up to the first miss.
That is what SGLang's router keeps in a radix tree of characters and llm-d's picker in a per-pod
LRU of block hashes: an estimate from the gateway's own routing, not the worker's cache (which
may have evicted the prefix, or, behind another router, hold more).

Bounded: each worker keeps at most ``max_blocks`` keys (the live policy's ``route_index_blocks``,
given with each record), the least recently used evicted first
(a hit or a record refreshes a key). A worker that leaves the fleet is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from workers.api.wire import CompletionRequest

BLOCK_CHARS = 128  # a block: about 32 tokens of English text
MAX_BLOCKS_PER_REQUEST = 1024  # 128 K characters: the rest of a longer prompt is not indexed


def prompt_blocks(req: CompletionRequest) -> tuple[int, ...]:
    """The hash chain of a request's prompt text in blocks (a trailing partial block left out:
    it would never match a longer prompt's full block)."""
    if req.kind == "chat":
        text = "".join(f"\x1e{m.role}\x1f{m.content}" for m in req.messages)
    elif isinstance(req.prompt, str):
        text = req.prompt
    elif isinstance(req.prompt, list):  # token ids: indexed as their decimal text
        text = ",".join(map(str, req.prompt))
    else:
        text = ""
    keys: list[int] = []
    key = 0
    for start in range(0, min(len(text) // BLOCK_CHARS, MAX_BLOCKS_PER_REQUEST) * BLOCK_CHARS, BLOCK_CHARS):
        key = hash((key, text[start:start + BLOCK_CHARS]))
        keys.append(key)
    return tuple(keys)


class PrefixIndex:
    def __init__(self) -> None:
        self._by_worker: dict[str, OrderedDict[int, None]] = {}

    def hit(self, worker_id: str, blocks: Sequence[int]) -> float:
        """The share of ``blocks`` the worker is expected to hold: its leading blocks up to the
        first it has not seen (0 for an empty prompt)."""
        seen = self._by_worker.get(worker_id)
        if not blocks or not seen:
            return 0.0
        matched = 0
        for key in blocks:
            if key not in seen:
                break
            matched += 1
        return matched / len(blocks)

    def record(self, worker_id: str, blocks: Sequence[int], max_blocks: int) -> None:
        """The worker now holds ``blocks`` (it was sent the request), most recent last."""
        if max_blocks <= 0 or not blocks:
            return
        seen = self._by_worker.setdefault(worker_id, OrderedDict())
        for key in blocks[-max_blocks:]:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > max_blocks:
            seen.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)

    def sizes(self) -> dict[str, int]:
        """Keys held per worker."""
        return {worker: len(keys) for worker, keys in self._by_worker.items()}
