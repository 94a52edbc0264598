"""What a decision reads: the session's evidence, the worker's state, the request's facts."""

from __future__ import annotations

from dataclasses import dataclass

from policies.cost import CostModel, StepMix
from policies.lookup import LookupState
from policies.methods import Method
from policies.tree import TreeShape
from policies.tree_choice import Ranks


@dataclass(frozen=True)
class SessionState:
    # α, the per-draft acceptance: decayed accepted drafts / decayed tested drafts
    # (policies/acceptance.py); None until the first draft is tested.
    acceptance_estimate: float | None = None
    acceptance_weight: float = 0.0  # the decayed tested drafts it rests on (levels off near half_life / ln 2)
    proposals_seen: int = 0  # drafts tested over the session's life
    # Over the session's life, as vLLM counts them: drafts proposed (tested or not) and accepted.
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    low_acceptance: bool = False  # latched: fell below the floor, not yet back above resume
    plain_since_probe: int = 0  # low-acceptance (or no-gain) requests served plain since the last probe
    auto_k: int | None = None  # the K the cost model last chose (0: plain, no_gain); None: never chosen
    auto_tree: TreeShape | None = None  # ...and the tree, where it chose one (auto_k is then its depth)
    since_tree: int = 0  # K auto decisions since the last tree: when a tree on the prior may be explored
    # Rank acceptances by depth with their tests (policies/tree_choice.py); () until the first step.
    ranks: Ranks = ()
    # The fields above are the draft model's. Each lookup method's evidence (policies/lookup.py),
    # () until one ran; the method last chosen (hysteresis); requests since an untried method
    # was last explored (``method_explore_every``).
    lookups: tuple[LookupState, ...] = ()
    method: Method = "draft"
    since_method: int = 0


@dataclass(frozen=True)
class WorkerState:
    batch_depth: int  # running + queued sequences, as last reported plus admitted since
    batch_full: bool  # the batch latch (see batch_latch)
    max_k: int  # 0 when the worker cannot speculate
    serves_speculative: bool = True  # False for a worker that serves one fixed plain mode
    serves_plain: bool = True  # False for a worker that serves one fixed speculative mode
    cost: CostModel | None = None  # the worker's published step costs (num_speculative_tokens: auto)
    acceptance: float | None = None  # the worker's acceptance estimate over all its sessions
    # K auto: what the worker's in-flight sequences draft (the gateway's decisions for them), so
    # a step is priced at its real mix, not as if every sequence drafted (policies/cost.py).
    # None: unknown, priced uniformly.
    mix: StepMix | None = None
    tree_max_nodes: int = 0  # the most tree nodes its engine verifies in one step; 0: chains only
    methods: tuple[Method, ...] = ("draft",)  # the speculation methods its engine offers
    lookups: tuple[LookupState, ...] = ()  # its evidence per lookup method, over all its sessions
    shadow_lookup: bool = False  # its requests report shadow evidence at T=0 (docs/methods.md)


@dataclass(frozen=True)
class RequestFacts:
    temperature: float
