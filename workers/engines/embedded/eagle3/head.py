"""An EAGLE-3 head as the embedded engine serves it, read from vLLM's ``speculators`` eagle3 format
(models/eagle3_format.py writes it; ``speculators`` itself is not needed to serve it).

The head fuses the target's residual stream after three of its layers (``fc``: 3h -> h), then one
decoder layer whose attention reads [input_layernorm(embedding of the next token), hidden_norm(hidden)]
(2h wide) and keeps its own K/V, the final norm, and an LM head over its draft vocabulary
(``d2t``: target id = draft id + d2t[draft id]). Its first forward at a position reads the fused target
states; each later draft feeds back its own output before the norm (vLLM's ``hidden_prenorm``,
speculators' training-time test). The target's embedding is shared, never stored.

Float32 on one sequence at a time, the projections on the engine's kernels (bfloat16 panels: the
checkpoint's values, half the bytes to stream); ``eagle3/costs.py`` times a forward at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.layers import apply_rotary, rotary_tables
from workers.engines.embedded.projections import FrozenLinear

# The target's input embedding: token ids (any shape) -> their rows (..., hidden).
TokenEmbedding = Callable[[torch.Tensor], torch.Tensor]


class HeadFormatError(ValueError):
    """The head directory does not fit the target; the message names the field."""


@dataclass(frozen=True)
class HeadSpec:
    """What the head's ``config.json`` says, checked against the target."""

    layer: ModelConfig  # its one decoder layer's shapes (transformer_layer_config)
    layer_ids: tuple[int, ...]  # eagle_aux_hidden_state_layer_ids
    draft_vocab_size: int
    norm_before_residual: bool
    target_hidden_size: int
    speculative_tokens: int  # speculators_config.proposal_methods[0].speculative_tokens


def _field(raw: dict[str, Any], name: str, path: Path) -> Any:
    if name not in raw:
        raise HeadFormatError(f"{path}: {name} is missing")
    return raw[name]


def read_spec(directory: Path, target: ModelConfig) -> HeadSpec:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HeadFormatError(f"{path}: not readable as JSON ({exc})") from exc
    if raw.get("speculators_model_type") != "eagle3":
        raise HeadFormatError(f"{path}: speculators_model_type must be eagle3 "
                              f"(got {raw.get('speculators_model_type')!r})")
    layer_raw = _field(raw, "transformer_layer_config", path)
    if not isinstance(layer_raw, dict) or layer_raw.get("model_type") != "llama":
        raise HeadFormatError(f"{path}: transformer_layer_config.model_type must be llama "
                              f"(got {layer_raw.get('model_type') if isinstance(layer_raw, dict) else layer_raw!r})")
    names = set(ModelConfig.__dataclass_fields__)
    # transformers 5 writes rotary settings as rope_parameters {rope_theta, rope_type}, 4.x as rope_theta.
    rope = layer_raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise HeadFormatError(f"{path}: transformer_layer_config.rope_parameters.rope_type must be default "
                              f"(got {rope.get('rope_type')!r})")
    theta = layer_raw.get("rope_theta", rope.get("rope_theta"))
    fields: dict[str, Any] = {k: v for k, v in layer_raw.items() if k in names}
    if theta is not None:
        fields["rope_theta"] = float(theta)
    try:
        layer = ModelConfig(**fields)
    except TypeError as exc:
        raise HeadFormatError(f"{path}: transformer_layer_config is incomplete ({exc})") from exc
    target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise HeadFormatError(f"{path}: target_hidden_size is {target_hidden}, the target's hidden size is "
                              f"{target.hidden_size}")
    if layer.hidden_size != target.hidden_size:
        raise HeadFormatError(f"{path}: transformer_layer_config.hidden_size is {layer.hidden_size}, the target's "
                              f"(whose embedding the head shares) is {target.hidden_size}")
    if layer.vocab_size != target.vocab_size:
        raise HeadFormatError(f"{path}: transformer_layer_config.vocab_size is {layer.vocab_size}, the target's "
                              f"is {target.vocab_size}")
    if layer.rope_theta != target.rope_theta or layer.head_dim != target.head_dim:
        raise HeadFormatError(f"{path}: transformer_layer_config's rotary (rope_theta {layer.rope_theta:g}, head_dim "
                              f"{layer.head_dim}) is not the target's ({target.rope_theta:g}, {target.head_dim})")
    ids = _field(raw, "eagle_aux_hidden_state_layer_ids", path)
    if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
            or not all(isinstance(i, int) and 0 <= i < target.num_hidden_layers for i in ids)):
        raise HeadFormatError(f"{path}: eagle_aux_hidden_state_layer_ids must be distinct layer ids in "
                              f"0..{target.num_hidden_layers - 1} (got {ids!r})")
    vocab = _field(raw, "draft_vocab_size", path)
    if not isinstance(vocab, int) or not 1 <= vocab <= target.vocab_size:
        raise HeadFormatError(f"{path}: draft_vocab_size must be in 1..{target.vocab_size} (got {vocab!r})")
    try:
        k = int(raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise HeadFormatError(f"{path}: speculators_config.proposal_methods[0].speculative_tokens is missing") from exc
    return HeadSpec(layer, tuple(ids), vocab, bool(raw.get("norm_before_residual", False)), target_hidden, k)


class Eagle3Head:
    """The head's weights (float32), its own K/V per slot, and its forward."""

    def __init__(self, spec: HeadSpec, state: dict[str, torch.Tensor], embed: TokenEmbedding, slots: int,
                 positions: int) -> None:
        self.spec = spec
        cfg = spec.layer
        self.embed = embed  # the target's (LlamaForCausalLM.embed_rows): shared
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        w = {name: t.float().contiguous() for name, t in state.items() if t.is_floating_point()}
        p = "layers.0."
        # Laid out once for the float32 kernels (kernels/rowgemm.py) where they build: bfloat16 panels
        # (the checkpoint's values exactly), half the bytes a forward streams; else F.linear.
        self.fc = FrozenLinear(w["fc.weight"])
        self.qkv = FrozenLinear(torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                                           w[p + "self_attn.v_proj.weight"]]))
        self.o = FrozenLinear(w[p + "self_attn.o_proj.weight"])
        self.gate_up = FrozenLinear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        self.down = FrozenLinear(w[p + "mlp.down_proj.weight"])
        self.input_norm, self.hidden_norm = w[p + "input_layernorm.weight"], w[p + "hidden_norm.weight"]
        self.post_norm, self.norm = w[p + "post_attention_layernorm.weight"], w["norm.weight"]
        self.lm_head = FrozenLinear(w["lm_head.weight"])
        self.vocab_ids = torch.arange(spec.draft_vocab_size) + state["d2t"].long() if "d2t" in state else None
        cos, sin = rotary_tables(cfg, torch.float32)
        self.cos, self.sin = cos[:positions], sin[:positions]
        self.k_cache = torch.zeros(slots, self.kv_heads, positions, self.head_dim)
        self.v_cache = torch.zeros(slots, self.kv_heads, positions, self.head_dim)

    @classmethod
    def load(cls, directory: Path | str, target: ModelConfig, embed: TokenEmbedding, slots: int,
             positions: int) -> Eagle3Head:
        """Reads and checks the head against the target (``HeadFormatError`` names the field)."""
        directory = Path(directory)
        spec = read_spec(directory, target)
        try:
            state = load_file(str(directory / "model.safetensors"))
        except (OSError, ValueError) as exc:
            raise HeadFormatError(f"{directory / 'model.safetensors'}: not readable ({exc})") from exc
        h, layer = target.hidden_size, spec.layer
        q, kv = layer.num_attention_heads * layer.head_dim, layer.num_key_value_heads * layer.head_dim
        p = "layers.0."
        expected = {
            "fc.weight": (h, len(spec.layer_ids) * spec.target_hidden_size),
            p + "self_attn.q_proj.weight": (q, 2 * h), p + "self_attn.k_proj.weight": (kv, 2 * h),
            p + "self_attn.v_proj.weight": (kv, 2 * h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (layer.intermediate_size, h),
            p + "mlp.up_proj.weight": (layer.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, layer.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,), "norm.weight": (h,),
            "lm_head.weight": (spec.draft_vocab_size, h),
        }
        for name, shape in expected.items():
            if name not in state:
                raise HeadFormatError(f"{directory}: model.safetensors has no {name}")
            if tuple(state[name].shape) != shape:
                raise HeadFormatError(f"{directory}: {name} is {tuple(state[name].shape)}, expected {shape} "
                                      "for this target")
        if spec.draft_vocab_size < target.vocab_size:
            if "d2t" not in state:
                raise HeadFormatError(f"{directory}: d2t is missing; a head whose draft_vocab_size "
                                      f"({spec.draft_vocab_size}) is below the target's vocabulary "
                                      f"({target.vocab_size}) needs it")
            d2t = state["d2t"].long()
            ids = torch.arange(spec.draft_vocab_size) + d2t
            if d2t.shape != (spec.draft_vocab_size,) or int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
                raise HeadFormatError(f"{directory}: d2t maps draft ids outside the target's vocabulary")
        return cls(spec, state, embed, slots, positions)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.spec.layer_ids

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def forward(self, slot: int, start: int, hidden: torch.Tensor, tokens: list[int], fused: bool,
                logits_for_last: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """n positions from ``start``: hidden (n, 3h) target states (``fused``) or (n, h) the head's own
        output, and the tokens that follow each position. Writes the head's K/V at those positions and
        returns (logits over the draft vocabulary for the last position (1, draft vocab), or every
        position's; the output before the final norm (n, h), the next draft's hidden)."""
        n = len(tokens)
        if fused:
            hidden = self.fc(hidden.contiguous())
        embeds = self._rms(self.embed(torch.tensor(tokens)).float(), self.input_norm)
        normed = self._rms(hidden, self.hidden_norm)
        residual = normed if self.spec.norm_before_residual else hidden
        qkv = self.qkv(torch.cat([embeds, normed], dim=-1))
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        qkv = qkv.view(1, n, hq + 2 * hk, d)
        cos = self.cos[start:start + n][None, :, None]
        sin = self.sin[start:start + n][None, :, None]
        qk = apply_rotary(qkv[:, :, :hq + hk], cos, sin)
        q = qk[0, :, :hq].transpose(0, 1)  # (H, n, D)
        self.k_cache[slot, :, start:start + n] = qk[0, :, hq:].transpose(0, 1)
        self.v_cache[slot, :, start:start + n] = qkv[0, :, hq + hk:].transpose(0, 1)
        keys, values = self.k_cache[slot, :, :start + n], self.v_cache[slot, :, :start + n]
        mask = None
        if n > 1:
            mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        attended = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                                  enable_gqa=True)[0]
        x = residual + self.o(attended.transpose(0, 1).reshape(n, hq * d).contiguous())
        gate, up = self.gate_up(self._rms(x, self.post_norm)).chunk(2, dim=-1)
        x = x + self.down((F.silu(gate) * up).contiguous())
        last = x[-1:] if logits_for_last else x
        return self.lm_head(self._rms(last, self.norm).contiguous()), x

    def full_vocab_logits(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """(N, draft vocab) logits laid over the target's vocabulary, -inf where the head has no row
        (probability 0: verification stays exact with any q)."""
        if self.vocab_ids is None:
            return logits
        full = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype)
        full[:, self.vocab_ids] = logits
        return full
