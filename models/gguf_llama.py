"""Reading a Llama GGUF: its metadata, checked, and its tensors dequantized to float32 under
Hugging Face's names and in Hugging Face's layout (``models/convert_gguf.py`` writes them out).

llama.cpp stores the Q and K projections with their rows permuted for its interleaved rotary
layout (``permute_rows``); ``convert_weights`` permutes them back to Hugging Face's half-split
layout (``unpermute_rows``). Every other tensor is stored as Hugging Face lays it out. The
tensor names and shapes the metadata implies are checked before anything is dequantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

Float32Array = npt.NDArray[np.float32]
_Scalar = TypeVar("_Scalar", bound=np.generic)


class ConversionError(Exception):
    """A source the converter cannot use; the message names the file and the problem."""


@dataclass(frozen=True)
class LlamaMeta:
    """The GGUF metadata a Llama checkpoint's config is made of."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    bos: int
    eos: int
    pad: int | None
    add_bos: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def open_gguf(path: Path) -> GGUFReader:
    """A reader over ``path``, or a ConversionError saying why not. GGUFReader maps the file and
    slices every tensor out of it, so a truncated file fails here (a short slice will not take
    its tensor's shape), as does a file that is not GGUF at all."""
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    size = path.stat().st_size
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not a readable GGUF file ({size:,} bytes; truncated or corrupt?): {e}") from e


# -- metadata --------------------------------------------------------------------------------------------------
def _value(reader: GGUFReader, path: Path, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ConversionError(f"{path}: GGUF metadata has no {key}")
    return field.contents()


def _int(reader: GGUFReader, path: Path, key: str) -> int:
    value = _value(reader, path, key)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ConversionError(f"{path}: GGUF metadata {key} is {value!r}, not a count")
    return int(value)


def _float32(reader: GGUFReader, path: Path, key: str) -> float:
    """GGUF keeps these as float32: the shortest decimal that float32 reads back as the same
    number (1e-05, not 9.999999747378752e-06) is the value the original config had."""
    value = _value(reader, path, key)
    if not isinstance(value, float | int | np.floating):
        raise ConversionError(f"{path}: GGUF metadata {key} is {value!r}, not a number")
    return float(str(np.float32(value)))


def read_meta(reader: GGUFReader, path: Path) -> LlamaMeta:
    """The Llama metadata, checked for consistency; another architecture is refused by name."""
    arch = _value(reader, path, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: general.architecture is {arch!r}; this converter reads llama GGUFs only")
    has = set(reader.fields)
    # Older files have no llama.vocab_size: their vocabulary is the token list's length.
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = (_int(reader, path, "llama.vocab_size") if "llama.vocab_size" in has
             else len(tokens.data) if tokens is not None else 0)
    if vocab <= 0:
        raise ConversionError(f"{path}: GGUF metadata has neither llama.vocab_size nor tokenizer.ggml.tokens")
    pad_key, add_bos_key = "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token"
    pad = _int(reader, path, pad_key) if pad_key in has else None
    add_bos = bool(_value(reader, path, add_bos_key)) if add_bos_key in has else False
    meta = LlamaMeta(
        layers=_int(reader, path, "llama.block_count"), hidden=_int(reader, path, "llama.embedding_length"),
        heads=_int(reader, path, "llama.attention.head_count"),
        kv_heads=_int(reader, path, "llama.attention.head_count_kv"),
        ffn=_int(reader, path, "llama.feed_forward_length"), vocab=vocab,
        context=_int(reader, path, "llama.context_length"),
        rope_theta=_float32(reader, path, "llama.rope.freq_base"),
        rms_eps=_float32(reader, path, "llama.attention.layer_norm_rms_epsilon"),
        bos=_int(reader, path, "tokenizer.ggml.bos_token_id"), eos=_int(reader, path, "tokenizer.ggml.eos_token_id"),
        pad=pad, add_bos=add_bos)
    problems = []
    if meta.heads == 0 or meta.hidden % meta.heads or meta.head_dim % 2:
        problems.append(f"embedding_length {meta.hidden} is not an even head size times head_count {meta.heads}")
    if meta.kv_heads == 0 or meta.heads % meta.kv_heads:
        problems.append(f"head_count {meta.heads} is not a multiple of head_count_kv {meta.kv_heads}")
    rope_dims = reader.get_field("llama.rope.dimension_count")
    if rope_dims is not None and meta.heads and rope_dims.contents() != meta.head_dim:
        problems.append(f"rope.dimension_count {rope_dims.contents()} is not the head size {meta.head_dim} "
                        "(partial rotary is not a Llama config)")
    if max(meta.bos, meta.eos) >= meta.vocab:
        problems.append(f"bos/eos ids {meta.bos}/{meta.eos} are outside the vocabulary of {meta.vocab}")
    if problems:
        raise ConversionError(f"{path}: inconsistent llama metadata: " + "; ".join(problems))
    return meta


# -- weights ---------------------------------------------------------------------------------------------------
def permute_rows(w: npt.NDArray[_Scalar], n_head: int) -> npt.NDArray[_Scalar]:
    """What llama.cpp's convert_hf_to_gguf.py does to a Hugging Face Q or K projection: within
    each head, the rows of the two rotary halves are interleaved (rotary pairs made adjacent).
    Here to test ``unpermute_rows`` against; the converter never calls it."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: npt.NDArray[_Scalar], n_head: int) -> npt.NDArray[_Scalar]:
    """The inverse of ``permute_rows``: a GGUF Q or K projection (out, in) back in Hugging Face's
    half-split rotary row order. ``n_head``: query heads for Q, key/value heads for K."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows are not {n_head} heads of an even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF name inside block N -> (Hugging Face name inside model.layers.N, shape from (meta) as (out, in)).
_LAYER_TENSORS: dict[str, tuple[str, Callable[[LlamaMeta], tuple[int, ...]]]] = {
    "attn_norm": ("input_layernorm", lambda m: (m.hidden,)),
    "ffn_norm": ("post_attention_layernorm", lambda m: (m.hidden,)),
    "attn_q": ("self_attn.q_proj", lambda m: (m.heads * m.head_dim, m.hidden)),
    "attn_k": ("self_attn.k_proj", lambda m: (m.kv_heads * m.head_dim, m.hidden)),
    "attn_v": ("self_attn.v_proj", lambda m: (m.kv_heads * m.head_dim, m.hidden)),
    "attn_output": ("self_attn.o_proj", lambda m: (m.hidden, m.heads * m.head_dim)),
    "ffn_gate": ("mlp.gate_proj", lambda m: (m.ffn, m.hidden)),
    "ffn_up": ("mlp.up_proj", lambda m: (m.ffn, m.hidden)),
    "ffn_down": ("mlp.down_proj", lambda m: (m.hidden, m.ffn)),
}


def tensor_plan(meta: LlamaMeta, tied: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (Hugging Face name, shape as ``dequantize`` returns it: (out, in)).
    ``tied``: no output.weight, the LM head is the embedding (no lm_head.weight either)."""
    plan = {"token_embd.weight": ("model.embed_tokens.weight", (meta.vocab, meta.hidden)),
            "output_norm.weight": ("model.norm.weight", (meta.hidden,))}
    if not tied:
        plan["output.weight"] = ("lm_head.weight", (meta.vocab, meta.hidden))
    for i in range(meta.layers):
        for gguf_name, (hf_name, shape) in _LAYER_TENSORS.items():
            plan[f"blk.{i}.{gguf_name}.weight"] = (f"model.layers.{i}.{hf_name}.weight", shape(meta))
    return plan


def _shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGML lists dimensions innermost first; numpy (and ``dequantize``) the other way round."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def check_tensors(reader: GGUFReader, path: Path, meta: LlamaMeta) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The plan for this file, once every tensor it implies is there with its shape and no other."""
    names = {t.name for t in reader.tensors}
    plan = tensor_plan(meta, tied="output.weight" not in names)
    missing, unexpected = sorted(set(plan) - names), sorted(names - set(plan))
    if missing or unexpected:
        raise ConversionError(f"{path}: {len(names)} tensors where {meta.layers} llama layers need {len(plan)}: "
                              f"missing {_few(missing)}, unexpected {_few(unexpected)}")
    wrong = [f"{t.name} {_shape(t)} (expected {plan[t.name][1]})" for t in reader.tensors
             if _shape(t) != plan[t.name][1]]
    if wrong:
        raise ConversionError(f"{path}: tensor shapes do not match the metadata: {_few(wrong)}")
    return plan


def _few(items: Sequence[str], shown: int = 4) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return "[" + ", ".join(items[:shown]) + "]" + more


def convert_weights(reader: GGUFReader, path: Path, meta: LlamaMeta) -> dict[str, Float32Array]:
    """Every tensor dequantized to float32 under its Hugging Face name, Q and K un-permuted."""
    plan = check_tensors(reader, path, meta)
    out: dict[str, Float32Array] = {}
    for tensor in reader.tensors:
        hf_name, shape = plan[tensor.name]
        try:
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ConversionError(f"{path}: {tensor.name} is {tensor.tensor_type.name}, "
                                  f"which gguf cannot dequantize: {e}") from e
        if w.shape != shape:
            raise ConversionError(f"{path}: {tensor.name} dequantized to {w.shape}, expected {shape}")
        if tensor.name.endswith(".attn_q.weight"):
            w = unpermute_rows(w, meta.heads)
        elif tensor.name.endswith(".attn_k.weight"):
            w = unpermute_rows(w, meta.kv_heads)  # llama.cpp permuted K by its own (KV) head count
        if not np.isfinite(w).all():
            raise ConversionError(f"{path}: {tensor.name} holds non-finite values (corrupt file?)")
        out[hf_name] = np.ascontiguousarray(w)  # a copy: no view into the mapped file outlives the reader
    return out
