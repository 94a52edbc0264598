"""A reduced-vocabulary draft's parts (issue #41's draft format): the target ids its LM head
scores, its input embedding read from the target's own table, and the check that draft and
target tokenize alike. ``LlamaForCausalLM.from_pretrained`` and ``load_draft`` call these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from workers.engines.embedded.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """Raises ValueError naming the files unless the draft's tokenizer files are the target's:
    a draft that tokenizes otherwise proposes ids that mean other text to the target."""
    differ = []
    for name in TOKENIZER_FILES:
        mine, theirs = draft / name, target / name
        if not mine.exists() or not theirs.exists():
            differ.append(f"{name} missing in {draft if not mine.exists() else target}")
        elif json.loads(mine.read_bytes()) != json.loads(theirs.read_bytes()):
            differ.append(f"{mine} differs from {theirs}")
    if differ:
        raise ValueError("the draft's tokenizer is not the target's: " + "; ".join(differ))


def vocab_ids(directory: Path, cfg: ModelConfig, ids: torch.Tensor | None) -> torch.Tensor | None:
    """A reduced-vocabulary draft's ``draft_vocab_ids``, checked: one distinct in-vocabulary id per head row."""
    if cfg.draft_vocab_size is None:
        if ids is not None:
            raise ValueError(f"{directory / 'model.safetensors'}: draft_vocab_ids, but no draft_vocab_size in "
                             "config.json")
        return None
    path = directory / "model.safetensors"
    if ids is None:
        raise ValueError(f"{path}: draft_vocab_size is {cfg.draft_vocab_size} but draft_vocab_ids is missing")
    ids = ids.to(torch.long).flatten()
    if ids.numel() != cfg.draft_vocab_size or ids.unique().numel() != ids.numel() or (
            ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size)):
        raise ValueError(f"{path}: draft_vocab_ids must be {cfg.draft_vocab_size} distinct ids in "
                         f"0..{cfg.vocab_size - 1}")
    return ids


def projected_embedding(directory: Path, cfg: ModelConfig, projection: torch.Tensor | None,
                         target: Path | str | None) -> torch.Tensor:
    """The draft's input embedding: the target's table (vocab x target hidden) times the
    draft's ``embed_proj`` (hidden x target hidden), transposed."""
    if target is None:
        raise ValueError(f"{directory}: its embedding is the target's projected; load it with the target's directory")
    if projection is None:
        raise ValueError(f"{directory / 'model.safetensors'}: embedding is target_projection but embed_proj.weight "
                         "is missing")
    target = Path(target)
    with safe_open(str(target / "model.safetensors"), framework="pt") as source:
        table = source.get_tensor("model.embed_tokens.weight").float()
    if table.shape[0] != cfg.vocab_size or projection.shape != (cfg.hidden_size, table.shape[1]):
        raise ValueError(f"{directory}: embed_proj.weight {tuple(projection.shape)} does not map the target's "
                         f"{tuple(table.shape)} embedding of {target} to hidden size {cfg.hidden_size}")
    embedding: torch.Tensor = table @ projection.float().T
    return embedding
