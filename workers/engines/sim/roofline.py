"""The simulated GPU deployment: a step-time roofline and an acceptance model. Pure: no clock, no I/O.

One module, two users: the sim worker engine (``workers/engines/sim/engine.py``) sleeps for the step
times it computes, and ``bench.policy``'s virtual-time fleet advances a simulated clock by them.
Both step their batches with ``SimBatch`` below, so the live system and the simulation share
every number. See docs/sim.md for the model, its calibration and its limits.

- **Step time** (``StepCost.step_time``): a forward pass costs a fixed overhead plus
  max(bytes moved / achieved bandwidth, FLOPs / achieved FLOP/s). Bytes are the weights (read
  once per forward, whatever the batch) plus each sequence's KV cache; FLOPs are 2 × parameters
  per token. A speculative step runs the draft K times over the drafting sequences, then the
  target once over sum(K_i + 1) tokens. Prefill tokens ride along in the target forward.
- **Acceptance**: each request has a per-token α, from its prompt's category and its
  temperature (``AcceptanceTable``). A step's accepted drafts are i.i.d. Bernoulli(α) trials
  truncated at the first rejection and capped at K, as speculative sampling produces them.
- **Lookup methods** (prompt lookup, suffix match; ``SimSeq.lookup``): a step finds a match with
  the request's coverage and then proposes its K as point masses, accepted as the draft's are
  (α per method and workload, ``AcceptanceTable.lookup_alpha``); proposing costs no draft
  forward, only the target's verification of the K + 1 tokens. A step without a match is plain.
- **Token trees** (``trees.py``): a sequence may draft a tree (``SimSeq.tree``); its rank-r
  children are accepted with the calibrated rank acceptances, its draft forwards run over each
  level's nodes and the target verifies the root and every node in its row.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.speculation import step_depth
from policies.tree import StepPath, TreeShape
from workers.api.sim_config import Efficiency, Facts, ModelShape, SimConfig, alpha_from_rate
from workers.costs.online import AcceptanceEstimate, StepCostRule
from workers.engines.sim.trees import (
    ASSUMED_TREE,
    CALIBRATED_ALPHA,
    CHAIN_ACCEPTANCE,
    RANK_RATIO,
    TREE_ACCEPTANCE,
    betas_for,
    fed_widths,
    rank1_tests,
    sample_path,
    truncated,
)

GB, TFLOP = 1e9, 1e12  # units


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average: accepted drafts plus the target's own, (1 − α^(K+1))/(1 − α)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def sample_accepted(rng: random.Random, log_alpha: float, k: int) -> int:
    """Accepted drafts of one step: Bernoulli(α) trials up to the first rejection, capped at K.

    P(n ≥ j) = α^j, so n = floor(ln(1 − u) / ln α) for one uniform u: one draw per step.
    ``log_alpha`` is ln α (−inf for α = 0, 0 for α = 1).
    """
    if k <= 0 or log_alpha == -math.inf:
        return 0
    if log_alpha >= 0.0:
        return k
    return min(k, int(math.log(1.0 - rng.random()) / log_alpha))


def config_summary(config: SimConfig) -> dict[str, Any]:
    """What ``/specgate/worker`` shows: the modelled deployment and its calibration."""
    cost = StepCost(config)
    return {"sim": {
        "target_params_b": config.target.params / 1e9,
        "draft_params_b": config.draft.params / 1e9 if config.draft else None,
        "gpus": config.hardware.gpus, "bandwidth_gb_s_per_gpu": config.hardware.bandwidth_gb_s,
        "peak_tflops_per_gpu": config.hardware.peak_tflops,
        "efficiency": vars(config.efficiency), "time_scale": config.time_scale,
        "prefix_cache_tokens": config.prefix_cache_tokens,
        "plain_step_ms_b1": round(1000 * cost.step_time([0], [1024])[0], 3),
        "acceptance": {c: [[t if math.isfinite(t) else None, round(a, 4)] for t, a in b]
                       for c, b in config.acceptance.bands.items()},
        "default_category": config.acceptance.default_category,
        "lookup": {m: {c: {"coverage": round(cell.coverage, 4), "acceptance": [
                           [t if math.isfinite(t) else None, round(a, 4)] for t, a in cell.bands]}
                       for c, cell in cells.items()} for m, cells in config.acceptance.lookup.items()},
        "trees": {"max_nodes": config.tree_max_nodes, "rank_ratio": round(RANK_RATIO, 4),
                  "calibration": {"chain": CHAIN_ACCEPTANCE, "tree": TREE_ACCEPTANCE, "tree_shape": str(ASSUMED_TREE),
                                  "alpha": round(CALIBRATED_ALPHA, 4)}},
    }}


class StepCost:
    """The roofline with the config's achieved bandwidth, FLOP/s and per-forward overhead."""

    def __init__(self, config: SimConfig) -> None:
        hw, eff = config.hardware, config.efficiency
        self.target, self.draft = config.target, config.draft
        self.bandwidth = hw.gpus * hw.bandwidth_gb_s * GB * eff.bandwidth_fraction
        self.flops = hw.gpus * hw.peak_tflops * TFLOP * eff.flops_fraction
        self.prefill_flops = hw.gpus * hw.peak_tflops * TFLOP * eff.prefill_flops_fraction
        self.overhead = eff.forward_overhead_ms / 1000

    def forward(self, shape: ModelShape, tokens: int, kv_tokens: int, prefill_tokens: int = 0) -> float:
        memory = (shape.weight_bytes + kv_tokens * shape.kv_bytes_per_token) / self.bandwidth
        compute = 2 * shape.params * (tokens / self.flops + prefill_tokens / self.prefill_flops)
        return self.overhead + max(memory, compute)

    def step_time(self, ks: Sequence[int], contexts: Sequence[int], prefill_tokens: int = 0,
                  trees: Sequence[TreeShape | None] | None = None,
                  lookup: Sequence[bool] | None = None) -> tuple[float, float]:
        """(step seconds, of which the target's verification) for sequences with K_i drafts and
        context_i cached tokens; ``prefill_tokens`` prompt tokens processed alongside. ``trees``
        (one per sequence, None for a chain): a sequence's token tree of depth K_i, whose draft
        forward d runs over its level d - 1 nodes and whose nodes all ride in the verification.
        ``lookup`` (one per sequence): its K_i proposals came from a lookup (prompt lookup, suffix
        match), so they ride in the verification but run no draft forward."""
        if not ks and not prefill_tokens:
            return 0.0, 0.0
        shapes = [None] * len(ks) if trees is None else [t if k > 0 else None for t, k in zip(trees, ks, strict=True)]
        verified = sum(1 + (shape.nodes if shape is not None else k) for k, shape in zip(ks, shapes, strict=True))
        drafted = ks if lookup is None else [0 if is_lookup else k for k, is_lookup in zip(ks, lookup, strict=True)]
        verify_s = self.forward(self.target, verified, sum(contexts), prefill_tokens)
        return self._draft_time(drafted, contexts, shapes) + verify_s, verify_s

    def _draft_time(self, ks: Sequence[int], contexts: Sequence[int], shapes: Sequence[TreeShape | None]) -> float:
        """The draft forwards of a step: forward j runs over what each sequence drafting more than
        j tokens feeds it (one token for a chain, a tree's level j - 1 nodes)."""
        kmax = max(ks, default=0)
        if kmax <= 0 or self.draft is None:
            return 0.0
        draft = self.draft
        if all(shape is None for shape in shapes):  # chains: counted by K (the virtual fleet's hot path)
            count, ctx = [0] * (kmax + 1), [0] * (kmax + 1)
            for k, c in zip(ks, contexts, strict=True):
                count[k] += 1
                ctx[k] += c
            n = kv_sum = 0
            draft_s = 0.0
            for j in range(kmax, 0, -1):
                n, kv_sum = n + count[j], kv_sum + ctx[j]
                draft_s += self.forward(draft, n, kv_sum)
            return draft_s
        tokens = [0] * kmax
        kv = [0] * kmax
        for k, c, shape in zip(ks, contexts, shapes, strict=True):
            for j, width in enumerate(fed_widths(shape, k)):
                tokens[j] += width
                kv[j] += c
        return sum(self.forward(draft, n, c) for n, c in zip(tokens, kv, strict=True))


# -- fitting --------------------------------------------------------------------------------------------
def gain(config: SimConfig, alpha: float, batch: int, k: int, context: int) -> float:
    """Speculation's throughput gain at ``batch`` sequences of ``context`` tokens, all at K and α."""
    cost = StepCost(config)
    plain, _ = cost.step_time([0] * batch, [context] * batch)
    spec, _ = cost.step_time([k] * batch, [context] * batch)
    return expected_tokens(alpha, k) * plain / spec


def fit_efficiency(config: SimConfig, facts: Facts) -> Efficiency:
    """Bandwidth fraction, FLOP/s fraction and per-forward overhead that meet all three facts.

    At batch 1 both steps are memory-bound (checked below), so the two speeds are linear in the
    overhead t0 and 1/bandwidth x: plain = t0 + M_t·x; speculative = (K + 1)·t0 + (M_t + K·M_d)·x.
    Then the FLOP/s fraction is bisected until the gain at ``breakeven_batch`` is 1.
    """
    hw, k, ctx = config.hardware, facts.k, facts.context
    assert config.draft is not None
    peak_bw = hw.gpus * hw.bandwidth_gb_s * GB
    m_t = config.target.weight_bytes + ctx * config.target.kv_bytes_per_token
    m_d = config.draft.weight_bytes + ctx * config.draft.kv_bytes_per_token
    alpha = alpha_from_rate(facts.rate, k)
    a, b = 1 / facts.plain_tok_s_b1, expected_tokens(alpha, k) / facts.spec_tok_s_b1
    # t0 + m_t x = a ; (k+1) t0 + (m_t + k m_d) x = b  →  x = ((k+1) a − b) / ((k+1) m_t − m_t − k m_d)
    x = ((k + 1) * a - b) / (k * m_t - k * m_d)
    t0 = a - m_t * x
    if x <= 0 or t0 < 0:
        raise ValueError(f"the facts admit no roofline with a non-negative overhead (t0={t0}, 1/bw={x})")
    base = replace(config.efficiency, bandwidth_fraction=1 / (x * peak_bw), forward_overhead_ms=1000 * t0)
    lo, hi = 1e-4, 1.0  # gain rises with FLOP/s: find where it crosses 1 at the breakeven batch
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        trial = replace(config, efficiency=replace(base, flops_fraction=mid))
        lo, hi = (lo, mid) if gain(trial, alpha, facts.breakeven_batch, k, ctx) > 1.0 else (mid, hi)
    fitted = replace(base, flops_fraction=math.sqrt(lo * hi))
    cost = StepCost(replace(config, efficiency=fitted))
    if 2 * config.target.params * (k + 1) / cost.flops > m_t / cost.bandwidth:
        raise ValueError("fit assumption broken: the batch-1 verification is compute-bound")
    return fitted


# -- one replica's batch, stepped -----------------------------------------------------------------------
@dataclass
class SimSeq:
    """One sequence in a simulated batch."""

    request_id: str
    k: int  # requested drafts per step (0: plain)
    alpha: float  # per-token acceptance
    remaining: int  # tokens still to emit
    prefill: int  # prompt tokens not yet in the cache (processed in its first step)
    rng: random.Random
    context: int = 0  # tokens in its cache
    # Draft this token tree instead of a chain (``k`` is then its depth); steps that cap K cut
    # it to its top levels.
    tree: TreeShape | None = None
    # Propose by lookup (prompt lookup, suffix match) instead of the draft model: a step finds a
    # match with probability ``coverage`` and proposes its K as point masses, accepted with
    # ``alpha`` as a draft's; a step without a match is plain. No draft forward either way.
    lookup: bool = False
    coverage: float = 1.0
    log_alpha: float = field(init=False)
    betas: tuple[float, ...] = field(init=False)  # its rank acceptances (trees.betas_for)

    def __post_init__(self) -> None:
        self.log_alpha = math.log(self.alpha) if self.alpha > 0 else -math.inf
        self.betas = betas_for(self.alpha)
        if self.tree is not None and not self.lookup:
            self.k = self.tree.depth
        elif self.lookup:
            self.tree = None  # a lookup proposes a chain


@dataclass(frozen=True)
class SeqStep:
    seq: SimSeq
    k: int  # drafts proposed this step
    accepted: int
    emitted: int  # tokens emitted this step
    finished: bool
    path: StepPath | None = None  # a tree step's verification, level by level


@dataclass(frozen=True)
class BatchStep:
    duration_s: float  # simulated
    verify_s: float
    depth: int  # sequences in the step
    results: list[SeqStep]


# A step's K cap from its batch depth; specgate's is the policy's batch latch (``SimBatch.latch_rule``).
StepRule = Callable[[int], int]
NO_CAP = 1 << 20


class SimBatch:
    """A replica's continuous batch: FIFO admission up to ``max_slots``, one roofline step at a time.

    The per-step K comes from ``step_rule`` (default: the gateway's ``max_batch``/``batch_resume``
    latch through ``policies.speculation.step_depth``, as in every specgate engine).
    """

    def __init__(self, config: SimConfig, max_slots: int, max_k: int, step_rule: StepRule | None = None) -> None:
        self.config = config
        self.cost = StepCost(config)
        self.max_slots = max_slots
        self.max_k = max_k if config.draft is not None else 0
        self.waiting: deque[SimSeq] = deque()
        self.running: dict[str, SimSeq] = {}
        self.max_batch = self.batch_resume = NO_CAP
        self.max_step_drafts = 0  # 0: no per-step draft limit
        self.batch_full = False
        self.step_rule = step_rule or self.latch_rule
        # K auto (the directive's cost_rule): each step's Ks cut to the best at its mix, at the
        # batch's own acceptance estimate, as the embedded engine's runner does. None: off.
        self.cost_rule: StepCostRule | None = None
        self.acceptance = AcceptanceEstimate()

    def latch_rule(self, depth: int) -> int:
        rule = step_depth(NO_CAP, depth, self.batch_full, self.max_batch, self.batch_resume, self.max_step_drafts)
        self.batch_full = rule.batch_full
        return rule.k

    def add(self, seq: SimSeq) -> None:
        seq.k = max(0, min(seq.k, self.max_k))
        if seq.tree is not None:  # a tree the deployment cannot verify runs as the chain of its depth
            tree = truncated(seq.tree, seq.k)
            seq.tree = tree if tree is not None and tree.nodes <= self.config.tree_max_nodes else None
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is None:
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> BatchStep | None:
        while self.waiting and len(self.running) < self.max_slots:
            seq = self.waiting.popleft()
            self.running[seq.request_id] = seq
        if not self.running:
            return None
        seqs = list(self.running.values())
        cap = self.step_rule(len(seqs))
        ks, contexts, prefill = [], [], 0
        for seq in seqs:
            if seq.prefill:  # the prompt's step: no drafts, the first token comes out of it
                ks.append(0)
                prefill += seq.prefill
            else:
                ks.append(min(seq.k, cap))
            contexts.append(seq.context)
        lookup = [seq.lookup for seq in seqs]
        alpha = self.acceptance.evidenced
        if self.cost_rule is not None and alpha is not None:
            # The rule prices the draft's plan: lookup sequences keep their K (no draft forward to save).
            common = self.cost_rule.k([0 if lk else k for k, lk in zip(ks, lookup, strict=True)], alpha)
            ks = [k if lk else common if k > 0 else 0 for k, lk in zip(ks, lookup, strict=True)]
        # A lookup that finds no match this step proposes nothing: a plain step for that sequence.
        ks = [0 if lk and k > 0 and seq.rng.random() >= seq.coverage else k
              for k, lk, seq in zip(ks, lookup, seqs, strict=True)]
        # Never more drafts than could be emitted.
        ks = [min(k, seq.remaining - 1) for k, seq in zip(ks, seqs, strict=True)]
        trees = [truncated(seq.tree, k) if seq.tree is not None else None for seq, k in zip(seqs, ks, strict=True)]
        duration, verify = self.cost.step_time(ks, contexts, prefill, trees, lookup if any(lookup) else None)
        results = []
        for seq, k, tree in zip(seqs, ks, trees, strict=True):
            path = None
            if tree is not None:
                path = sample_path(seq.rng, tree, seq.betas)
                accepted = path.accepted
                tested, passed = rank1_tests(path)  # the α evidence: rank-1 tests only
                for i in range(tested):
                    self.acceptance.add(1, 1 if i < passed else 0)
            else:
                accepted = sample_accepted(seq.rng, seq.log_alpha, k)
                if not seq.lookup:  # the batch's estimate is the draft's (K auto prices draft steps)
                    self.acceptance.add(k, accepted)
            emitted = min(accepted + 1, seq.remaining)
            seq.context += seq.prefill + emitted
            seq.prefill = 0
            seq.remaining -= emitted
            finished = seq.remaining <= 0
            if finished:
                del self.running[seq.request_id]
            results.append(SeqStep(seq, k, accepted, emitted, finished, path))
        return BatchStep(duration, verify, len(seqs), results)
