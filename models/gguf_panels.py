"""The GGUF's quantized blocks laid out once, at install, for the embedded engine's kernels
(``workers/engines/embedded/kernels/quant_blocks.h``): the target's projections in Q4_1 as
stored, and the Q8_0 token embedding, which is also the tied LM head. ``models/convert_gguf.py``
writes them beside the float32 conversion, in ``gguf-panels/model.safetensors``; a worker with
``workers.dtype: q4_1`` (or ``auto``, where it measures fastest) serves from them
(``workers/engines/embedded/quantized.py``). The float32 directory stays: the draft's projected
embedding, the vLLM lane and the conformance checks read it.

Nothing is requantized: the panels hold the file's own bytes, regrouped. The Q and K
projections' rows are un-permuted as the float32 conversion's are (whole block rows move), and
the engine's fused projections (Q, K and V; gate and up) are stacked here. A projection in any
other block type, or an embedding that is not Q8_0, is refused, naming the tensor: the float32
conversion still serves such a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from models.gguf_llama import ConversionError, LlamaMeta, check_tensors, unpermute_rows
from workers.engines.embedded.kernels.blocks import (
    LAYOUT,
    PANELS_DIR,
    PANELS_FILE,
    BlockError,
    concat_rows,
    panel_bytes,
)

__all__ = ["PANELS_DIR", "PANELS_FILE", "block_panels"]
_KINDS = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}

# The engine's fused projections: (stored name inside model.layers.N, GGUF tensors stacked in order).
FUSED = (("self_attn.qkv_proj", ("attn_q", "attn_k", "attn_v")), ("self_attn.o_proj", ("attn_output",)),
         ("mlp.gate_up_proj", ("ffn_gate", "ffn_up")), ("mlp.down_proj", ("ffn_down",)))
NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))


def _kind(tensor: ReaderTensor, path: Path) -> str:
    kind = _KINDS.get(tensor.tensor_type)
    if kind is None:
        raise ConversionError(f"{path}: {tensor.name} is {tensor.tensor_type.name}; the engine's block kernels read "
                              "Q4_1 and Q8_0 (the float32 conversion serves this file)")
    return kind


def _rows(tensor: ReaderTensor, meta: LlamaMeta) -> npt.NDArray[np.uint8]:
    raw = np.asarray(tensor.data, dtype=np.uint8)
    if tensor.name.endswith(".attn_q.weight"):
        raw = unpermute_rows(raw, meta.heads)
    elif tensor.name.endswith(".attn_k.weight"):
        raw = unpermute_rows(raw, meta.kv_heads)
    return raw


def block_panels(reader: GGUFReader, path: Path,
                 meta: LlamaMeta) -> tuple[dict[str, npt.NDArray[np.generic]], dict[str, str]]:
    """The panels file's tensors (uint8 panels named ``<name>.<kind>``, float32 norms) and its
    metadata (the layout, and K of each panel weight); ConversionError naming a tensor the
    kernels cannot read."""
    check_tensors(reader, path, meta)
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, npt.NDArray[np.generic]] = {}
    inputs: dict[str, int] = {}

    def add(name: str, tensors: list[ReaderTensor]) -> None:
        kinds = {_kind(t, path) for t in tensors}
        if len(kinds) > 1:
            raise ConversionError(f"{path}: {', '.join(t.name for t in tensors)} mix block types "
                                  f"{sorted(kinds)}; the engine multiplies them as one projection")
        kind = kinds.pop()
        try:
            out[f"{name}.{kind}"] = panel_bytes(concat_rows([_rows(t, meta) for t in tensors]), kind, name)
        except BlockError as e:
            raise ConversionError(f"{path}: {e}") from e
        inputs[f"{name}.{kind}"] = int(tensors[0].shape[0])  # GGML lists the inner dimension first

    embedding = by_name["token_embd.weight"]
    if _kind(embedding, path) != "q8_0":
        raise ConversionError(f"{path}: token_embd.weight is {embedding.tensor_type.name}; the engine reads "
                              "embedding rows from Q8_0 blocks")
    add("model.embed_tokens", [embedding])
    if "output.weight" in by_name:
        add("lm_head", [by_name["output.weight"]])
    out["model.norm.weight"] = np.asarray(by_name["output_norm.weight"].data, dtype=np.float32).copy()
    for i in range(meta.layers):
        for name, parts in FUSED:
            add(f"model.layers.{i}.{name}", [by_name[f"blk.{i}.{part}.weight"] for part in parts])
        for hf, gguf_name in NORMS:
            out[f"model.layers.{i}.{hf}.weight"] = np.asarray(by_name[f"blk.{i}.{gguf_name}.weight"].data,
                                                              dtype=np.float32).copy()
    return out, {"format": "pt", "layout": LAYOUT, "inputs": json.dumps(inputs, sort_keys=True)}
