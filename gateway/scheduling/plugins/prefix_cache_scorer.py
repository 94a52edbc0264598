"""``prefix-cache-scorer`` (GIE's): each worker's expected prefix hit for the request, the share
of the prompt's leading blocks the gateway sent it before times what the worker reports it
holds (``prefix_index.PrefixIndex``). The scorer owns its index: it records each placement in
its pre-request step and each worker's cached-token report in its post-response step, and
forgets a worker that leaves. ``lruCapacityPerServer`` (GIE's name; ``policy.route_index_blocks``)
bounds the blocks kept per worker; 0 turns prefix routing off. The blocks are rooted in the
request's cache scope (``cache_salt``): a request is never placed by a prefix another tenant sent.

A worker that says it keeps no prompt K/V gains nothing from a prefix it was sent before: it
scores 0."""

from __future__ import annotations

from typing import ClassVar

from gateway.scheduling.framework import Candidate, Cycle, Parameters, Scorer
from gateway.scheduling.plugins.prefix_index import PrefixIndex, prompt_blocks


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"
    parameters: ClassVar[Parameters] = {"lruCapacityPerServer": (int, 65536, 0, 1 << 24)}
    lruCapacityPerServer: int = 65536

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.index = PrefixIndex()

    def pre_cycle(self, cycle: Cycle) -> None:
        req = cycle.features.request
        if req is None or self.lruCapacityPerServer <= 0:
            return
        cycle.blocks = blocks = prompt_blocks(req)
        if not blocks:
            return
        index = self.index
        for c in cycle.ready:
            share = index.share(c.worker_id, blocks)
            if share:
                cycle.shares[c.worker_id] = share
                if c.prefix_cache is not False:
                    cycle.hits[c.worker_id] = share * index.hold(c.worker_id)

    def score(self, cycle: Cycle, endpoints: list[Candidate]) -> list[float]:
        hits = cycle.hits
        return [hits.get(c.worker_id, 0.0) for c in endpoints]

    def pre_request(self, cycle: Cycle, worker_id: str) -> None:
        self.index.record(worker_id, cycle.blocks, self.lruCapacityPerServer)

    def post_response(self, worker_id: str, share: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.index.observe(worker_id, share, prompt_tokens, cached_tokens)

    def forget(self, worker_id: str) -> None:
        self.index.forget(worker_id)
