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
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.speculation import step_depth
from workers.costs.model import AcceptanceEstimate, StepCostRule

# -- units and published facts ------------------------------------------------------------------------
GB, TFLOP = 1e9, 1e12
PUBLISHED_K = 5  # the deployment's num_speculative_tokens; its acceptance rates are quoted at this K


@dataclass(frozen=True)
class ModelShape:
    params: float  # parameters
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_token: float = 0.0  # K and V, all layers

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


# Llama-3.3-70B: 80 layers, 8 KV heads of 128 (GQA): 80 × 2 × 8 × 128 × 2 bytes per token.
LLAMA_70B = ModelShape(70.55e9, 2.0, 80 * 2 * 8 * 128 * 2)
# Llama-3.2-1B: 16 layers, 8 KV heads of 64.
LLAMA_1B = ModelShape(1.236e9, 2.0, 16 * 2 * 8 * 64 * 2)


@dataclass(frozen=True)
class Hardware:
    gpus: int = 4  # tensor parallel degree of one replica (one worker)
    bandwidth_gb_s: float = 3350.0  # per GPU, datasheet (H100 SXM HBM3)
    peak_tflops: float = 989.0  # per GPU, datasheet dense bf16 (H100 SXM)


@dataclass(frozen=True)
class Efficiency:
    """What the deployment achieves of the datasheet. The first three are fitted to the published
    facts (``fit_efficiency``; python -m bench.sim_fit); ``prefill_flops_fraction`` is assumed."""

    bandwidth_fraction: float = 0.398
    flops_fraction: float = 0.0936
    forward_overhead_ms: float = 2.89  # per forward pass: launches, TP all-reduce latency, scheduling
    # Prefill runs large GEMMs, far closer to peak than the small-token decode path the fit sees.
    prefill_flops_fraction: float = 0.4


@dataclass(frozen=True)
class Facts:
    """The published figures the efficiencies are fitted to (docs/sim.md)."""

    plain_tok_s_b1: float = 34.0  # tokens/s per stream, plain, batch 1
    spec_tok_s_b1: float = 109.0  # tokens/s per stream, K=5, at ``rate``
    rate: float = 0.814  # the acceptance behind spec_tok_s_b1 (vLLM's accepted/proposed: the code figure)
    k: int = PUBLISHED_K
    breakeven_batch: int = 64  # speculation's gain falls to 1.0 here (at ``rate``)
    context: int = 1024  # tokens in each sequence's KV cache for these figures (assumed)


# -- acceptance -------------------------------------------------------------------------------------
def vllm_rate(alpha: float, k: int) -> float:
    """vLLM's ``spec_decode_draft_acceptance_rate`` (accepted / proposed) for per-token α at K:
    E[accepted] = α + α² + … + α^K = α(1 − α^K)/(1 − α), over K proposed."""
    if alpha >= 1.0:
        return 1.0
    return alpha * (1.0 - alpha ** k) / (k * (1.0 - alpha))


def alpha_from_rate(rate: float, k: int = PUBLISHED_K) -> float:
    """Inverts ``vllm_rate`` (increasing in α) by bisection."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if vllm_rate(mid, k) < rate else (lo, mid)
    return (lo + hi) / 2


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


Bands = tuple[tuple[float, float], ...]  # ((max temperature, per-token α), ...), ascending


def _published(low: float, mid: float, high: float) -> Bands:
    return ((0.3, alpha_from_rate(low)), (0.8, alpha_from_rate(mid)), (math.inf, alpha_from_rate(high)))


# Rates (vLLM's accepted/proposed at K=5) → per-token α. Low-temperature json/code/math are the
# deployment's published figures; "above 0.8, below 0.5" is published for all; the rest assumed
# (docs/sim.md). Reasoning (math) at mid temperature is set to α = 0.6 directly (issue #10).
DEFAULT_ACCEPTANCE: Mapping[str, Bands] = {
    "json": _published(0.882, 0.75, 0.45),
    "code": _published(0.814, 0.70, 0.45),
    "math": ((0.3, alpha_from_rate(0.647)), (0.8, 0.60), (math.inf, alpha_from_rate(0.40))),
    "chat": _published(0.60, 0.50, 0.40),
}


@dataclass(frozen=True)
class AcceptanceTable:
    bands: Mapping[str, Bands] = field(default_factory=lambda: dict(DEFAULT_ACCEPTANCE))
    default_category: str = "chat"  # prompts without a tag

    def alpha(self, category: str, temperature: float) -> float:
        bands = self.bands.get(category) or self.bands[self.default_category]
        for max_t, alpha in bands:
            if temperature <= max_t:
                return alpha
        return bands[-1][1]

    def category(self, text: str) -> str:
        """The first ``[json]``/``[code]``/``[math]``/``[chat]`` tag (any table key) in the prompt's
        text, else ``default_category``. A chat's text is its rendered messages, so a tag anywhere
        in a message counts."""
        match = re.search(r"\[(" + "|".join(map(re.escape, self.bands)) + r")\]", text, re.IGNORECASE)
        return match.group(1).lower() if match else self.default_category


# -- the configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimConfig:
    target: ModelShape = LLAMA_70B
    draft: ModelShape | None = LLAMA_1B  # None: the deployment cannot speculate
    hardware: Hardware = field(default_factory=Hardware)
    efficiency: Efficiency = field(default_factory=Efficiency)
    acceptance: AcceptanceTable = field(default_factory=AcceptanceTable)
    # Real seconds per simulated second: 1 runs at the modelled speed; 0 answers at once.
    time_scale: float = 1.0
    seed: int = 0  # output tokens and acceptance draws of requests without their own seed
    context_window: int = 8192

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> SimConfig:
        """From config.yaml's ``workers.sim`` (or ``--sim-config``); errors name the field."""
        from workers.api.sim_config import parse  # the parser needs this module's types

        return parse(raw or {})

    def summary(self) -> dict[str, Any]:
        """What ``/specgate/worker`` shows: the modelled deployment and its calibration."""
        cost = StepCost(self)
        return {"sim": {
            "target_params_b": self.target.params / 1e9,
            "draft_params_b": self.draft.params / 1e9 if self.draft else None,
            "gpus": self.hardware.gpus, "bandwidth_gb_s_per_gpu": self.hardware.bandwidth_gb_s,
            "peak_tflops_per_gpu": self.hardware.peak_tflops,
            "efficiency": vars(self.efficiency), "time_scale": self.time_scale,
            "plain_step_ms_b1": round(1000 * cost.step_time([0], [1024])[0], 3),
            "acceptance": {c: [[t if math.isfinite(t) else None, round(a, 4)] for t, a in b]
                           for c, b in self.acceptance.bands.items()},
            "default_category": self.acceptance.default_category,
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

    def step_time(self, ks: Sequence[int], contexts: Sequence[int], prefill_tokens: int = 0) -> tuple[float, float]:
        """(step seconds, of which the target's verification) for sequences with K_i drafts and
        context_i cached tokens; ``prefill_tokens`` prompt tokens processed alongside."""
        if not ks and not prefill_tokens:
            return 0.0, 0.0
        kmax = max(ks, default=0)
        draft_s = 0.0
        if kmax > 0 and self.draft is not None:
            # Draft position j runs over the sequences drafting more than j tokens.
            count = [0] * (kmax + 1)
            ctx = [0] * (kmax + 1)
            for k, c in zip(ks, contexts, strict=True):
                count[k] += 1
                ctx[k] += c
            n = kv = 0
            for j in range(kmax, 0, -1):
                n, kv = n + count[j], kv + ctx[j]
                draft_s += self.forward(self.draft, n, kv)
        verify_s = self.forward(self.target, sum(ks) + len(ks), sum(contexts), prefill_tokens)
        return draft_s + verify_s, verify_s


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
    log_alpha: float = field(init=False)

    def __post_init__(self) -> None:
        self.log_alpha = math.log(self.alpha) if self.alpha > 0 else -math.inf


@dataclass(frozen=True)
class SeqStep:
    seq: SimSeq
    k: int  # drafts proposed this step
    accepted: int
    emitted: int  # tokens emitted this step
    finished: bool


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
        alpha = self.acceptance.evidenced
        if self.cost_rule is not None and alpha is not None:
            common = self.cost_rule.k(ks, alpha)
            ks = [common if k > 0 else 0 for k in ks]
        # Never more drafts than could be emitted.
        ks = [min(k, seq.remaining - 1) for k, seq in zip(ks, seqs, strict=True)]
        duration, verify = self.cost.step_time(ks, contexts, prefill)
        results = []
        for seq, k in zip(seqs, ks, strict=True):
            accepted = sample_accepted(seq.rng, seq.log_alpha, k)
            self.acceptance.add(k, accepted)
            emitted = min(accepted + 1, seq.remaining)
            seq.context += seq.prefill + emitted
            seq.prefill = 0
            seq.remaining -= emitted
            finished = seq.remaining <= 0
            if finished:
                del self.running[seq.request_id]
            results.append(SeqStep(seq, k, accepted, emitted, finished))
        return BatchStep(duration, verify, len(seqs), results)


# -- parsing ----------------------------------------------------------------------------------------------
class SimConfigError(ValueError):
    """A bad ``workers.sim`` field. ``problems`` lists every bad field of the parse that raised
    it (this one first), so ``specgate check`` can name them all."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(f"{field}: {problem} (got {value!r})")
        self.field, self.value, self.problem = field, value, problem
        self.problems: list[SimConfigError] = [self]
