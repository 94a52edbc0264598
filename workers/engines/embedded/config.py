"""The model's config: the subset of a Hugging Face ``LlamaConfig`` this engine reads from a
checkpoint's ``config.json``. Its own module so the KV cache and the model both build on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face ``LlamaConfig`` this engine uses."""

    vocab_size: int  # rows of the embedding and the LM head
    hidden_size: int  # residual stream width
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int  # decoder blocks
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (grouped-query attention when fewer)
    max_position_embeddings: int  # longest sequence (prompt + generation) a slot holds
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # rotary base frequency
    tie_word_embeddings: bool = True  # LM head shares the embedding matrix
    bos_token_id: int = 0  # prepended to every prompt
    eos_token_id: int | list[int] = 0  # generation stops on any of these
    # A reduced-vocabulary draft (models/distill.py): its LM head scores only this many tokens,
    # the target ids in its ``draft_vocab_ids`` tensor; the input side still covers vocab_size.
    # None: the head scores the whole vocabulary.
    draft_vocab_size: int | None = None
    # "own": the checkpoint holds model.embed_tokens.weight. "target_projection": the input
    # embedding is the target's own table times the checkpoint's embed_proj (hidden x target
    # hidden), computed at load from the target directory, so the draft ships no vocab-wide table.
    embedding: str = "own"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.eos_token_id
        return tuple(ids) if isinstance(ids, list) else (ids,)

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        raw = json.loads(path.read_text())
        names = set(cls.__dataclass_fields__)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        missing = [n for n in required if n not in raw]
        if missing:
            raise ValueError(f"{path}: missing config fields {sorted(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in names})

    def to_hf_json(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            "initializer_range": 0.02,
            "use_cache": True,
            **asdict(self),
        }


# safetensors' names of the floating dtypes a checkpoint may store
_STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def stored_weight_dtype(directory: Path) -> str:
    """The dtype ``model.safetensors`` stores its weights in ("float32", "bfloat16", ...), read from
    the file's header (the first floating tensor's), not from config.json's ``torch_dtype``, which
    converters set loosely."""
    path = Path(directory) / "model.safetensors"
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] in _STORED_DTYPES:
            return _STORED_DTYPES[entry["dtype"]]
    raise ValueError(f"{path}: no floating-point tensor")
