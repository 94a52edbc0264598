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
(a record refreshes a key). A worker that leaves the fleet is forgotten.

**Learned from the workers.** What the index expects is checked against what each worker reports
it served from its cache (``usage.prompt_tokens_details.cached_tokens``: a specgate worker's
first step report, a vLLM server's usage): ``observe`` keeps, per worker, the decayed sums of the
prompt tokens the index expected to be cached and of those the worker reported; their ratio is
the worker's *hold* (0..1), and a request's expected hit there is its ``share`` × the ``hold``
(gateway/placement.py). A worker whose cache is off
or smaller than the index assumes, one that restarted empty, or one whose cache works in coarser
blocks than the index's (the embedded engine caches 128-token chunks) scores what it really
serves; a worker that holds what the index expected keeps a hold near 1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from workers.api.wire import CompletionRequest

BLOCK_CHARS = 128  # a block: about 32 tokens of English text
MAX_BLOCKS_PER_REQUEST = 1024  # 128 K characters: the rest of a longer prompt is not indexed
# The hold's prior, in tokens on both sides: a worker without reports holds what the index
# expects, and one miss of a short prompt does not cut a worker off. It decays with the reports,
# so a worker that never serves from a cache ends with a hold near 0.
HOLD_PRIOR_TOKENS = 256.0
# Each report's weight against the ones before: the last ~10 reports of a worker dominate, so a
# worker that restarted empty is trusted again once its reports show it holds prefixes again.
HOLD_DECAY = 0.9
_PRIOR = (HOLD_PRIOR_TOKENS, HOLD_PRIOR_TOKENS)


def prompt_blocks(req: CompletionRequest) -> tuple[int, ...]:
    """The hash chain of a request's prompt text in blocks (a trailing partial block left out:
    it would never match a longer prompt's full block), rooted in its cache scope
    (``cache_salt``, gateway/tenancy.py): another scope's same prompt has other keys, so a
    request is never placed by a prefix another tenant sent."""
    if req.kind == "chat":
        text = "".join(f"\x1e{m.role}\x1f{m.content}" for m in req.messages)
    elif isinstance(req.prompt, str):
        text = req.prompt
    elif isinstance(req.prompt, list):  # token ids: indexed as their decimal text
        text = ",".join(map(str, req.prompt))
    else:
        text = ""
    keys: list[int] = []
    key = 0 if req.cache_salt is None else hash(req.cache_salt)
    for start in range(0, min(len(text) // BLOCK_CHARS, MAX_BLOCKS_PER_REQUEST) * BLOCK_CHARS, BLOCK_CHARS):
        key = hash((key, text[start:start + BLOCK_CHARS]))
        keys.append(key)
    return tuple(keys)


class PrefixIndex:
    def __init__(self) -> None:
        self._by_worker: dict[str, OrderedDict[int, None]] = {}
        # Per worker: decayed (expected cached tokens, reported cached tokens), over requests the
        # index expected a hit for.
        self._reports: dict[str, tuple[float, float]] = {}

    def share(self, worker_id: str, blocks: Sequence[int]) -> float:
        """The share of ``blocks`` the gateway sent the worker before: its leading blocks up to
        the first it has not seen (0 for an empty prompt)."""
        seen = self._by_worker.get(worker_id)
        if not blocks or not seen:
            return 0.0
        matched = 0
        for key in blocks:
            if key not in seen:
                break
            matched += 1
        return matched / len(blocks)

    def hold(self, worker_id: str) -> float:
        """The share of the index's expected cached tokens that the worker reported cached, of
        late (1 without reports)."""
        expected, reported = self._reports.get(worker_id, _PRIOR)
        return reported / expected

    def observe(self, worker_id: str, share: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A worker's report for a request placed there when ``share`` (``share``'s value then)
        of its prompt was in the index: ``cached_tokens`` of its ``prompt_tokens`` came from the
        worker's cache. Requests the index expected nothing of say nothing of the index."""
        if share <= 0.0 or prompt_tokens <= 0 or worker_id not in self._by_worker:
            return
        expected_now = share * prompt_tokens
        expected, reported = self._reports.get(worker_id, _PRIOR)
        # More than expected (the index's partial last block, or a prefix the index evicted):
        # counted as expected, so the hold stays at most 1.
        self._reports[worker_id] = (HOLD_DECAY * expected + expected_now,
                                    HOLD_DECAY * reported + min(float(max(cached_tokens, 0)), expected_now))

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
        self._reports.pop(worker_id, None)

    def sizes(self) -> dict[str, int]:
        """Keys held per worker."""
        return {worker: len(keys) for worker, keys in self._by_worker.items()}
