"""One kernel call per forward: ``FusedForward`` runs a whole model forward (every layer's
projections, attention over the KV cache, trees included) in one call into the compiled library
rowgemm.py loads, and the bounds checks that guard it (``check_bounds``, ``check_rows``): the C
side trusts the ids and spans it is handed."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from workers.engines.embedded.aux_states import AuxCapture
from workers.engines.embedded.kernels.rowgemm import Panels, RowGemm
from workers.engines.embedded.trees.attention import TREE_STRIDE, pack_trees
from workers.engines.embedded.trees.tree import TreeRow


def check_bounds(tokens: torch.Tensor, vocab: int, rows: tuple[tuple[int, ...], ...], slots: int,
                 positions: int) -> None:
    """Raises ValueError unless every token id is in the vocabulary and every row's cache span
    lies inside the cache. The C side indexes with these unchecked: the engine's own limits
    (admission, K capped at the context's end) keep them in range, and this keeps a bug there
    an exception instead of a write past the cache."""
    token_range = (int(tokens.min()), int(tokens.max())) if tokens.numel() else None
    check_rows(token_range, vocab, rows, tokens.shape[0], tokens.shape[1], slots, positions)


def check_rows(token_range: tuple[int, int] | None, vocab: int, rows: tuple[Sequence[int], ...], batch: int,
               width: int, slots: int, positions: int) -> None:
    """``check_bounds`` from the tokens' lowest and highest id (None: no tokens) and the batch's
    shape, for callers that hold Python lists rather than a tensor."""
    slot_ids, starts, lengths = rows
    if token_range is not None and (token_range[0] < 0 or token_range[1] >= vocab):
        raise ValueError(f"token id outside the vocabulary of {vocab}")
    if not len(slot_ids) == len(starts) == len(lengths) == batch or any(
            not (0 <= slot < slots and start >= 0 and 0 <= n <= width and start + n <= positions)
            for slot, start, n in zip(slot_ids, starts, lengths, strict=True)):
        raise ValueError(f"cache rows out of range: {tuple(rows)} for {slots} slots x {positions} positions")


def _check_logit_rows(lowest: int, highest: int, tokens: int) -> None:
    if lowest < 0 or highest >= tokens:
        raise ValueError(f"logit rows out of range for {tokens} tokens")


class _Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("ks", ctypes.c_int64), ("kind", ctypes.c_int64)]


_DOT_KIND = 2  # bfloat16 products of bfloat16 panels (Panels.kind: the others)
_PointerArray = ctypes.Array[ctypes.c_void_p]


class FusedForward:
    """A model's whole cached forward in one call of the kernel (``forward`` in the C source):
    the per-op path's kernels in the same order, without a Python call per op. Built once per
    model; holds references to every tensor the C side reads."""

    def __init__(self, kernel: RowGemm, *, embed: torch.Tensor | Panels, norms: list[torch.Tensor],
                 panels: list[tuple[Panels, bool]],
                 hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._kernel = kernel
        self._fn = kernel._lib.forward
        self._fn.restype = None
        # Typed arguments: ctypes converts plain ints and floats itself, cheaper than wrapping each.
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr,
                             i64, i64, i64, f32, f32, ptr, i64, i64, ptr, ptr]
        self._draft = kernel._lib.draft_greedy
        self._draft.restype = None
        # The 22 arguments both C functions begin with (_forward_args), then draft_greedy's own.
        self._draft.argtypes = [*self._fn.argtypes[:22], ptr, i64, ptr, ptr, i64, ptr]
        # forward with token trees: forward's arguments, then the per-token tree array.
        self._tree_fn = kernel._lib.forward_tree
        self._tree_fn.restype = None
        self._tree_fn.argtypes = [*self._fn.argtypes, ptr]
        # forward (tree or not) that also copies an EAGLE-3 head's hidden states (aux_states.py).
        self._aux_fn = kernel._lib.forward_aux
        self._aux_fn.restype = None
        self._aux_fn.argtypes = [*self._fn.argtypes, ptr, ptr, ptr, i64]
        kernel._lib.rowgemm_tree_depth.restype = i64
        if kernel._lib.rowgemm_tree_depth() + 2 != TREE_STRIDE:  # the C side's stride is a constant
            raise ValueError("rowgemm.c's TREE_DEPTH is not policies.tree.MAX_TREE_DEPTH")
        self._keep = (embed, norms, panels, cos, sin)
        self.embed, self.cos, self.sin = embed, cos, sin
        # The embedding as the C side reads it (embed_row): a float32 table, or Q8_0 panels.
        if isinstance(embed, Panels):
            if embed.blocks != "q8_0":
                raise ValueError("an embedding in blocks must be Q8_0 panels")
            self._embed = _Lin(embed.weights.data_ptr(), embed.weights.shape[1], embed.kind)
            self._embed_rows = embed.weights.shape[0] * 8
        else:
            self._embed = _Lin(embed.data_ptr(), 0, 0)
            self._embed_rows = embed.shape[0]
        self.norms = (ctypes.c_void_p * len(norms))(*[n.data_ptr() for n in norms])
        # Each projection's panels and whether they multiply as bfloat16 products (kind 2).
        if any(dot and not kernel.can_dot(p) for p, dot in panels):
            raise ValueError("bfloat16 products need AVX512-BF16 and bfloat16 panels")
        self.lins = (_Lin * len(panels))(*[
            _Lin(p.weights.data_ptr(), p.weights.shape[1], _DOT_KIND if dot else p.kind)
            for p, dot in panels])
        self.layers = (len(panels) - 1) // 4
        self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim = hidden, inter, heads, kv_heads, head_dim
        self.vocab = panels[-1][0].weights.shape[0] * 8
        self.eps, self.scale = eps, 1.0 / head_dim ** 0.5
        # The caches' layer pointers, per cache (a worker has two: the target's and the draft's).
        self._cache_ptrs: dict[tuple[int, ...], tuple[_PointerArray, _PointerArray]] = {}

    def _pointers(self, k_cache: list[torch.Tensor],
                  v_cache: list[torch.Tensor]) -> tuple[_PointerArray, _PointerArray]:
        key = tuple(t.data_ptr() for t in (*k_cache, *v_cache))
        found = self._cache_ptrs.get(key)
        if found is None:
            if len(self._cache_ptrs) > 8:  # caches come and go only in tests and benchmarks
                self._cache_ptrs.clear()
            found = self._cache_ptrs[key] = ((ctypes.c_void_p * self.layers)(*key[:self.layers]),
                                             (ctypes.c_void_p * self.layers)(*key[self.layers:]))
        return found

    def __call__(self, tokens: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 rows: torch.Tensor, logit_idx: torch.Tensor, capture: AuxCapture | None = None) -> torch.Tensor:
        """tokens (B, L); rows (3, B) slots/starts/lengths; logit_idx (N,) into B*L -> logits (N, V).

        Only each row's real tokens are computed (packed: a step mixing 1-token and (K+1)-token
        rows costs their tokens); a padding position's logits are 0."""
        if logit_idx.numel():
            _check_logit_rows(int(logit_idx.min()), int(logit_idx.max()), tokens.numel())
        return self._run(tokens.contiguous(), k_cache, v_cache, rows, logit_idx.contiguous(), capture)

    def run_rows(self, tokens: list[list[int]], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 slots: list[int], starts: list[int], logit_idx: list[int],
                 trees: Sequence[TreeRow | None] | None = None, capture: AuxCapture | None = None) -> torch.Tensor:
        """The same from Python lists: row b's new tokens ``tokens[b]`` (padded to the longest),
        written at ``starts[b]`` of cache slot ``slots[b]``; logits (N, V) for the positions
        ``logit_idx`` (into the padded B x L). Checks every index the C side would use unchecked
        (what ``check_bounds`` and ``__call__`` check), without a torch op per check: at batch 1
        they cost more than a draft model's forward.

        ``trees``: per row, its ``TreeRow`` (token l still written at ``starts[b] + l``, rotated
        and attending as its logical position and key map say: ``forward_tree`` in the source)
        or None (an ordinary row); None for all: the ordinary forward, untouched."""
        tensor, rows, lengths = self._checked_rows(tokens, k_cache, slots, starts, 0)
        b, length = tensor.shape
        if logit_idx:
            _check_logit_rows(min(logit_idx), max(logit_idx), b * length)
        idx = torch.tensor(logit_idx, dtype=torch.long)
        if trees is None or all(t is None for t in trees):
            return self._run(tensor, k_cache, v_cache, rows, idx, capture)
        tree = pack_trees(trees, starts, lengths, self.cos.shape[0], k_cache[0].shape[2])
        scratch, logits = self._buffers(tensor.numel(), len(logit_idx), k_cache)
        if capture is not None:
            self._run_aux(tensor, k_cache, v_cache, rows, idx, logits, scratch, tree, capture)
            return logits
        self._tree_fn(*self._forward_args(tensor, k_cache, v_cache, rows), idx.data_ptr(), len(logit_idx),
                      self.vocab, logits.data_ptr(), scratch.data_ptr(), tree.data_ptr())
        return logits

    def draft_greedy(self, tokens: list[list[int]], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                     slots: list[int], starts: list[int], steps: int) -> list[list[int]]:
        """Greedy drafting, ``steps`` forwards in one call (``draft_greedy`` in the C source):
        the first is ``run_rows``'s with each row's last token's logits, each later one feeds
        every row its previous argmax. Row b's drafts, ``steps`` of them; its cache then holds
        ``tokens[b]`` and all but the last draft. The same forwards, so the same drafts, as
        ``run_rows`` and an argmax per step."""
        if steps < 1 or not tokens or not all(tokens):
            raise ValueError("greedy drafting needs at least one step and one token per row")
        # Every later forward writes one more position per row: check the rows as that long.
        # (The C side advances the rows' starts and lengths in place: ``rows`` is this call's own.)
        tensor, rows, lengths = self._checked_rows(tokens, k_cache, slots, starts, steps - 1)
        b, length = tensor.shape
        idx0 = torch.tensor([row * length + n - 1 for row, n in enumerate(lengths)], dtype=torch.long)
        out = torch.empty(steps * b, dtype=torch.long)
        scratch, logits = self._buffers(b * length, b, k_cache)
        self._draft(*self._forward_args(tensor, k_cache, v_cache, rows), idx0.data_ptr(), self.vocab,
                    logits.data_ptr(), scratch.data_ptr(), steps, out.data_ptr())
        drafts: list[list[int]] = out.view(steps, b).t().tolist()
        return drafts

    def _checked_rows(self, tokens: list[list[int]], k_cache: list[torch.Tensor], slots: list[int],
                      starts: list[int], extra: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Rows padded into a (B, L) tensor, every index checked, room for ``extra`` more
        positions per row; the (3, B) slots/starts/lengths the C side reads; the lengths."""
        b = len(tokens)
        lengths = [len(row) for row in tokens]
        length = max(lengths, default=0)
        flat = [t for row in tokens for t in (*row, *([0] * (length - len(row))))]
        check_rows((min(flat), max(flat)) if flat else None, self.vocab_rows,
                   (slots, starts, [n + extra for n in lengths]), b, length + extra,
                   k_cache[0].shape[0], k_cache[0].shape[2])
        rows = torch.tensor([slots, starts, lengths], dtype=torch.long)
        return torch.tensor(flat, dtype=torch.long).view(b, length), rows, lengths

    def _buffers(self, m: int, n: int, k_cache: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's scratch for m tokens, and logits for n of them (attention's part of it
        grows with the kernels' threads)."""
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        size = (m * (3 * self.hidden + width + self.heads * self.head_dim + 3 * self.inter)
                + self._kernel.score_rows * k_cache[0].shape[2])
        scratch = torch.empty(max(size, n * self.hidden + 1), dtype=torch.float32)
        return scratch, torch.empty((n, self.vocab), dtype=torch.float32)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding: the token ids the forward can read."""
        return self._embed_rows

    def _run(self, tokens: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
             rows: torch.Tensor, logit_idx: torch.Tensor, capture: AuxCapture | None = None) -> torch.Tensor:
        n = logit_idx.shape[0]
        scratch, logits = self._buffers(tokens.numel(), n, k_cache)
        if capture is not None:
            self._run_aux(tokens, k_cache, v_cache, rows, logit_idx, logits, scratch, None, capture)
            return logits
        self._fn(*self._forward_args(tokens, k_cache, v_cache, rows), logit_idx.data_ptr(), n, self.vocab,
                 logits.data_ptr(), scratch.data_ptr())
        return logits

    def _run_aux(self, tokens: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 rows: torch.Tensor, logit_idx: torch.Tensor, logits: torch.Tensor, scratch: torch.Tensor,
                 tree: torch.Tensor | None, capture: AuxCapture) -> None:
        """``forward_aux``: the forward, and the head's states into ``capture`` (aux_states.py)."""
        slots, starts, lengths = rows.tolist()
        ids = torch.tensor(capture.layer_ids, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.layers):
            raise ValueError(f"aux layer ids {capture.layer_ids} outside the model's {self.layers} layers")
        aux = torch.empty((sum(lengths), len(capture.layer_ids) * self.hidden), dtype=torch.float32)
        self._aux_fn(*self._forward_args(tokens, k_cache, v_cache, rows), logit_idx.data_ptr(), logit_idx.shape[0],
                     self.vocab, logits.data_ptr(), scratch.data_ptr(), None if tree is None else tree.data_ptr(),
                     aux.data_ptr(), ids.data_ptr(), ids.numel())
        capture.add_packed(aux, slots, starts, lengths)

    def _forward_args(self, tokens: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                      rows: torch.Tensor) -> tuple[object, ...]:
        """The arguments ``forward`` and ``draft_greedy`` in the C source both begin with: the
        (B, L) tokens, the model, the caches, the rows' slots/starts/lengths, the attention shape."""
        b, length = tokens.shape
        kc, vc = self._pointers(k_cache, v_cache)
        return (tokens.data_ptr(), b, length, ctypes.addressof(self._embed), self.hidden, self.inter, self.layers,
                self.norms, self.lins, kc, vc, k_cache[0].shape[2], self.cos.data_ptr(), self.sin.data_ptr(),
                rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(), self.heads, self.kv_heads,
                self.head_dim, self.eps, self.scale)
