"""The embedded draft+target speculative engine with continuous batching.

The engine is a plain object stepped by its caller: token ids in, per-step events out. It
knows nothing of HTTP, text or policy. Each running sequence has its own depth K per step
(K = 0 is plain decoding) and all of them share one batched target forward per step; new
sequences (long prompts) are prefilled in their own forward within the same step.

Per sequence the engine keeps ``target_len``/``draft_len``, how many of the sequence's tokens
each model's KV cache holds. At the start of a step ``target_len == len(tokens) - 1``: the last
token is fed in the step, followed by the K drafts. After verification the cache is "rewound"
by setting ``target_len`` to the accepted prefix; stale positions beyond it are overwritten
before they are ever attended to.

Sampling: greedy at temperature 0; unseeded requests use standard speculative sampling (the
highest acceptance); seeded requests use Gumbel-max sampling with noise keyed by (seed, output
position), shared by draft and target, so the answer is the same in every mode (``sampling.gumbel_max``).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import replace

import torch

from policies.methods import LOOKUP_METHODS
from policies.tree import MAX_TREE_NODES
from workers.api.limits import check_sampling
from workers.engines.embedded.drafting import draft_token, propose_greedy
from workers.engines.embedded.eagle3 import step as eagle_step
from workers.engines.embedded.eagle3.head import Eagle3Head
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.lookup.proposer import LookupProposer, LookupSettings
from workers.engines.embedded.lookup.replay import shadow_at_finish
from workers.engines.embedded.prefix_cache import PREFILL_CHUNK, PrefixCache, reuse
from workers.engines.embedded.row_batches import RowLimits, forward_rows
from workers.engines.embedded.sampling import (
    Verdict,
    gumbel_max,
    probabilities,
    sample,
    verify,
    verify_greedy,
    verify_point_mass,
)
from workers.engines.embedded.sequence import Row as _Row
from workers.engines.embedded.sequence import Sequence as _Sequence
from workers.engines.embedded.step_interface import ORDINARY_LAG, CatchUpRule, StepCostRule, StepDepthRule, StepShape
from workers.engines.embedded.trees import step as tree_step
from workers.engines.embedded.trees.tree import layout
from workers.engines.interface import FinishReason, GenerationRequest, StepEvent

__all__ = ["CatchUpRule", "GenerationRequest", "SpeculativeEngine", "StepCostRule", "StepDepthRule", "StepEvent"]
class SpeculativeEngine:
    def __init__(self, target: LlamaForCausalLM, draft: LlamaForCausalLM | None, *, max_slots: int = 8,
                 max_k: int = 8, step_depth_rule: StepDepthRule | None = None,
                 rng: random.Random | None = None, drafting_in_one_call: bool = True,
                 max_tree_nodes: int = MAX_TREE_NODES, max_positions: int | None = None,
                 lookup: LookupSettings | None = None, prefix_cache_bytes: int = 0,
                 prefill_chunk: int = PREFILL_CHUNK, eagle: Eagle3Head | None = None) -> None:
        if draft is not None and draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError("draft and target must share a vocabulary")
        self.target = target
        self.draft = draft
        self.eagle = eagle  # an EAGLE-3 head (method eagle3), its K/V sized by the caller
        self.max_k = max_k if draft is not None or eagle is not None else 0
        # Token trees: at most this many draft nodes, at most max_k deep (0: chains only).
        self.max_tree_nodes = max_tree_nodes if self.max_k > 0 else 0
        self.max_slots = max_slots
        self.max_positions = target.cfg.max_position_embeddings
        if draft is not None:
            self.max_positions = min(self.max_positions, draft.cfg.max_position_embeddings)
        # max_positions (workers.max_model_len) caps what a slot holds: SmolLM2's own 8,192 would
        # take 377 MB of float32 K/V per slot.
        if max_positions is not None:
            self.max_positions = min(self.max_positions, max_positions)
        # Each cache in its model's dtype: the draft may run in another dtype than the target.
        self.target_cache = KVCache.allocate(target.cfg, max_slots, target.lm_head.weight.dtype, self.max_positions)
        self.draft_cache = None
        if draft is not None:
            self.draft_cache = KVCache.allocate(draft.cfg, max_slots, draft.lm_head.weight.dtype, self.max_positions)
        self.eos_ids = frozenset(target.cfg.eos_token_ids)
        # Prompt lookup and suffix matching, where the engine speculates at all (their K is the draft's).
        self.lookup = LookupProposer(lookup or LookupSettings()) if self.max_k > 0 else None
        self.step_depth_rule = step_depth_rule
        # Prompts' K/V kept for reuse (prefix_cache.py); None: off. Prompts are prefilled in the
        # same chunks either way, so turning it off or on changes no output.
        self.prefill_chunk = prefill_chunk
        self.prefix = PrefixCache(prefix_cache_bytes, prefill_chunk) if prefix_cache_bytes > 0 else None
        # Greedy drafting in one kernel call (drafting.propose_greedy); False drafts per position, as
        # every other sequence does (bench.kernels measures what the one call buys).
        self.drafting_in_one_call = drafting_in_one_call
        self.step_cost_rule: StepCostRule | None = None
        self.catch_up_rule: CatchUpRule | None = None
        # Seeds for unseeded requests' streams (a fixed rng makes tests and benchmarks repeatable).
        self._rng = rng if rng is not None else random.Random()
        self._waiting: deque[GenerationRequest] = deque()
        self._running: dict[str, _Sequence] = {}
        self._free_slots = list(range(max_slots))
        # Prompt tails up to this many tokens ride in the batched decode forward; longer ones
        # (prefills) get a forward of their own so the batch is not padded to prompt length.
        self._batched_row_limit = self.max_k + 2
        # Wall time of the last step's draft proposals and target verification (metrics), of the
        # whole step (what is outside those two is the cost model's per-step overhead), and
        # their shapes (the cost model's online refinement, workers/costs/cost_report.py).
        self.last_draft_s = 0.0
        self.last_target_s = 0.0
        self.last_step_s = 0.0
        self.last_shape = StepShape(0, 0, False, 0, 0)

    # -- queue management ----------------------------------------------------------------
    @property
    def batch_depth(self) -> int:
        return len(self._running)

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def validate(self, prompt_len: int, max_tokens: int) -> None:
        """Raises ValueError when a request cannot fit in a cache slot."""
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        # No room held back for drafts: near the end a step drafts fewer (_room; trees where they fit).
        if prompt_len + max_tokens > self.max_positions:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"window of {self.max_positions} tokens")

    def add(self, request: GenerationRequest) -> None:
        self.validate(len(request.prompt_ids), request.max_tokens)
        request = replace(request, params=check_sampling(request.params))  # no NaN reaches a kernel
        vocab = self.target.cfg.vocab_size
        if not 0 <= request.resumed_tokens < len(request.prompt_ids):
            raise ValueError("resumed_tokens must leave at least one prompt token")
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise ValueError(f"token ids must be in 0..{vocab - 1}")
        if request.request_id in self._running or self._waiting_index(request.request_id) is not None:
            raise ValueError(f"duplicate request id {request.request_id}")
        self._check_tree(request)
        if request.method == eagle_step.METHOD and (self.eagle is None or self.max_k == 0):
            raise ValueError("this worker has no EAGLE-3 head (method eagle3)")
        if request.method == eagle_step.METHOD and request.tree is not None:
            raise ValueError("eagle3 drafts chains; token trees are the draft model's")
        self._waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drops the sequence and frees its slot at once. True if it was known."""
        seq = self._running.pop(request_id, None)
        if self.lookup is not None:
            self.lookup.drop(request_id)
        if seq is not None:
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
            return True
        index = self._waiting_index(request_id)
        if index is not None:
            del self._waiting[index]
            return True
        return False

    def set_k(self, request_id: str, k: int) -> bool:
        """Changes a sequence's depth from its next step on, queued or running. True if known."""
        k = max(0, min(k, self.max_k))
        seq = self._running.get(request_id)
        if seq is not None:
            seq.k = k
            return True
        index = self._waiting_index(request_id)
        if index is not None:
            self._waiting[index] = replace(self._waiting[index], k=k)
            return True
        return False

    def _check_tree(self, request: GenerationRequest) -> None:
        shape = request.tree
        if shape is None:
            return
        if shape.nodes > self.max_tree_nodes or shape.depth > self.max_k:
            raise ValueError(f"token tree {shape} ({shape.nodes} nodes, depth {shape.depth}) is over this engine's "
                             f"{self.max_tree_nodes} nodes and depth {self.max_k}")

    def _waiting_index(self, request_id: str) -> int | None:
        return next((i for i, r in enumerate(self._waiting) if r.request_id == request_id), None)

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            request = self._waiting.popleft()
            seed = request.params.seed if request.params.seed is not None else self._rng.getrandbits(63)
            seq = self._running[request.request_id] = _Sequence(
                request=request, slot=self._free_slots.pop(0), tokens=list(request.prompt_ids),
                generator=torch.Generator().manual_seed(seed), k=max(0, min(request.k, self.max_k)),
                tree=None if request.tree is None else layout(request.tree))
            if self.prefix is not None and not eagle_step.uses_head(seq) and (fused := self._fused_prefix(seq)):
                reuse(self.prefix, seq, self.target_cache, self.draft_cache, fused)

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        step_started = time.perf_counter()
        self._admit()
        if not self._running:
            return []
        seqs = sorted(self._running.values(), key=lambda s: s.slot)
        depth = len(seqs)
        requested = []
        for seq in seqs:
            k = seq.k if self.step_depth_rule is None else self.step_depth_rule(seq.k, depth)
            # A prefill: the prompt alone, in a forward of its own, whatever the mode, so the
            # cache it writes is the same for plain and speculative decoding and the fast fused
            # attention may serve it (see _forward). Drafting starts next step.
            # Below min_tokens, EOS is masked out of the target's distribution: plain steps keep
            # that to one position a step (_settle), and speculation starts once it is past.
            k = 0 if self._prefilling(seq) or self._below_min_tokens(seq) else self._room(seq, k)
            lag = len(seq.tokens) - seq.draft_len
            # The catch-up rule before the step's K: a sequence it keeps plain is plain in the
            # cost rule's view of the step's mix too. Decided after it, a step in which a few
            # sequences caught up and drafted K=3 while the rest decoded plain paid K+1 tokens
            # a row for all 32 rows (rows are padded to the widest) for the tokens of few:
            # 0.75x plain at batch 32 (bench.engine, AVX512-BF16 EPYC).
            if (k > 0 and self.catch_up_rule is not None and lag > ORDINARY_LAG and self._drafts_with_model(seq)
                    and not self.catch_up_rule(lag, seq.request.max_tokens - seq.emitted, k, depth)):
                k = 0
            requested.append(k)
            seq.drafts, seq.draft_probs = [], []
        # The cost rule prices the draft's forwards: lookup sequences draft none and keep their K.
        drafting = [k if self._drafts_with_model(s) else 0 for s, k in zip(seqs, requested, strict=True)]
        common = self.step_cost_rule(drafting) if self.step_cost_rule is not None and any(drafting) else None
        for seq, k in zip(seqs, requested, strict=True):
            if self._looks_up(seq):
                assert self.lookup is not None
                seq.drafts = self.lookup.propose(seq.request.request_id, seq.request.method, seq.tokens,
                                                 seq.request.session, k, seq.request.cache_scope)
                seq.step_k, seq.step_tree = len(seq.drafts), None
                continue
            if eagle_step.uses_head(seq):  # its own K (the head's cost is not the draft's), a chain
                seq.step_k, seq.step_tree = eagle_step.step_k(seq, k), None
                continue
            seq.step_k = self._room(seq, common) if common is not None and k > 0 else k
            # A tree where the step's K reaches its depth (tree_step.plan), else a chain of that K.
            seq.step_tree = tree_step.plan(self, seq, seq.step_k) if seq.step_k > 0 else None
            if seq.step_tree is not None:
                seq.step_k = seq.step_tree.layout.shape.depth
        drafted = [s for s in seqs if s.step_k > 0 and not self._looks_up(s)]
        catch_up = max((len(s.tokens) - s.draft_len for s in drafted if self._drafts_with_model(s)), default=0)
        failed: dict[str, Exception] = {}  # one sequence's failure must not end the others
        started = time.perf_counter()
        self._propose([s for s in drafted if s.step_tree is None and not eagle_step.uses_head(s)], failed)
        if self.eagle is not None:
            eagle_step.propose(self.eagle, self.target.cfg.vocab_size,
                               [s for s in drafted if eagle_step.uses_head(s)], failed)
        tree_step.propose(self, [s for s in seqs if s.step_tree is not None], failed)
        proposed = time.perf_counter()
        seqs = [s for s in seqs if s.request.request_id not in failed]
        prefill = any(self._prefilling(s) for s in seqs)
        rows = [self._target_row(s) for s in seqs]
        target_logits = self._verify(seqs, rows, failed)
        self.last_draft_s, self.last_target_s = proposed - started, time.perf_counter() - proposed
        # The draft model's forwards (a tree: its depth); the head's are not its costs (online cost model).
        drafting = [s.step_k for s in drafted if s.request.request_id not in failed and self._drafts_with_model(s)]
        self.last_shape = StepShape(len(rows), max((len(r.new_tokens) for r in rows), default=0),
                                    prefill, len(drafting), max(drafting, default=0), sum(drafting), catch_up,
                                    sum(len(r.new_tokens) for r in rows), any(s.step_tree is not None for s in seqs))
        events = []
        for seq, logits in zip(seqs, target_logits, strict=True):
            if logits is None:
                continue
            try:
                events.append(self._settle(seq, logits, depth))
            except Exception as exc:
                failed[seq.request.request_id] = exc
        for request_id, error in failed.items():
            self.abort(request_id)
            events.append(StepEvent(request_id, [], 0, 0, depth, error=error))
        self.last_step_s = time.perf_counter() - step_started
        return events

    def _verify(self, seqs: list[_Sequence], rows: list[_Row], failed: dict[str, Exception]
                ) -> list[torch.Tensor | None]:
        """The target's forward of the step's rows; the states an EAGLE-3 head reads kept for its
        sequences (eagle3/step.py), and the chunks a prefill computed stored for later requests."""
        capture = self.target.aux_capture = eagle_step.capture_for(self.eagle, seqs)
        try:
            target_logits = self._forward_isolated(self.target, self.target_cache, seqs, rows, failed)
        finally:
            self.target.aux_capture = None
        if capture is not None:
            eagle_step.collect(capture, seqs)
        if self.prefix is not None:
            for seq, row, logits in zip(seqs, rows, target_logits, strict=True):
                if row.fused and logits is not None:
                    self.prefix.store_target(seq.tokens, row.start + row.fused, self.target_cache, seq.slot,
                                             seq.request.cache_scope)
        return target_logits

    def _forward_isolated(self, model: LlamaForCausalLM, cache: KVCache, seqs: list[_Sequence], rows: list[_Row],
                          failed: dict[str, Exception]) -> list[torch.Tensor | None]:
        """``_forward``; if the batch raises, each row again alone, so only the failing rows fail.

        Rerunning a row rewrites the same cache positions with the same values, and the target
        scores a row alone exactly as in a batch (row-invariant attention), so the survivors'
        outputs do not change.
        """
        try:
            return list(self._forward(model, cache, rows))
        except Exception as batch_exc:
            if len(rows) == 1:
                failed[seqs[0].request.request_id] = batch_exc
                return [None]
        out: list[torch.Tensor | None] = []
        for seq, row in zip(seqs, rows, strict=True):
            try:
                out.append(self._forward(model, cache, [row])[0])
            except Exception as exc:
                failed[seq.request.request_id] = exc
                out.append(None)
        return out

    def _target_row(self, seq: _Sequence) -> _Row:
        """The sequence's verification row: its pending tokens, then its drafts (chain) or every
        node of its tree, with logits for the last real token and each draft."""
        pending = seq.tokens[seq.target_len:]
        tree = seq.step_tree
        if tree is None:
            return _Row(seq.slot, seq.target_len, pending + seq.drafts, seq.step_k + 1, self._fused_prefix(seq))
        return _Row(seq.slot, seq.target_len, pending + tree.tokens[1:], tree.layout.size, self._fused_prefix(seq),
                    tree.verification_row(len(pending)))

    def _room(self, seq: _Sequence, k: int) -> int:
        """``k`` cut to what the sequence can use: more than remaining - 1 drafts could never be
        emitted, and the cache must hold them too."""
        remaining = seq.request.max_tokens - seq.emitted
        return max(0, min(k, self.max_k, remaining - 1, self.max_positions - len(seq.tokens) - 1))

    def _prefilling(self, seq: _Sequence) -> bool:
        """More pending prompt tokens than ride along in a batched decode forward, or the rest of
        a prompt whose first chunks were cached: computed as a cold prefill computes them."""
        return (len(seq.tokens) - seq.target_len > self._batched_row_limit
                or (seq.cached > 0 and seq.target_len == seq.cached))

    def _fused_prefix(self, seq: _Sequence) -> int:
        """Pending tokens the target may compute with fused attention: in a sequence's first
        forward, its prompt if that is a prefill, exactly as an undisturbed run's first forward.

        A resumed request's prompt ids end with output another worker generated
        (``resumed_tokens``). That worker prefilled only the prompt and computed the output in
        decode steps, row-invariant. The fused kernel's blocking depends on the number of
        queries, so output computed fused rounds differently (in bfloat16, often enough to flip a
        later near-tie). Split the same way, cache and logits are the undisturbed run's, bit for
        bit, wherever verification is (tests/unit/engine/test_engine_resume.py).
        """
        if seq.target_len > seq.cached:
            return 0
        prompt = len(seq.request.prompt_ids) - seq.request.resumed_tokens
        return prompt - seq.target_len if prompt > self._batched_row_limit else 0

    def _propose(self, seqs: list[_Sequence], failed: dict[str, Exception]) -> None:
        """Draft K_i tokens for each sequence, batched across sequences per draft position.

        A sequence whose drafting raises is recorded in ``failed`` and drafts no further.
        """
        if not seqs:
            return
        assert self.draft is not None and self.draft_cache is not None
        if propose_greedy(self.draft, self.draft_cache, self.drafting_in_one_call, seqs):
            return
        for j in range(max(s.step_k for s in seqs)):
            active = [s for s in seqs if s.step_k > j and s.request.request_id not in failed]
            # First position: catch the draft cache up (1-2 tokens, more after a plain spell).
            rows = [_Row(s.slot, s.draft_len, s.tokens[s.draft_len:] if j == 0 else [s.drafts[-1]], 1)
                    for s in active]
            logits = self._forward_isolated(self.draft, self.draft_cache, active, rows, failed)
            for seq, row, row_logits in zip(active, rows, logits, strict=True):
                if row_logits is None:
                    continue
                seq.draft_len += len(row.new_tokens)
                try:
                    draft_token(seq, row_logits[0], j)
                except Exception as exc:
                    failed[seq.request.request_id] = exc

    def _drafts_with_model(self, seq: _Sequence) -> bool:
        """Proposes with the draft model (not by lookup, not with the EAGLE-3 head)."""
        return not self._looks_up(seq) and not eagle_step.uses_head(seq)

    def _looks_up(self, seq: _Sequence) -> bool:
        """Proposes by lookup (ngram, suffix) rather than with the draft model."""
        return self.lookup is not None and seq.request.method in LOOKUP_METHODS

    def _below_min_tokens(self, seq: _Sequence) -> bool:
        return seq.request.params.position_offset + seq.emitted < seq.request.params.min_tokens

    def _settle(self, seq: _Sequence, logits: torch.Tensor, depth: int) -> StepEvent:
        before = len(seq.tokens)
        path = None
        if self._below_min_tokens(seq) and self.eos_ids:  # a plain step (see step): one position
            logits = logits.clone()
            logits[:, sorted(self.eos_ids)] = float("-inf")
        if seq.step_tree is not None:
            # A tree: its own rules and its own cache moves (tree_step.settle sets both lengths).
            tree_tokens, path = tree_step.settle(self, seq, logits)
            verdict = Verdict(tree_tokens, path.accepted)
        elif seq.request.params.temperature <= 0.0:
            # Greedy: the general rule with one-hot p and q reduces to comparing argmaxes; doing
            # that directly skips building V-wide distributions on the hot path.
            verdict = verify_greedy(seq.drafts, logits.argmax(dim=-1).tolist())
        elif seq.coupled:
            # The target's own Gumbel-max token at each position decides, as the argmax does
            # for greedy: a draft stands while it equals it; plain decoding is the K = 0 case.
            noise = torch.stack([seq.noise_at(j, logits.shape[-1]) for j in range(seq.step_k + 1)])
            verdict = verify_greedy(seq.drafts, gumbel_max(logits, seq.request.params, noise))
        elif seq.step_k > 0 and self._looks_up(seq):  # point masses (lookup/proposer.py)
            verdict = verify_point_mass(seq.drafts, probabilities(logits, seq.request.params), seq.generator)
        elif seq.step_k > 0:
            p = probabilities(logits, seq.request.params)  # (K+1, V)
            verdict = verify(torch.tensor(seq.drafts), torch.stack(seq.draft_probs), p, seq.generator)
        else:
            p = probabilities(logits, seq.request.params)
            verdict = Verdict([int(sample(p[0], seq.generator).item())], 0)
        new_tokens, accepted = verdict.tokens, verdict.accepted
        if seq.step_tree is None:
            if seq.step_k > 0 and self._drafts_with_model(seq):
                # Rewind: the draft cache holds the prefix plus d_1..d_{K-1}; keep what was accepted.
                seq.draft_len = before + min(accepted, seq.step_k - 1)
            seq.target_len = before + accepted  # rewind the target cache to the accepted prefix
            if eagle_step.uses_head(seq):
                eagle_step.rewind(seq)
        emitted: list[int] = []
        finish: FinishReason | None = None
        for token in new_tokens:
            if token in self.eos_ids and not seq.request.params.ignore_eos:
                finish = "stop"
                break
            emitted.append(token)
            if seq.emitted + len(emitted) >= seq.request.max_tokens:
                finish = "length"
                break
        seq.tokens.extend(emitted)
        seq.emitted += len(emitted)
        if seq.noise:  # positions now emitted are never read again
            done = seq.request.params.position_offset + seq.emitted
            seq.noise = {pos: g for pos, g in seq.noise.items() if pos >= done}
        cached = None if self.prefix is None or seq.cache_reported else seq.cached
        seq.cache_reported = True
        # Replayed before the suffix store takes this request's own documents, as a run saw it.
        shadow = () if finish is None or self.lookup is None else shadow_at_finish(
            self.lookup, seq, new_tokens[len(emitted)] if finish == "stop" else None, self.max_k, self.max_positions,
            seq.cached > 0 or len(seq.request.prompt_ids) > self._batched_row_limit)  # its first step: _prefilling
        if finish is not None:
            if self.prefix is not None and self.draft_cache is not None and seq.draft_len > 0:
                fused = len(seq.request.prompt_ids) - seq.request.resumed_tokens
                self.prefix.store_draft(seq.tokens, min(seq.draft_len, fused), self.draft_cache, seq.slot,
                                        seq.request.cache_scope)
            if self.lookup is not None:  # the suffix store keeps the finished prompt and output
                request = seq.request
                self.lookup.finished(request.request_id, request.prompt_ids, seq.tokens[len(request.prompt_ids):],
                                     request.session, request.cache_scope)
            self.abort(seq.request.request_id)
        return StepEvent(seq.request.request_id, emitted, seq.step_k, accepted, depth, finish, eos=finish == "stop",
                         path=path, cached_tokens=cached, shadow=shadow)

    def _forward(self, model: LlamaForCausalLM, cache: KVCache, rows: list[_Row]) -> list[torch.Tensor]:
        """Runs rows through a model; returns each row's (n_logits, V) logits in order (row_batches.py)."""
        return forward_rows(model, cache, rows, RowLimits(model is self.target, self._batched_row_limit,
                                                          self.prefill_chunk, self.max_positions))

    # -- convenience ---------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> list[StepEvent]:
        """Runs one request to completion alone (tests, benchmarks)."""
        self.add(request)
        events: list[StepEvent] = []
        while self.has_work:
            events.extend(e for e in self.step() if e.request_id == request.request_id)
        return events

