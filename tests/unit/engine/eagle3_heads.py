"""EAGLE-3 heads for the demo target, written in speculators' eagle3 format by speculators itself
(models/eagle3_format.py), for the engine's eagle3 tests: random but peaky (weights scaled up, as
the engine tests' models are), so greedy drafts are well defined and sampled q far from uniform."""

from __future__ import annotations

from pathlib import Path

import torch

from models.eagle3_format import new_head, save_head

REPO = Path(__file__).resolve().parents[3]
DEMO_TARGET = REPO / "models" / "demo-target"
DEMO_LAYER_IDS = (1, 4, 6)  # of the demo target's 8 layers: low, middle, high
DEMO_DRAFT_VOCAB = 1024


def demo_vocab(size: int = DEMO_DRAFT_VOCAB) -> torch.Tensor:
    """The special ids and low (frequent) ids, then a spread of the rest: ascending target ids."""
    half = size // 2
    ids = torch.cat([torch.arange(half), torch.arange(half, 4096, (4096 - half) // half)[:size - half]])
    return torch.sort(ids).values


def write_demo_head(out: Path, seed: int = 0, vocab: torch.Tensor | None = None, scale: float = 3.0) -> Path:
    torch.manual_seed(seed)
    head = new_head(DEMO_TARGET, demo_vocab() if vocab is None else vocab, ttt_steps=3, layer_ids=DEMO_LAYER_IDS,
                    verifier_path="models/demo-target")
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.startswith(("layers.", "fc.")) and not name.endswith("norm.weight"):
                param.mul_(scale)
    save_head(head, out, {"purpose": "tests: a random head for the demo target"})
    return out
