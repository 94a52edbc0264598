"""The distilled draft's directory format (``models/smollm2-draft/``), its trainable module and its loaders.

A draft directory holds a Llama ``config.json`` whose ``vocab_size`` is the TARGET's full vocabulary (the
input side covers every target id) plus three specgate fields: ``draft_vocab_size`` (rows of the LM head),
``embedding: "target_projection"`` and ``target_sha256`` (the target ``model.safetensors`` it was distilled
from). ``model.safetensors`` has the decoder layers and final norm under their Hugging Face names, an LM head
over ``draft_vocab_size`` target ids only, ``draft_vocab_ids`` (the target id of each head row, ascending) and
``embed_proj.weight`` (hidden, target_hidden). There is no embedding table: the draft's input embedding is
``target_embed_tokens @ embed_proj.weight.T``, computed from the target's own table at load time, so the
draft ships a 256×576 projection instead of a 49152×256 table (the weights stay under 15 MB in bfloat16).
``tokenizer.json`` and ``tokenizer_config.json`` are the target's.

``load_draft`` rebuilds the module for training and evaluation; ``expand_to_full_vocab`` writes a standard
Hugging Face Llama directory (full embedding, a 49152-row LM head with zero rows outside the subset) for vLLM.
Every check names the file it failed on.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.layers import RMSNorm, rotary_tables
from workers.engines.embedded.llama import DecoderLayer

EMBEDDING_KIND = "target_projection"
SPECGATE_FIELDS = ("draft_vocab_size", "embedding", "target_sha256")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TARGET_EMBED = "model.embed_tokens.weight"


class DraftFormatError(ValueError):
    """A draft or target directory that does not have the draft format; the message names the file."""


@dataclass(frozen=True)
class DraftShape:
    """The draft's own sizes (the decided ones by default; tests use tiny ones)."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768
    draft_vocab_size: int = 8192


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DraftFormatError(f"{path}: missing")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DraftFormatError(f"{path}: not JSON ({e})") from e
    if not isinstance(value, dict):
        raise DraftFormatError(f"{path}: not a JSON object")
    return value


def eos_ids(raw: dict[str, Any]) -> list[int]:
    eos = raw.get("eos_token_id", [])
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def special_ids(target_dir: Path) -> list[int]:
    """Ids the head must always have: the tokenizer's special added tokens and the config's bos/eos."""
    tokenizer = _read_json(target_dir / "tokenizer.json")
    raw = _read_json(target_dir / "config.json")
    ids = {int(t["id"]) for t in tokenizer.get("added_tokens", []) if t.get("special")}
    ids.update(eos_ids(raw))
    if raw.get("bos_token_id") is not None:
        ids.add(int(raw["bos_token_id"]))
    return sorted(ids)


def draft_config(target_raw: dict[str, Any], shape: DraftShape, target_sha256: str) -> dict[str, Any]:
    """config.json of a draft for the target whose config.json is ``target_raw``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
        "use_cache": True, "vocab_size": int(target_raw["vocab_size"]), "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": int(target_raw.get("max_position_embeddings", 2048)),
        "rms_norm_eps": float(target_raw.get("rms_norm_eps", 1e-5)),
        "rope_theta": float(target_raw.get("rope_theta", 10000.0)), "tie_word_embeddings": False,
        "bos_token_id": target_raw.get("bos_token_id"), "eos_token_id": target_raw.get("eos_token_id"),
        "draft_vocab_size": shape.draft_vocab_size, "embedding": EMBEDDING_KIND, "target_sha256": target_sha256,
    }


def model_config(raw: dict[str, Any]) -> ModelConfig:
    names = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in raw.items() if k in names})


class DraftBackbone(nn.Module):
    """Named ``model`` in the state dict, as in Hugging Face's ``LlamaForCausalLM``; no embedding table."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DraftLlama(nn.Module):
    """A small trainable Llama over the target's ids: input through the target's embedding and ``embed_proj``,
    output over the ``draft_vocab_ids`` subset. State-dict names are the file's tensor names."""

    draft_vocab_ids: torch.Tensor
    target_embed: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, draft_vocab_size: int, target_embed: torch.Tensor) -> None:
        super().__init__()
        if target_embed.shape[0] != cfg.vocab_size:
            raise ValueError(f"target embedding has {target_embed.shape[0]} rows, the draft's vocab_size is "
                             f"{cfg.vocab_size}")
        self.cfg = cfg
        if cfg.hidden_size > target_embed.shape[1]:
            raise ValueError(f"draft hidden size {cfg.hidden_size} exceeds the target's {target_embed.shape[1]}")
        self.model = DraftBackbone(cfg)
        self.embed_proj = nn.Linear(target_embed.shape[1], cfg.hidden_size, bias=False)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("draft_vocab_ids", torch.zeros(draft_vocab_size, dtype=torch.long))
        # Not saved: the target's own table, read from the target at load time.
        self.register_buffer("target_embed", target_embed.detach(), persistent=False)
        cos, sin = rotary_tables(cfg, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def blocks(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) target ids -> logits (B, T, draft_vocab_size), full causal attention."""
        length = tokens.shape[1]
        dtype = self.lm_head.weight.dtype
        cos, sin = self.rope_cos[:length].to(dtype)[None, :, None], self.rope_sin[:length].to(dtype)[None, :, None]
        # Gathering rows before projecting equals projecting the whole table, for T rows instead of 49152.
        # The residual stream stays in the weights' dtype under bfloat16 autocast (only the matmuls round):
        # the norms then see inputs of their weights' dtype and take the fused kernel.
        x = self.embed_proj(F.embedding(tokens, self.target_embed).to(dtype)).to(dtype)
        for layer in self.blocks():
            x = layer.forward_train(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits

    def full_embedding(self) -> torch.Tensor:
        """(vocab, hidden): the input embedding as a plain table, in float32."""
        return self.target_embed.float() @ self.embed_proj.weight.float().T

    def init_weights(self, seed: int) -> None:
        """GPT-2 style random layers; ``embed_proj`` = the target embedding's top principal directions (what
        keeps the most of the target's token geometry in ``hidden`` dimensions); the head starts tied to the
        projected embedding of its rows, scaled to std 0.02, as small tied-embedding models start."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    deep = name.endswith(("o_proj.weight", "down_proj.weight"))
                    p.normal_(0.0, 0.02 / (math.sqrt(2 * self.cfg.num_hidden_layers) if deep else 1.0), generator=gen)
            table = self.target_embed.double()
            _, vectors = torch.linalg.eigh(table.T @ table)  # ascending eigenvalues
            top = vectors[:, -self.cfg.hidden_size:].flip(1).T  # (hidden, target_hidden)
            # eigh's signs are arbitrary: fix each direction's largest component positive.
            top = top * top.gather(1, top.abs().argmax(1, keepdim=True)).sign()
            self.embed_proj.weight.copy_(top.float())
            head = (table[self.draft_vocab_ids] @ top.T).float()
            self.lm_head.weight.copy_(head * (0.02 / head.std().clamp_min(1e-12)))


def read_target_embedding(target_dir: Path) -> torch.Tensor:
    path = target_dir / "model.safetensors"
    if not path.is_file():
        raise DraftFormatError(f"{path}: missing")
    with safe_open(str(path), framework="pt") as f:
        if TARGET_EMBED not in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            raise DraftFormatError(f"{path}: no {TARGET_EMBED}")
        table: torch.Tensor = f.get_tensor(TARGET_EMBED)
    return table.float()


def expected_shapes(cfg: ModelConfig, draft_vocab: int, target_hidden: int) -> dict[str, tuple[int, ...]]:
    hd, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.norm.weight": (h,), "lm_head.weight": (draft_vocab, h),
                                          "draft_vocab_ids": (draft_vocab,), "embed_proj.weight": (h, target_hidden)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
                   p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
                   p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
                   p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return shapes


def check_tokenizers(draft_dir: Path, target_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if _read_json(draft_dir / name) != _read_json(target_dir / name):
            raise DraftFormatError(f"{draft_dir / name}: differs from the target's {target_dir / name}")


def check_state(path: Path, state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], vocab: int) -> None:
    if TARGET_EMBED in state:
        raise DraftFormatError(f"{path}: has {TARGET_EMBED}; a draft's embedding is the target's times embed_proj")
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise DraftFormatError(f"{path}: missing tensors {missing[:4]}, unexpected tensors {unexpected[:4]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise DraftFormatError(f"{path}: {name} has shape {tuple(state[name].shape)}, expected {shape}")
    ids = state["draft_vocab_ids"]
    if ids.dtype != torch.int64:
        raise DraftFormatError(f"{path}: draft_vocab_ids is {ids.dtype}, expected torch.int64")
    if len(ids) and (bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab):
        raise DraftFormatError(f"{path}: draft_vocab_ids must be strictly ascending target ids below {vocab}")


def load_draft(draft_dir: Path | str, target_dir: Path | str, *, dtype: torch.dtype = torch.float32,
               check_target: bool = True) -> tuple[DraftLlama, torch.Tensor]:
    """(module, draft_vocab_ids): the draft of ``draft_dir`` with its embedding from ``target_dir``'s.

    ``check_target``: refuse a target whose model.safetensors is not the one the draft was distilled from.
    """
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    raw = _read_json(draft_dir / "config.json")
    missing = [k for k in (*SPECGATE_FIELDS, "vocab_size", "hidden_size") if k not in raw]
    if missing or raw.get("embedding") != EMBEDDING_KIND:
        raise DraftFormatError(f"{draft_dir / 'config.json'}: not a draft config (missing {missing}, "
                               f"embedding {raw.get('embedding')!r}, expected {EMBEDDING_KIND!r})")
    target_raw = _read_json(target_dir / "config.json")
    if int(raw["vocab_size"]) != int(target_raw["vocab_size"]):
        raise DraftFormatError(f"{draft_dir / 'config.json'}: vocab_size {raw['vocab_size']} is not the target's "
                               f"{target_raw['vocab_size']} ({target_dir / 'config.json'})")
    check_tokenizers(draft_dir, target_dir)
    if check_target and sha256_of(target_dir / "model.safetensors") != raw["target_sha256"]:
        raise DraftFormatError(f"{target_dir / 'model.safetensors'}: sha256 differs from target_sha256 in "
                               f"{draft_dir / 'config.json'} (the draft was distilled from another target)")
    table = read_target_embedding(target_dir)
    cfg = model_config(raw)
    if table.shape[0] != cfg.vocab_size:
        raise DraftFormatError(f"{target_dir / 'model.safetensors'}: {TARGET_EMBED} has {table.shape[0]} rows, "
                               f"config says {cfg.vocab_size}")
    path = draft_dir / "model.safetensors"
    if not path.is_file():
        raise DraftFormatError(f"{path}: missing")
    state = load_file(str(path))
    check_state(path, state, expected_shapes(cfg, int(raw["draft_vocab_size"]), table.shape[1]), cfg.vocab_size)
    model = DraftLlama(cfg, int(raw["draft_vocab_size"]), table)
    model.load_state_dict({k: v.to(torch.long) if k == "draft_vocab_ids" else v.float() for k, v in state.items()})
    model.to(dtype).eval()
    return model, model.draft_vocab_ids.clone()


def save_draft(model: DraftLlama, out_dir: Path, target_dir: Path, target_sha256: str,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``model`` in the draft format (weights in ``dtype``), tokenizer files copied from the target."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = DraftShape(model.cfg.hidden_size, model.cfg.num_hidden_layers, model.cfg.num_attention_heads,
                       model.cfg.num_key_value_heads, model.cfg.intermediate_size, model.lm_head.weight.shape[0])
    config = draft_config(_read_json(target_dir / "config.json"), shape, target_sha256)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    state = {k: v.detach().contiguous() if k == "draft_vocab_ids" else v.detach().to(dtype).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; a worker may run as another user
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(target_dir / name, out_dir / name)


def expand_to_full_vocab(draft_dir: Path | str, target_dir: Path | str, out_dir: Path | str,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """A standard Hugging Face Llama directory from a draft, for engines that know no subset head (vLLM):
    ``model.embed_tokens.weight`` computed from the target's table, an LM head over the whole vocabulary with
    zero rows outside the subset (their logit is 0, not -inf: they can still win where every subset logit is
    negative, which only costs acceptance), ``tie_word_embeddings: false``."""
    draft_dir, target_dir, out_dir = Path(draft_dir), Path(target_dir), Path(out_dir)
    model, ids = load_draft(draft_dir, target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items()
             if k.startswith("model.layers.") or k == "model.norm.weight"}
    state[TARGET_EMBED] = model.full_embedding()
    head = torch.zeros(model.cfg.vocab_size, model.cfg.hidden_size)
    head[ids] = model.lm_head.weight.detach().float()
    state["lm_head.weight"] = head
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    config = {k: v for k, v in _read_json(draft_dir / "config.json").items() if k not in SPECGATE_FIELDS}
    config |= {"torch_dtype": str(dtype).removeprefix("torch."), "tie_word_embeddings": False}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out_dir / name)
    return out_dir
