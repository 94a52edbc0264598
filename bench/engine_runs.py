"""bench.engine's runs: engines taking turns on the same prompts, and single forwards timed.

What ``bench/engine.py`` measures with, apart from what it reports.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from policies import tested_drafts
from policies.methods import Method
from policies.tree import TreeShape
from workers.costs.online import OnlineCosts
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.forwards import native_forward
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.runner import fold_step
from workers.engines.embedded.sampling import SamplingParams


@dataclass(frozen=True)
class RunResult:
    tokens: int
    seconds: float
    proposed: int
    accepted: int
    tested: int
    draft_seconds: float = 0.0  # of ``seconds``, spent proposing drafts
    target_seconds: float = 0.0  # of ``seconds``, in the target's forwards of decode steps
    prefill_seconds: float = 0.0  # of ``seconds``, in steps that prefilled a prompt (alike in every mode)
    steps: int = 0  # decode steps (steps without a prefill)

    def __add__(self, other: RunResult) -> RunResult:
        return RunResult(self.tokens + other.tokens, self.seconds + other.seconds, self.proposed + other.proposed,
                         self.accepted + other.accepted, self.tested + other.tested,
                         self.draft_seconds + other.draft_seconds, self.target_seconds + other.target_seconds,
                         self.prefill_seconds + other.prefill_seconds, self.steps + other.steps)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested if self.tested else float("nan")

    @property
    def draft_share(self) -> float:
        return self.draft_seconds / self.seconds

    @property
    def decode_tok_s(self) -> float:
        """Tokens/s without the prefills' time (a prompt's prefill is the same in every mode)."""
        return self.tokens / (self.seconds - self.prefill_seconds)

    def per_step_ms(self) -> dict[str, float]:
        """Where a decode step's time went, in ms a step: the target's forward, the drafts'
        (with their bookkeeping), the rest; and the prefills' share of all the time."""
        steps = max(1, self.steps)
        decode = self.seconds - self.prefill_seconds
        return {"step": round(1000 * decode / steps, 3), "target": round(1000 * self.target_seconds / steps, 3),
                "drafts": round(1000 * self.draft_seconds / steps, 3),
                "rest": round(1000 * (decode - self.target_seconds - self.draft_seconds) / steps, 3),
                "prefill_share": round(self.prefill_seconds / self.seconds, 3)}


class RequestPlan(Protocol):
    """How one of run_interleaved's engines asks for each request (a token tree, or K chosen
    per request by the policy) and hears what its steps did."""

    def request(self, index: int, ids: list[int]) -> tuple[int, TreeShape | None]: ...

    def observe(self, event: StepEvent) -> None: ...


def add_group(engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int, k: int, temperature: float,
              seed: int | None, plan: RequestPlan | None = None, method: Method = "draft") -> None:
    """``seed`` None: unseeded requests (standard speculative sampling; the engine's rng is fixed)."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=None if seed is None else seed + i)
        k_i, tree = (k, None) if plan is None else plan.request(i, ids)
        engine.add(GenerationRequest(f"r{i}", ids, max_tokens, params, k=k_i, tree=tree, method=method))


def run_batch(engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int, k: int,
              temperature: float, seed: int | None = 0) -> RunResult:
    """All prompts at once (batch = len(prompts)), each to max_tokens or EOS."""
    return run_interleaved({k: engine}, [prompts], max_tokens, temperature, seed)[0][k]


def run_interleaved(engines: dict[int, SpeculativeEngine], groups: list[list[list[int]]], max_tokens: int,
                    temperature: float, seed: int | None = 0, costs: OnlineCosts | None = None,
                    drafted: dict[int, dict[int, int]] | None = None, unfolded: frozenset[int] = frozenset(),
                    plans: Mapping[int, RequestPlan] | None = None, methods: Mapping[int, Method] | None = None,
                    ) -> tuple[dict[int, RunResult], dict[int, list[list[int]]]]:
    """Each group of prompts as one batch, one group after another, under every K at once.

    Each K has its own engine (sharing the models) and the engines take turns a step at a
    time: next is the one that has emitted the fewest tokens of the group so far, ties broken
    in a seeded shuffled order. So they move through the group together (at T=0 they emit the
    same tokens) and finish it together, and a noisy neighbour's slow second, and the cache
    state the previous engine left, land on all configurations alike: the ratios between them
    stay meaningful on a shared machine. (With one step each per round, the speculative
    engines finished a prompt in a quarter of the plain engine's steps, and the plain engine
    then ran alone, back to back, with more of its weights in the cache. A worker's cost model
    refined from those steps, ``costs``, took its plain step from that phase and its
    verifications from the shared one: ``predicted_speedup_b1`` came out 16% over and 12%
    under the measured speed-up in two runs of the same code.) Prefill is in the first
    step's time. Returns the totals per K and each K's output tokens per prompt, in order.
    A negative key is one more plain engine (the noise between two engines doing the same
    work). ``costs`` hears every step, as a worker's online cost refinement does; ``drafted`` gets,
    per K, how many sequence-steps drafted each number of tokens (what ran, after every rule).
    ``unfolded``: keys whose steps ``costs`` does not hear (an engine on another configuration).
    ``plans``: keys whose requests a plan makes (trees, the policy's choice), and which hear their steps.
    ``methods``: keys whose requests propose with another method than the draft model (``eagle3``).
    """
    plans = plans or {}
    totals = {k: RunResult(0, 0.0, 0, 0, 0) for k in engines}
    outputs: dict[int, list[list[int]]] = {k: [] for k in engines}
    for g, group in enumerate(groups):
        for k, engine in engines.items():
            add_group(engine, group, max_tokens, max(0, k), temperature, None if seed is None else seed + g,
                      plans.get(k), (methods or {}).get(k, "draft"))
        produced: dict[int, dict[str, list[int]]] = {k: {f"r{i}": [] for i in range(len(group))} for k in engines}
        emitted = dict.fromkeys(engines, 0)
        order = list(engines.items())
        shuffle = random.Random(g)
        while any(engine.has_work for engine in engines.values()):
            # Ties in a fresh order each time: with a fixed order, the engine that always ran
            # after a speculative one (whose draft evicts part of the target's weights from the
            # cache) paid for it every step; of two engines doing the same plain work, the one
            # that followed the speculative engine was up to 10% slower for a whole batched run.
            shuffle.shuffle(order)
            k, engine = min(((k, e) for k, e in order if e.has_work), key=lambda item: emitted[item[0]])
            started = time.perf_counter()
            events = engine.step()
            elapsed = time.perf_counter() - started
            if costs is not None and k not in unfolded:
                fold_step(costs, engine, events, elapsed)  # as a worker does; the step's whole time
            counts = drafted.setdefault(k, {}) if drafted is not None else None
            plan = plans.get(k)
            for event in events:
                if plan is not None:
                    plan.observe(event)
                produced[k][event.request_id].extend(event.tokens)
                emitted[k] += len(event.tokens)
                if counts is not None:
                    counts[event.proposed] = counts.get(event.proposed, 0) + 1
                totals[k] += RunResult(len(event.tokens), 0.0, event.proposed, event.accepted,
                                       tested_drafts(event.proposed, event.accepted))
            if engine.last_shape.prefill:
                totals[k] += RunResult(0, elapsed, 0, 0, 0, prefill_seconds=elapsed)
            else:
                totals[k] += RunResult(0, elapsed, 0, 0, 0, engine.last_draft_s, engine.last_target_s, steps=1)
        for k in engines:
            outputs[k].extend(produced[k][f"r{i}"] for i in range(len(group)))
    return totals, outputs


OTHER_PLAIN = -2  # run_interleaved's key for plain decoding on the other kernel configuration


def forward_times(models: dict[str, tuple[LlamaForCausalLM, int]], drafts: tuple[LlamaForCausalLM, ...], reps: int,
                  context: int = 128) -> dict[str, float]:
    """Seconds per cached forward at batch 1 after ``context`` tokens, for each (model, new tokens).

    The configurations take turns, one forward each, so machine noise hits them alike. Like the
    engine, drafts skip row-invariant attention (only the target's rows must be exact).
    """
    setups = {}
    for name, (model, tokens) in models.items():
        cache = KVCache.allocate(model.cfg, 1, model.lm_head.weight.dtype)
        setups[name] = (model, cache, torch.zeros((1, tokens), dtype=torch.long), tokens)
    totals = dict.fromkeys(models, 0.0)
    with torch.inference_mode():
        for i in range(reps + 5):
            for name, (model, cache, new, tokens) in setups.items():
                started = time.perf_counter()
                row_invariant = all(model is not d for d in drafts)
                # As the engine runs a forward: from lists into the one-call kernel where it can.
                if native_forward(model, cache, [[0] * tokens], [0], [context], list(range(tokens)),
                                  row_invariant) is None:
                    batch = CacheBatch.build([0], [context], [tokens], tokens, model.cfg.max_position_embeddings,
                                             row_invariant=row_invariant)
                    model.forward_cached(new, cache, batch, torch.zeros(tokens, dtype=torch.long),
                                         torch.arange(tokens))
                if i >= 5:  # after warm-up
                    totals[name] += time.perf_counter() - started
    return {name: total / reps for name, total in totals.items()}


def prefill_times(target: LlamaForCausalLM, prompt_tokens: list[int], reps: int,
                  only_served: bool = False) -> dict[str, dict[str, float]]:
    """Seconds to prefill a prompt of each length at batch 1 as the engine does (fused, not
    row-invariant: the one-call kernel up to ``native_attention_max_tokens``, SDPA beyond) and
    with SDPA attention in the per-op path (what served prefills longer than 16 tokens before),
    taking turns; ``only_served``: as the engine does only."""
    positions = max(prompt_tokens) + 1  # the prompts' span, not the model's window (SmolLM2's: 377 MB a slot)
    cache = KVCache.allocate(target.cfg, 1, target.lm_head.weight.dtype, positions)
    served = target.native_attention_max_tokens
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for n in prompt_tokens:
            prompt = torch.randint(5, target.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
            totals = {"served": 0.0} if only_served else {"served": 0.0, "sdpa": 0.0}
            for i in range(reps + 1):
                for name in totals:
                    target.native_attention_max_tokens = served if name == "served" else 0
                    started = time.perf_counter()
                    batch = CacheBatch.build([0], [0], [n], n, positions, row_invariant=False)
                    target.forward_cached(prompt, cache, batch, torch.zeros(1, dtype=torch.long), torch.tensor([n - 1]))
                    if i >= 1:
                        totals[name] += time.perf_counter() - started
            target.native_attention_max_tokens = served
            out[str(n)] = {name: total / reps for name, total in totals.items()}
    return out
