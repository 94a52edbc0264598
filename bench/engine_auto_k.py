"""K auto as bench.engine runs it: the worker's rules (the gateway's K by depth, the catch-up
rule, the per-step rule) on the live cost model, re-read as the worker's runner re-reads it."""

from __future__ import annotations

from policies import CostModel, catch_up_pays, choose_k
from workers.costs.cost_report import CostReport
from workers.costs.online import OnlineCosts, StepCostRule
from workers.engines.embedded.runner import COST_TABLE_STEPS


def live_model(costs: OnlineCosts) -> CostModel:
    return uniform_model(costs.report())


def uniform_model(report: CostReport) -> CostModel:
    """The policy's model of whole-step costs, every sequence priced drafting the same K."""
    return CostModel(report.depths, report.step_cost)


class AutoK:
    """K auto as the worker runs it, on the live cost model: each sequence's K the one chosen
    at the step's depth (the gateway's choice), the catch-up rule, then the worker's per-step
    rule on the step's actual mix (``step_cost``, as ``workers.engines.embedded.runner`` installs it). The model
    is re-read every COST_TABLE_STEPS steps, as the worker's runner re-reads it (every 256
    calls, four steps at batch 64, cost 0.6% of a plain step there), and answers are kept per
    depth until then, as the worker's rule keeps them per step shape (a choice per sequence per
    step is about 16 µs of Python a worker does not spend)."""

    def __init__(self, costs: OnlineCosts, alpha: float, max_k: int) -> None:
        self.costs, self.alpha, self.max_k = costs, alpha, max_k
        self.chosen: dict[int, int] = {}  # K -> sequence-steps it was chosen for (why auto wins or loses)
        self._reread()

    def _reread(self) -> None:
        """The live model afresh, for every rule, with no answers kept from the last one."""
        self.calls, self.report = 0, self.costs.report()
        self.by_depth: dict[int, int] = {}
        self.model = uniform_model(self.report)
        self.step_rule = StepCostRule(self.report.policy_model())

    def step_cost(self, requested: list[int]) -> int:
        """The worker's per-step rule (``SpeculativeEngine.step_cost_rule``) on the same model."""
        return self.step_rule.k(requested, self.alpha)

    def catch_up(self, lag: int, remaining: int, k: int, depth: int) -> bool:
        """The worker's catch-up rule (``SpeculativeEngine.catch_up_rule``) on the same model."""
        return catch_up_pays(self.model, self.alpha, k, depth, remaining, *self.report.catch_up_prices(lag, depth))

    def __call__(self, requested_k: int, depth: int) -> int:
        self.calls += 1
        if self.calls >= COST_TABLE_STEPS * depth:  # a sequence per call: about that many steps
            self._reread()
        best = self.by_depth.get(depth)
        if best is None:
            best = self.by_depth[depth] = choose_k(self.model, self.alpha, depth, self.max_k, 0.05, 0.0)
        k = min(requested_k, best)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k
