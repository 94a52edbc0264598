"""K from measured costs: which depth of speculation buys the most tokens per second.

Pure, like the rest of ``policies/``: a worker's cost curves come in as a frozen ``CostModel``
(the gateway builds it from the JSON the worker publishes, ``workers/costs/cost_report.py``), the
acceptance estimate, batch depth and the step's draft mix as numbers, and a K comes out.

Callers do not start here (``policies/__init__.py`` says which function answers what):
- at admission, ``policies.speculation.decide`` reads ``choose_k`` (and ``objective``, ``gain``);
- per step, inside a worker under K auto, ``batch_step_k`` gives the step's drafting sequences
  one K (through ``step_k``), and ``catch_up_pays`` says whether a draft that lags should catch up.

The pricing (uniform, or mixed from the model's ``StepParts`` and a ``StepMix``), the objective
and why it is the batch's goodput per drafting sequence: docs/engine.md, section 5, "How a K is
priced".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepParts:
    """What a step's parts cost at each of the model's depths: what pricing a mixed step needs.

    The fields of ``workers.costs.cost_report.CostReport`` of the same names (``plain_step_ms``,
    ``verify_cost``, ``draft_cost``, ``step_overhead_ms``, ``draft_overhead_ms``,
    ``draft_first_cost``)."""

    plain_ms: tuple[float, ...]  # the target's forward of one token per sequence, ms
    verify: tuple[tuple[float, ...], ...]  # [depth][n-1]: its forward of n tokens per sequence / n = 1
    draft: tuple[float, ...]  # a draft forward after the step's first (a token per drafting sequence) / plain_ms
    overhead_ms: tuple[float, ...]  # a plain step's work outside its forwards
    draft_overhead_ms: tuple[float, ...]  # what each draft per sequence adds to it
    # A step's first draft forward / plain_ms, where it costs more than the later ones (``draft``):
    # it reads the draft's weights back after the target's forward evicted them from the cache,
    # and catches the draft up on the last step's tokens. None: as the later ones.
    draft_first: tuple[float, ...] | None = None

    def first_draft(self, i: int) -> float:
        return self.draft[i] if self.draft_first is None else self.draft_first[i]


@dataclass(frozen=True)
class StepMix:
    """The other sequences a step would hold besides the session being priced.

    The gateway fills it from the requests it has in flight on the worker and the decision
    each went with; a worker, from its step's sequences. Sequences of the batch it does not
    describe (a remote worker's other clients) count as plain."""

    sequences: int = 0  # sequences described here
    drafting: int = 0  # of them, how many draft
    # Of the plain ones, how many the rules would let draft: sent plain for ``no_gain`` or by the
    # batch latch. Their next requests draft once a K pays (or the latch clears), so the K priced
    # now is one they will share.
    would_draft: int = 0
    # What the other drafting sequences accept per token: the worker's estimate over all its
    # sessions (None: as the priced session does). They are not all like the session priced.
    acceptance: float | None = None


@dataclass(frozen=True)
class TreeCosts:
    """What a token tree's forwards cost at batch depth 1, relative to ``plain_step_ms[0]``
    (the worker's ``tree_verify_cost`` and ``tree_draft_cost``; policies/tree_choice.py prices
    a tree step from them)."""

    verify: tuple[float, ...]  # [n-1]: the target's forward of one row of n tokens (root + n-1 nodes, tree mask)
    draft: tuple[float, ...]  # [n-1]: one draft forward over n tokens (one tree level)

    def __post_init__(self) -> None:
        for name, row in (("tree_verify_cost", self.verify), ("tree_draft_cost", self.draft)):
            if not row or not all(math.isfinite(c) and c > 0 for c in row):
                raise ValueError(f"cost model: {name} must be a non-empty list of positive, finite costs (got {row})")


@dataclass(frozen=True)
class CostModel:
    """A worker's step cost by batch depth and K, relative to a plain step at that depth."""

    depths: tuple[int, ...]  # batch depths measured, ascending, the first >= 1
    step_cost: tuple[tuple[float, ...], ...]  # [depth index][K], K = 0..max_k; [i][0] == 1.0
    parts: StepParts | None = None  # absent in the old schema (and vLLM's): uniform pricing only
    tree: TreeCosts | None = None  # absent: the worker is priced for chains only
    # An EAGLE-3 head's forwards (a step's first, each later one) relative to a plain step at
    # batch depth 1 (``head_first_cost``, ``head_draft_cost``); None: no head, or not measured.
    head: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not self.depths or len(self.depths) != len(self.step_cost):
            raise ValueError("cost model: one step_cost row per depth")
        if any(b <= a for a, b in zip(self.depths, self.depths[1:], strict=False)) or self.depths[0] < 1:
            raise ValueError(f"cost model: depths must be ascending and >= 1 (got {self.depths})")
        width = len(self.step_cost[0])
        for row in self.step_cost:
            if len(row) != width or width < 1:
                raise ValueError("cost model: every depth needs the same K = 0..max_k")
            if not all(math.isfinite(c) and c > 0 for c in row):
                raise ValueError(f"cost model: costs must be positive and finite (got {row})")
        parts = self.parts
        if self.head is not None and not all(math.isfinite(c) and c >= 0 for c in self.head):
            raise ValueError("cost model: head_first_cost and head_draft_cost must be finite and >= 0 "
                             f"(got {self.head})")
        if parts is not None:
            count = len(self.depths)
            columns = (parts.plain_ms, parts.verify, parts.draft, parts.overhead_ms, parts.draft_overhead_ms,
                       parts.draft if parts.draft_first is None else parts.draft_first)
            if any(len(column) != count for column in columns):
                raise ValueError("cost model: one value of each part per depth")
            if any(len(row) != width for row in parts.verify):
                raise ValueError("cost model: verify_cost needs n = 1..max_k+1 tokens at every depth")
            flat = [*parts.plain_ms, *(c for row in parts.verify for c in row)]
            if not all(math.isfinite(c) and c > 0 for c in flat):
                raise ValueError("cost model: plain_step_ms and verify_cost must be positive and finite")
            if not all(math.isfinite(c) and c >= 0 for c in (*parts.draft, *parts.overhead_ms,
                                                             *parts.draft_overhead_ms, *(parts.draft_first or ()))):
                raise ValueError("cost model: draft and overhead costs must be finite and >= 0")

    @property
    def max_k(self) -> int:
        return len(self.step_cost[0]) - 1

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CostModel:
        """From the ``cost_model`` object a worker publishes (``depths``, ``step_cost``, and the
        parts when it has them: ``plain_step_ms``, ``verify_cost``, ``draft_cost``, overheads,
        ``draft_first_cost``; and a tree's, ``tree_verify_cost`` and ``tree_draft_cost``, both or
        neither)."""
        depths = tuple(int(d) for d in raw["depths"])
        rows = tuple(tuple(float(c) for c in row) for row in raw["step_cost"])
        parts = None
        if all(raw.get(name) is not None for name in ("plain_step_ms", "verify_cost", "draft_cost")):
            zeros = [0.0] * len(depths)

            def floats(name: str) -> tuple[float, ...]:
                value = raw.get(name)
                return tuple(float(x) for x in (zeros if value is None else value))
            parts = StepParts(floats("plain_step_ms"),
                              tuple(tuple(float(c) for c in row) for row in raw["verify_cost"]),
                              floats("draft_cost"), floats("step_overhead_ms"), floats("draft_overhead_ms"),
                              floats("draft_first_cost") if raw.get("draft_first_cost") is not None else None)
        tree = None
        if raw.get("tree_verify_cost") is not None and raw.get("tree_draft_cost") is not None:
            tree = TreeCosts(tuple(float(c) for c in raw["tree_verify_cost"]),
                             tuple(float(c) for c in raw["tree_draft_cost"]))
        head = None
        if raw.get("head_first_cost") is not None and raw.get("head_draft_cost") is not None:
            head = (float(raw["head_first_cost"]), float(raw["head_draft_cost"]))
        return cls(depths, rows, parts, tree, head)


def whole_step_costs(target_s: Sequence[float], draft_s: float, overhead_s: float = 0.0,
                     draft_overhead_s: float = 0.0, draft_first_s: float | None = None) -> tuple[float, ...]:
    """``step_cost`` for K = 0..len(target_s)-1 at one depth, from its parts in seconds.

    ``target_s[n-1]``: the target's forward of n tokens per sequence; ``draft_s``: one draft
    forward after the step's first, ``draft_first_s`` that first one (None: as the others);
    ``overhead_s``: a plain step's work outside its forwards; ``draft_overhead_s``: what each
    draft per sequence adds to that outside the forwards. A K-draft step costs target_s[K] +
    draft_first_s + (K - 1) draft_s + K draft_overhead_s + overhead_s, a plain one
    target_s[0] + overhead_s.
    """
    plain = target_s[0] + overhead_s
    first = draft_s if draft_first_s is None else draft_first_s
    return (1.0, *((target_s[k] + first + (k - 1) * draft_s + k * draft_overhead_s + overhead_s) / plain
                   for k in range(1, len(target_s))))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step with K drafts emits on average at per-token acceptance α."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _between(depths: Sequence[int], depth: float) -> tuple[int, int, float]:
    """(lower index, upper index, weight of the upper): linear between measured depths; outside
    the range the nearest depth holds (a worker never batches more than its slots, so the
    deepest measured depth is as deep as its steps get)."""
    if depth <= depths[0]:
        return 0, 0, 0.0
    for i in range(1, len(depths)):
        if depth <= depths[i]:
            return i - 1, i, (depth - depths[i - 1]) / (depths[i] - depths[i - 1])
    return len(depths) - 1, len(depths) - 1, 0.0


def step_cost(model: CostModel, depth: int, k: int) -> float:
    """Relative cost of a K-draft step at ``depth`` with every sequence drafting K (uniform)."""
    lo, hi, w = _between(model.depths, depth)
    return (1 - w) * model.step_cost[lo][k] + w * model.step_cost[hi][k]


def mixed_step_cost(model: CostModel, depth: int, drafting: int, drafts: int, draft_forwards: int) -> float:
    """Cost of a step of ``depth`` sequences, ``drafting`` of which draft ``drafts`` tokens in
    all in ``draft_forwards`` sequential draft forwards, relative to a plain step at that depth
    (docs/engine.md, "How a K is priced"). Needs the model's parts.

    Priced at the measured depths around ``depth`` with the same shares (tokens per sequence,
    drafting sequences per sequence) and the ratios interpolated between them, as ``step_cost``
    does, so a step where every sequence drafts K costs ``step_cost(depth, K)`` at any depth.
    (Reading the target at the same total tokens instead would follow a roofline's kink between
    two measured depths more closely, and chose worse K in bench.policy, whose steps carry
    prefill work the cost model does not price; README "What the policy is worth".)"""
    parts, depths = model.parts, model.depths
    assert parts is not None
    lo, hi, w = _between(depths, depth)
    per_sequence = drafts / depth

    def draft_ms(rows: float) -> float:  # the step's draft forwards over ``rows`` drafting sequences
        dlo, dhi, dw = _between(depths, rows)

        def at(j: int) -> float:
            return parts.plain_ms[j] * (parts.first_draft(j) + (draft_forwards - 1) * parts.draft[j])
        return (1 - dw) * at(dlo) + dw * at(dhi)

    def relative(i: int) -> float:
        target = parts.plain_ms[i] * _verify(parts.verify[i], 1.0 + per_sequence)
        outside = parts.overhead_ms[i] + parts.draft_overhead_ms[i] * per_sequence
        draft = draft_ms(drafting * depths[i] / depth) if drafting > 0 and draft_forwards > 0 else 0.0
        return (target + outside + draft) / (parts.plain_ms[i] + parts.overhead_ms[i])

    return (1 - w) * relative(lo) + w * relative(hi)


def lookup_step_cost(model: CostModel, depth: int, k: int) -> float:
    """Relative cost of a step whose every sequence verifies ``k`` lookup proposals (prompt lookup,
    suffix match: ``policies/methods.py``): the target's forward of k + 1 tokens and the per-draft
    work outside the forwards, but no draft forward. A model without its parts is priced as a
    draft-model step of K (an upper bound)."""
    if k <= 0:
        return 1.0
    parts = model.parts
    if parts is None:
        return step_cost(model, depth, k)
    lo, hi, w = _between(model.depths, depth)

    def relative(i: int) -> float:
        target = parts.plain_ms[i] * _verify(parts.verify[i], 1.0 + k)
        return (target + parts.overhead_ms[i] + parts.draft_overhead_ms[i] * k) / (parts.plain_ms[i]
                                                                                    + parts.overhead_ms[i])
    return (1 - w) * relative(lo) + w * relative(hi)


def head_step_cost(model: CostModel, depth: int, k: int) -> float:
    """Relative cost of a step in which a session drafts ``k`` tokens with an EAGLE-3 head: the
    target's verification as a lookup step's (``lookup_step_cost``), plus the head's forwards, which
    run per sequence (their time is the same at any depth, so relative to a deeper step's plain
    time they weigh less). Without a measured head, priced as a draft-model step of K."""
    if k <= 0:
        return 1.0
    if model.head is None:
        return step_cost(model, depth, k)
    first, later = model.head
    plain_at_depth = 1.0
    if model.parts is not None:
        lo, hi, w = _between(model.depths, depth)
        parts = model.parts
        shallowest = parts.plain_ms[0] + parts.overhead_ms[0]
        whole = [(parts.plain_ms[i] + parts.overhead_ms[i]) / shallowest for i in (lo, hi)]
        plain_at_depth = (1 - w) * whole[0] + w * whole[1]
    return lookup_step_cost(model, depth, k) + (first + (k - 1) * later) / plain_at_depth


def _verify(row: Sequence[float], tokens: float) -> float:
    """The target's relative forward cost at ``tokens`` per sequence (>= 1), linear between the
    measured n = 1..len(row); no step verifies more than the last."""
    if tokens >= len(row):
        return row[-1]
    n = int(tokens)
    return row[n - 1] + (tokens - n) * (row[n] - row[n - 1])


def gain(model: CostModel, alpha: float, k: int, depth: int, mix: StepMix | None = None) -> float:
    """Tokens per unit of time with K drafts, relative to plain decoding (plain: 1).

    ``depth`` counts the session's own sequence. Without a ``mix`` (or a model without its
    parts) every sequence is priced drafting K; with both, the step is priced with the mix's
    drafting sequences and this one at K, the rest plain, and the gain is the batch's per
    drafting sequence (docs/engine.md, "How a K is priced")."""
    tokens = expected_tokens(alpha, k)
    if k == 0:
        return 1.0
    if mix is None or model.parts is None:
        return tokens / step_cost(model, depth, k)
    depth = max(depth, mix.sequences + 1)
    group = min(mix.drafting + mix.would_draft, depth - 1) + 1  # the drafting sequences, this one included
    plain_others = depth - group
    speedup = 1.0 / mixed_step_cost(model, depth, group, group * k, k)
    others = tokens if mix.acceptance is None else expected_tokens(mix.acceptance, k)
    return ((plain_others + tokens + (group - 1) * others) * speedup - plain_others) / group


def objective(model: CostModel, alpha: float, k: int, depth: int, min_gain: float,
              mix: StepMix | None = None) -> float:
    """What ``choose_k`` maximizes: the gain, with plain credited ``min_gain``."""
    return 1.0 + min_gain if k == 0 else gain(model, alpha, k, depth, mix)


def choose_k(model: CostModel, alpha: float, depth: int, max_k: int, min_gain: float, k_switch_gain: float,
             current: int | None = None, mix: StepMix | None = None) -> int:
    """The K (0: plain) that maximizes ``objective``, with hysteresis.

    A session keeps its ``current`` K (plain included) unless another K's objective is higher
    by a factor of more than 1 + ``k_switch_gain``: near the optimum the curve is flat, so a
    noisy acceptance estimate would otherwise move K back and forth for nothing. Ties go to the
    smaller K (less work for the same tokens).
    """
    ks = range(0, min(max_k, model.max_k) + 1)
    values = {k: objective(model, alpha, k, depth, min_gain, mix) for k in ks}
    best = max(ks, key=lambda k: (values[k], -k))
    if current is not None and current in values and values[current] * (1.0 + k_switch_gain) >= values[best]:
        return current
    return best


def step_k(model: CostModel, alpha: float, depth: int, requested_k: int, mix: StepMix | None = None) -> int:
    """The best K up to the requested one at a step's depth (and mix), 0 where no K beats plain.
    No margin and no hysteresis: the step is known exactly, not estimated, and the gateway's
    choice already carries both."""
    if requested_k <= 0:
        return 0
    ks: Sequence[int] = range(0, min(requested_k, model.max_k) + 1)
    return max(ks, key=lambda k: (gain(model, alpha, k, depth, mix), -k))


def batch_step_k(model: CostModel, alpha: float, requested: Sequence[int]) -> int:
    """The worker's per-step rule under K auto: the K every drafting sequence of one step drafts
    (``requested``: each sequence's K for the step, 0 for plain or a prefill).

    It is the best K for the step's drafting sequences together, at its exact depth and mix,
    up to the deepest K requested; 0 where none beats plain. One K for all, not each its own:
    the draft runs as many forwards as the deepest K in the step, for every sequence, so a
    sequence drafting fewer than that saves only its verification and gives up tokens, and a
    step whose sessions asked for K = 4, 5 and 6 pays six forwards for the tokens of five
    (bench.policy measured that spread costing 1.5% of goodput in its steady phase). The
    gateway's K per session still bounds the step, and plain sequences stay plain."""
    deepest = max(requested, default=0)
    if deepest <= 0:
        return 0
    drafting = sum(1 for k in requested if k > 0)
    return step_k(model, alpha, len(requested), deepest, StepMix(len(requested) - 1, drafting - 1))



def catch_up_pays(model: CostModel, alpha: float, k: int, depth: int, remaining: int, catch_up_s: float | None,
                  plain_step_s: float, plain_step_depth: int) -> bool:
    """The worker's catch-up rule under K auto: whether a sequence whose draft lags (it decoded
    tokens plain) gains back, over its ``remaining`` tokens drafting K at this depth, the
    draft's catch-up forward on the lag, which costs ``catch_up_s`` (None: not priced).

    The gain is the sequence's share of a step's time (``plain_step_s``, a whole plain step at
    the measured ``plain_step_depth`` nearest ``depth``, over that depth) times what
    speculation saves of it. True where the catch-up is not priced (the sim and vLLM engines
    publish no prefill costs and catch up otherwise)."""
    if catch_up_s is None:
        return True
    speed = gain(model, alpha, k, depth)
    if speed <= 1.0:
        return False
    return remaining * plain_step_s / plain_step_depth * (1.0 - 1.0 / speed) >= catch_up_s
