"""A Llama-architecture decoder that loads Hugging Face checkpoint directories.

The same directory (``config.json`` with ``LlamaForCausalLM`` fields, ``model.safetensors``,
``tokenizer.json``) loads unchanged in transformers and vLLM. Parameter names follow the
Hugging Face layout so the state dict round-trips. ``prepare_inference`` then fuses the q/k/v
and gate/up projections into single matmuls (on a CPU at batch 1 the per-op overhead, not the
FLOPs, dominates a small model's step time) and lays every projection out once for the CPU's
matmul library (``FrozenLinear``).

Two forward paths share the weights:
- ``forward_train(tokens)``: full causal attention, no cache (training, reference passes).
- ``forward_cached(tokens, slots, starts, lengths)``: the serving path. The KV cache is
  allocated once per sequence slot and written by position; a rejected draft is undone by
  the caller moving its position back, never by copying.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from workers.engines.embedded.aux_states import AuxCapture
from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.kernels import fused_forward, rowgemm
from workers.engines.embedded.kv_cache import CacheBatch, KVCache
from workers.engines.embedded.layers import RMSNorm, apply_rotary, attend_per_query, rotary_tables
from workers.engines.embedded.projections import Embedding, FrozenLinear, Linear, Products, release_sources
from workers.engines.embedded.reduced_vocab import check_same_tokenizer, projected_embedding, vocab_ids
from workers.engines.embedded.trees.attention import attend_gathered, gather_keys


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)
        self.qkv_fused: FrozenLinear | None = None
        self.o_frozen: FrozenLinear | None = None

    def prepare_inference(self, packed: bool, products: Products = "float32") -> None:
        self.qkv_fused = FrozenLinear(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                                      packed, products)
        self.o_frozen = FrozenLinear(self.o_proj.weight, packed, products)

    def _out(self, attended: torch.Tensor) -> torch.Tensor:
        if self.o_frozen is not None:
            return self.o_frozen(attended)
        return F.linear(attended, self.o_proj.weight)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, L, D) and k, v (B, Hkv, L, D), rotary applied; cos/sin (B, L, 1, D)."""
        cfg = self.cfg
        b, length, _ = x.shape
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if self.qkv_fused is not None:
            qkv = self.qkv_fused(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv = qkv.view(b, length, heads + 2 * kv_heads, cfg.head_dim)
        # One rotary pass over the query and key heads together: half the small ops of two.
        qk = apply_rotary(qkv[:, :, :heads + kv_heads], cos, sin)
        q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
        return q, k, qkv[:, :, heads + kv_heads:].transpose(1, 2)

    def forward_train(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self._out(out.transpose(1, 2).reshape(b, length, -1))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       layer: int, batch: CacheBatch) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        k_layer, v_layer = cache.k[layer], cache.v[layer]
        span = batch.key_span
        if batch.single is not None:
            slot, start = batch.single
            k_layer[slot, :, start:start + length] = k[0]
            v_layer[slot, :, start:start + length] = v[0]
        else:
            sc = batch.scatter
            assert sc is not None
            # Write only the valid (non-padding) tokens, each at its own (slot, position).
            k_layer[sc.write_slots, :, sc.write_positions] = k.transpose(1, 2)[sc.valid_rows, sc.valid_cols]
            v_layer[sc.write_slots, :, sc.write_positions] = v.transpose(1, 2)[sc.valid_rows, sc.valid_cols]
        if batch.tree_keys is not None:
            out = self._attend_tree(q, k_layer, v_layer, batch)
            return self._out(out.transpose(1, 2).reshape(b, length, -1))
        if batch.single is not None:
            slot = batch.single[0]
            keys, values = k_layer[slot:slot + 1, :, :span], v_layer[slot:slot + 1, :, :span]
        else:
            sc = batch.scatter
            assert sc is not None
            if sc.contiguous_slots is not None:
                lo, hi = sc.contiguous_slots
                keys, values = k_layer[lo:hi, :, :span], v_layer[lo:hi, :, :span]
            else:
                keys, values = k_layer[sc.slots, :, :span], v_layer[sc.slots, :, :span]
        if batch.row_invariant:
            assert batch.mask is not None
            out = attend_per_query(q, keys, values, batch.mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
        return self._out(out.transpose(1, 2).reshape(b, length, -1))

    @staticmethod
    def _attend_tree(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: CacheBatch) -> torch.Tensor:
        """Attention of a batch with token trees (after this forward's K/V are written): each
        query over its keys gathered into logical order, masked past its logical position."""
        assert batch.tree_keys is not None and batch.mask is not None
        slots, index = batch.tree_keys
        return attend_gathered(q, gather_keys(k_layer, slots, index), gather_keys(v_layer, slots, index), batch.mask)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_fused: FrozenLinear | None = None
        self.down_frozen: FrozenLinear | None = None

    def prepare_inference(self, packed: bool, products: Products = "float32") -> None:
        self.gate_up_fused = FrozenLinear(torch.cat([self.gate_proj.weight, self.up_proj.weight]), packed, products)
        self.down_frozen = FrozenLinear(self.down_proj.weight, packed, products)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_fused is not None and self.down_frozen is not None:
            gate, up = self.gate_up_fused(x).chunk(2, dim=-1)
            return self.down_frozen(F.silu(gate) * up)
        gate, up = self.gate_proj(x), self.up_proj(x)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_train(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_train(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       index: int, batch: CacheBatch) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, index, batch)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Backbone(nn.Module):
    """Named ``model`` in the state dict, as in Hugging Face's ``LlamaForCausalLM``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def blocks(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]


# The native float32 path (LlamaForCausalLM._forward_native) attends with its own kernel, in
# the one-call forward, in forwards up to this many tokens and in every row-invariant one;
# longer ones (long prefills) with SDPA. On the AVX2 CPU (bench.engine's prefill_by_tokens_ms,
# one run) the one call prefilled 32 / 64 / 128 tokens in 13.5 / 23.1 / 55.3 ms against SDPA's
# 18.0 / 26.7 / 60.0, and 256 / 512 tokens in 111.3 / 267.7 against 110.1 / 259.1; it was 16
# while the per-op path was the native one. Per model, so the bench can time SDPA beside it.
NATIVE_ATTENTION_MAX_TOKENS = 128

class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    native_attention_max_tokens: int = NATIVE_ATTENTION_MAX_TOKENS

    def __init__(self, cfg: ModelConfig) -> None:
        """Weights unset (the norms' are 1): ``init_weights``, ``load_state_dict``, ``from_pretrained``."""
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        head_rows = cfg.draft_vocab_size or cfg.vocab_size
        if head_rows != cfg.vocab_size and cfg.tie_word_embeddings:
            raise ValueError(f"a head of {head_rows} rows cannot share the {cfg.vocab_size}-row embedding")
        self.lm_head = Linear(cfg.hidden_size, head_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A reduced-vocabulary draft: the token id each head row scores (full_vocab_logits).
        self.vocab_ids: torch.Tensor | None = None
        self.head_frozen: FrozenLinear | None = None
        # Set by prepare_inference where the float32 forward runs workers/engines/embedded/kernels/rowgemm.py's kernels.
        self.native: rowgemm.RowGemm | None = None
        self.fused: fused_forward.FusedForward | None = None  # the same path in one kernel call
        self.released = False  # release_sources emptied the laid-out projections' weights
        # A model served from the GGUF's blocks (quantized.py): its Q8_0 embedding, also the tied head.
        self.embed_panels: rowgemm.Panels | None = None
        # Set (by the engine, for a step that serves an EAGLE-3 head): every cached forward also
        # records the residual stream after the head's layers at each real token (aux_states.py).
        self.aux_capture: AuxCapture | None = None
        cos, sin = rotary_tables(cfg, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # -- construction -------------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                # Output projections are scaled down with depth (GPT-2 style) so the residual
                # stream does not grow with the number of layers.
                residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                scale = 1 / math.sqrt(2 * self.cfg.num_hidden_layers) if residual_out else 1.0
                with torch.no_grad():
                    p.normal_(0.0, std * scale, generator=gen)

    @classmethod
    def from_pretrained(cls, directory: Path | str, dtype: torch.dtype = torch.float32,
                        packed: bool = True, products: Products = "float32",
                        target: Path | str | None = None) -> LlamaForCausalLM:
        """``target``: the target's directory, for a draft whose embedding is the target's own
        table projected (``ModelConfig.embedding``)."""
        directory = Path(directory)
        cfg = ModelConfig.from_json(directory / "config.json")
        model = cls(cfg)
        state = load_file(str(directory / "model.safetensors"))
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.vocab_ids = vocab_ids(directory, cfg, state.pop("draft_vocab_ids", None))
        if cfg.embedding == "target_projection":
            projection = state.pop("embed_proj.weight", None)
            state["model.embed_tokens.weight"] = projected_embedding(directory, cfg, projection, target)
        elif cfg.embedding != "own":
            raise ValueError(f"{directory / 'config.json'}: embedding must be own or target_projection, "
                             f"got {cfg.embedding!r}")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{directory}: checkpoint mismatch, missing={missing} unexpected={unexpected}")
        model.to(dtype)
        return model.prepare_inference(packed, products)

    @classmethod
    def load_draft(cls, directory: Path | str, dtype: torch.dtype = torch.float32,
                   products: Products = "float32", target: Path | str | None = None) -> LlamaForCausalLM:
        """A draft as the engine serves it: in float32 on kernels/rowgemm.py's kernels (where they
        build), from its checkpoint's own bfloat16 weights. int8 projections served it while the
        bfloat16 kernel widened 8 weights at a time; with the paired layout bfloat16 measured as
        fast at one token and 20-25% faster at four (AVX2 CPU, taking turns with the target's
        forward), and it is the draft the demo pair was trained as. ``products``: the target's
        (a worker's draft multiplies as its target does; its numerics change acceptance only).
        ``target``: the target's directory: where given, the draft must tokenize as it does (the
        same tokenizer files), and a draft that reads the target's embedding needs it."""
        if target is not None:
            check_same_tokenizer(Path(target), Path(directory))
        return cls.from_pretrained(directory, dtype, packed=True, products=products, target=target)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding of ``tokens`` (any shape): the table's rows, or, for a model served
        from blocks, its Q8_0 rows widened as its products see them (float32)."""
        if self.embed_panels is not None:
            assert self.native is not None
            return self.native.embedding_rows(self.embed_panels, tokens)
        out: torch.Tensor = self.model.embed_tokens(tokens)
        return out

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, head rows) logits as (N, vocab_size): a reduced-vocabulary draft's rows at their
        token ids, -inf elsewhere (probability 0: speculative sampling stays exact with any q,
        and a token the draft cannot propose is never drafted). Unchanged for a full head."""
        if self.vocab_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.cfg.vocab_size), float("-inf"), dtype=logits.dtype)
        full[:, self.vocab_ids] = logits
        return full

    @property
    def prepacked(self) -> bool:
        """Whether the projections run on weights laid out once for a row-invariant kernel:
        oneDNN's prepacked bfloat16, or float32 panels on kernels/rowgemm.py's (see FrozenLinear)."""
        head = self.head_frozen
        return head is not None and (head.packed is not None or head.panels is not None)

    @property
    def products(self) -> Products:
        """How the projections multiply (``Products``): "bfloat16" where they run bfloat16 products."""
        return "bfloat16" if self.head_frozen is not None and self.head_frozen.dot else "float32"

    def prepare_inference(self, packed: bool = True, products: Products = "float32") -> LlamaForCausalLM:
        """Freeze for serving: eval, no grad, fused projections, prepacked where this CPU can
        (``packed``; False: plain ``F.linear``, the reference the packed kernels are measured against),
        with bfloat16 products where asked and the kernels have them (``products``).

        The frozen projections snapshot the weights: call this after the last weight change.
        """
        self._check_sources("prepare_inference")
        self.eval().requires_grad_(False)
        for layer in self.model.blocks():
            layer.self_attn.prepare_inference(packed, products)
            layer.mlp.prepare_inference(packed, products)
        self.head_frozen = FrozenLinear(self.lm_head.weight, packed, products)
        kernel = self.head_frozen._rowgemm if self.head_frozen.panels is not None else None
        self.native = kernel if kernel is not None and kernel.supports(self.cfg.hidden_size,
                                                                       self.cfg.head_dim) else None
        self.fused = None
        if self.native is not None:
            self.fused = self.one_call_forward(self.native, self.model.embed_tokens.weight.detach().contiguous())
        return self

    def one_call_forward(self, kernel: rowgemm.RowGemm,
                         embed: torch.Tensor | rowgemm.Panels) -> fused_forward.FusedForward:
        """The whole forward in one kernel call over the frozen projections (every one on panels),
        the norms and ``embed``: a float32 table, or the Q8_0 panels of a model served from blocks."""
        cfg, frozen = self.cfg, self.frozen_projections()
        panels = [(f.panels, f.dot) for f in frozen if f is not None and f.panels is not None]
        assert len(panels) == len(frozen)
        norms = [w for layer in self.model.blocks()
                 for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        return fused_forward.FusedForward(
            kernel, embed=embed, norms=[*norms, self.model.norm.weight], panels=panels,
            hidden=cfg.hidden_size, inter=cfg.intermediate_size, heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            cos=self.rope_cos, sin=self.rope_sin)

    def release_sources(self) -> int:
        """For serving: empty the projections' weights that ``prepare_inference`` laid out again
        (about 400 MB of SmolLM2's float32 target; the embedding, tied head and norms stay); the
        bytes freed. Training, saving and preparing again need them: each then refuses."""
        freed = 0
        for layer in self.model.blocks():
            attn, mlp = layer.self_attn, layer.mlp
            freed += release_sources([attn.q_proj, attn.k_proj, attn.v_proj], attn.qkv_fused)
            freed += release_sources([attn.o_proj], attn.o_frozen) + release_sources([mlp.down_proj], mlp.down_frozen)
            freed += release_sources([mlp.gate_proj, mlp.up_proj], mlp.gate_up_fused)
        if not self.cfg.tie_word_embeddings:
            freed += release_sources([self.lm_head], self.head_frozen)
        self.released = self.released or freed > 0
        return freed

    def _check_sources(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"{what} needs the projections' weights, which release_sources emptied for serving")

    def frozen_projections(self) -> list[FrozenLinear | None]:
        """The frozen projections in forward order: QKV, O, gate/up, down per layer, then the LM head."""
        return [*(f for layer in self.model.blocks() for f in (layer.self_attn.qkv_fused, layer.self_attn.o_frozen,
                                                               layer.mlp.gate_up_fused, layer.mlp.down_frozen)),
                self.head_frozen]

    def save_pretrained(self, directory: Path | str, dtype: torch.dtype = torch.bfloat16) -> None:
        self._check_sources("save_pretrained")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        if self.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(self.cfg.to_hf_json(), indent=2) + "\n")

    # -- forward paths --------------------------------------------------------------------
    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), full causal attention, no cache."""
        self._check_sources("forward_train")
        _, length = tokens.shape
        cos = self.rope_cos[:length].to(self.lm_head.weight.dtype)[None, :, None]
        sin = self.rope_sin[:length].to(self.lm_head.weight.dtype)[None, :, None]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.blocks():
            x = layer.forward_train(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache, batch: CacheBatch,
                       logit_rows: torch.Tensor | None = None,
                       logit_cols: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, L) new tokens -> logits.

        Returns (B, L, V), or (N, V) for the (row, col) pairs given, which avoids the LM head
        over padding and prefill positions whose logits nobody reads.
        """
        if self.native is not None:
            return self._forward_native(self.native, tokens, cache, batch, logit_rows, logit_cols)
        cos, sin = self._rotary(batch, tokens.shape[1])
        x = self.embed_rows(tokens)
        capture, captured = self.aux_capture, []
        for i, layer in enumerate(self.model.blocks()):
            if capture is not None and i in capture.layer_ids:
                captured.append(x.float())
            x = layer.forward_cached(x, cos, sin, cache, i, batch)
        if capture is not None:
            capture.add_padded(captured, *batch.rows)
        if logit_rows is not None and logit_cols is not None:
            x = x[logit_rows, logit_cols]
        x = self.model.norm(x)
        logits = self.head_frozen(x) if self.head_frozen is not None else self.lm_head(x)
        return logits.float()

    def _rotary(self, batch: CacheBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables at the forward's positions, shaped to broadcast over heads. (They
        were cast with the model: buffers follow .to(dtype).)"""
        if batch.single is not None and batch.trees is None:  # trees: logical positions
            start = batch.single[1]
            return (self.rope_cos[start:start + length][None, :, None],
                    self.rope_sin[start:start + length][None, :, None])
        return self.rope_cos[batch.positions][:, :, None], self.rope_sin[batch.positions][:, :, None]

    def _forward_native(self, kernel: rowgemm.RowGemm, tokens: torch.Tensor, cache: KVCache, batch: CacheBatch,
                        logit_rows: torch.Tensor | None, logit_cols: torch.Tensor | None) -> torch.Tensor:
        """``forward_cached`` in float32 on workers/engines/embedded/kernels/rowgemm.py's kernels: one call each for a
        norm, a projection, SwiGLU, and rotary + cache write + attention, instead of a dozen
        small torch ops each (at batch 1 a small model's step is mostly their overhead).

        Every kernel computes a row from that row alone, and attention reads each query's own
        prefix of keys, so a token's logits do not depend on the forward's shape: verification
        is bit-identical to plain decoding without padding key spans. A long forward that need
        not be row-invariant (a prefill) attends with the fused SDPA kernel instead, faster there.
        """
        cfg = self.cfg
        length = tokens.shape[1]
        if batch.trees is not None:
            return self._forward_trees(tokens, cache, batch, logit_rows, logit_cols)
        native_attention = batch.row_invariant or length <= self.native_attention_max_tokens
        if native_attention:
            cache_shape = cache.k[0].shape
            fused_forward.check_bounds(tokens, cfg.vocab_size, batch.rows, cache_shape[0], cache_shape[2])
            rows = torch.tensor(batch.rows, dtype=torch.long)
            if self.fused is not None:
                capture = self.aux_capture
                if logit_rows is not None and logit_cols is not None:
                    return self.fused(tokens, cache.k, cache.v, rows, logit_rows * length + logit_cols, capture)
                logits = self.fused(tokens, cache.k, cache.v, rows, torch.arange(tokens.numel()), capture)
                return logits.view(*tokens.shape, -1)
        else:
            cos, sin = self._rotary(batch, length)
        x = self.embed_rows(tokens)
        capture, captured = self.aux_capture, []
        for i, layer in enumerate(self.model.blocks()):
            if capture is not None and i in capture.layer_ids:
                captured.append(x.clone())
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.qkv_fused is not None and attn.o_frozen is not None
            assert mlp.gate_up_fused is not None and mlp.down_frozen is not None
            h = kernel.rmsnorm(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
            if native_attention:
                attended = kernel.rope_attend(attn.qkv_fused(h), self.rope_cos, self.rope_sin, cache.k[i], cache.v[i],
                                              rows, cfg.num_attention_heads, cfg.num_key_value_heads)
                x = x + attn.o_frozen(attended)
            else:
                x = x + attn.forward_cached(h, cos, sin, cache, i, batch)
            h = kernel.rmsnorm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            x = x + mlp.down_frozen(kernel.swiglu(mlp.gate_up_fused(h)))
        if capture is not None:
            capture.add_padded(captured, *batch.rows)
        if logit_rows is not None and logit_cols is not None:
            x = x[logit_rows, logit_cols]
        assert self.head_frozen is not None
        return self.head_frozen(kernel.rmsnorm(x.contiguous(), self.model.norm.weight, cfg.rms_norm_eps))

    def _forward_trees(self, tokens: torch.Tensor, cache: KVCache, batch: CacheBatch,
                       logit_rows: torch.Tensor | None, logit_cols: torch.Tensor | None) -> torch.Tensor:
        """A native forward with token trees: the one-call kernel's ``forward_tree`` (the per-op
        path has no tree attention; every model on the kernels has the one-call forward)."""
        if self.fused is None or batch.trees is None:
            raise NotImplementedError("token trees on the native kernels need the one-call forward")
        slots, starts, lengths = batch.rows
        length = tokens.shape[1]
        rows = [row[:n] for row, n in zip(tokens.tolist(), lengths, strict=True)]
        wanted = ((logit_rows * length + logit_cols).tolist() if logit_rows is not None and logit_cols is not None
                  else list(range(tokens.numel())))
        logits = self.fused.run_rows(rows, cache.k, cache.v, list(slots), list(starts), wanted, trees=batch.trees,
                                     capture=self.aux_capture)
        return logits if logit_rows is not None and logit_cols is not None else logits.view(*tokens.shape, -1)
