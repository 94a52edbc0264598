"""A target served from the GGUF's own blocks (``workers.dtype: q4_1``): its projections in Q4_1
and its embedding, the tied LM head, in Q8_0, as ``make install`` laid them out in the converted
directory's ``gguf-panels/`` (models/gguf_panels.py), multiplied by the kernels in
kernels/quant_blocks.h. About 97 MB where the float32 conversion holds 540 MB.

The kernels widen each block to exactly the float32 conversion's weight and sum in the float32
kernel's order, so this model computes what the float32 directory's does on the kernels, bit for
bit, and stays row-invariant (verification bit-identical to plain decoding). A forward of more
than a few rows (a prefill) widens a chunk of panels at a time into scratch and runs the float32
tiles over it: the float32 projections never stay resident.

``load_target`` is how the engine, its start-up measurement and the benches load a target by the
name a config gives its dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kernels.blocks import LAYOUT, PANELS_DIR, PANELS_FILE, BlockError, panels_from_bytes
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.projections import TORCH_DTYPES, FrozenLinear, Products

TargetDtype = Literal["float32", "bfloat16", "q4_1"]
STAMP = "conversion_stamp.json"


def panels_path(directory: Path | str) -> Path:
    return Path(directory) / PANELS_DIR / PANELS_FILE


def blocks_unavailable(directory: Path | str) -> str | None:
    """Why ``directory`` cannot be served from blocks here (None: it can): no kernels on this CPU,
    no panels (the conversion refused them, naming the tensor, or predates them)."""
    if rowgemm.load() is None:
        return "the block kernels need an AVX2 CPU and a C compiler (kernels/rowgemm.py)"
    path = panels_path(directory)
    if path.is_file():
        return None
    refused = ""
    try:
        note = json.loads((Path(directory) / STAMP).read_text()).get("panels", "")
        refused = f" ({note})" if str(note).startswith("refused") else ""
    except (OSError, ValueError, AttributeError):
        pass
    return f"{path} is missing{refused}: make install lays the GGUF's blocks out there (models/convert_gguf.py)"


def load_target(directory: Path | str, dtype: TargetDtype, packed: bool = True,
                products: Products = "float32") -> LlamaForCausalLM:
    """The target in ``dtype``: "q4_1" from its blocks (``load_blocks``), else its checkpoint."""
    if dtype == "q4_1":
        return load_blocks(directory)
    return LlamaForCausalLM.from_pretrained(directory, TORCH_DTYPES[dtype], packed, products)


def load_blocks(directory: Path | str) -> LlamaForCausalLM:
    """The model in ``directory`` served from its ``gguf-panels/`` (ValueError naming what is
    missing, misshapen or corrupt: a non-finite block scale is refused here)."""
    reason = blocks_unavailable(directory)
    if reason is not None:
        raise ValueError(reason)
    kernel = rowgemm.load()
    assert kernel is not None
    directory = Path(directory)
    cfg = ModelConfig.from_json(directory / "config.json")
    if not kernel.supports(cfg.hidden_size, cfg.head_dim):
        raise ValueError(f"{directory}: hidden size {cfg.hidden_size} / head size {cfg.head_dim} "
                         "do not fit the kernels")
    path = panels_path(directory)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("layout") != LAYOUT:
            raise ValueError(f"{path}: layout {meta.get('layout')!r}, not {LAYOUT!r}: make install lays it out again")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    inputs: dict[str, int] = json.loads(meta.get("inputs", "{}"))

    def panels(name: str, rows: int, k: int) -> rowgemm.Panels:
        found = [(f"{name}.{kind}", kind) for kind in rowgemm.BLOCK_KINDS if f"{name}.{kind}" in tensors]
        if len(found) != 1 or found[0][0] not in inputs:
            raise ValueError(f"{path}: no block panels for {name}")
        key, kind = found[0]
        try:
            loaded = panels_from_bytes(tensors.pop(key), kind, inputs[key], key)
        except BlockError as e:
            raise ValueError(f"{path}: {e}") from e
        if (loaded.weights.shape[0] * 8, loaded.k) != (rows, k):
            raise ValueError(f"{path}: {key} is {loaded.weights.shape[0] * 8} x {loaded.k}, the config "
                             f"says {rows} x {k}")
        return loaded

    model = LlamaForCausalLM(cfg)
    _empty_weights(model)
    model.eval().requires_grad_(False)
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    for i, layer in enumerate(model.model.blocks()):
        at = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_fused = FrozenLinear.from_panels(panels(f"{at}.self_attn.qkv_proj", width, hidden), kernel)
        attn.o_frozen = FrozenLinear.from_panels(panels(f"{at}.self_attn.o_proj", hidden,
                                                        cfg.num_attention_heads * d), kernel)
        mlp.gate_up_fused = FrozenLinear.from_panels(panels(f"{at}.mlp.gate_up_proj", 2 * inter, hidden), kernel)
        mlp.down_frozen = FrozenLinear.from_panels(panels(f"{at}.mlp.down_proj", hidden, inter), kernel)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight = nn.Parameter(_norm(tensors, f"{at}.{norm}.weight", hidden, path),
                                                       requires_grad=False)
    model.model.norm.weight = nn.Parameter(_norm(tensors, "model.norm.weight", hidden, path), requires_grad=False)
    embed = panels("model.embed_tokens", cfg.vocab_size, hidden)
    if embed.blocks != "q8_0":
        raise ValueError(f"{path}: the embedding must be Q8_0 blocks (got {embed.blocks})")
    head = embed if cfg.tie_word_embeddings else panels("lm_head", cfg.vocab_size, hidden)
    model.head_frozen = FrozenLinear.from_panels(head, kernel)
    model.embed_panels = embed
    model.native = kernel
    model.fused = model.one_call_forward(kernel, embed)
    model.released = True  # no float32 weights to train, save or prepare again
    return model


def _empty_weights(model: LlamaForCausalLM) -> None:
    """The float32 parameters emptied: the blocks are the weights (the constructor's allocations
    were never touched, so never resident; this returns them)."""
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight = nn.Parameter(torch.empty(0, dtype=torch.float32), requires_grad=False)
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _norm(tensors: dict[str, torch.Tensor], name: str, hidden: int, path: Path) -> torch.Tensor:
    found = tensors.pop(name, None)
    if found is None or found.dtype != torch.float32 or tuple(found.shape) != (hidden,):
        raise ValueError(f"{path}: {name} is missing or not {hidden} float32 values")
    if not torch.isfinite(found).all():
        raise ValueError(f"{path}: {name} holds non-finite values (corrupt file?)")
    return found.contiguous()
