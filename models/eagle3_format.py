"""The EAGLE-3 head's checkpoint in vLLM's ``speculators`` eagle3 format, built and written with
``speculators`` itself (training and export only; a worker reads the directory without it:
workers/engines/embedded/eagle3/head.py).

- ``config.json``: ``Eagle3SpeculatorConfig`` with every field the loaders read set explicitly (its defaults
  and vLLM's differ: ``transformer_layer_config.model_type``, ``norm_before_residual``);
- ``model.safetensors``: bfloat16 weights under speculators' names (``fc``, ``layers.0.*``, ``norm``,
  ``lm_head``), the vocabulary maps as tensors (``d2t``: target id = draft id + d2t[draft id]; ``t2d``: the
  target ids the draft scores), and no ``embed_tokens``: the target's own table is shared (vLLM's eagle
  loader shares it when the checkpoint has none, and so does the embedded engine);
- ``training_report.json``: how it was made (models/eagle3.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

if TYPE_CHECKING:  # speculators is in make install's .venv, not in the vLLM lane's (vLLM reads the format itself)
    from speculators.models.eagle3 import Eagle3DraftModel

# The residual stream after 2, 15 and 27 of the target's 30 layers: low, middle and high, vLLM's own
# default for a 30-layer target ((2, L // 2, L - 3)), so the head serves unchanged where a loader ignores
# the field. docs/eagle3.md says why these.
DEFAULT_LAYER_IDS = (2, 15, 27)
# The target as the head's config names it (``speculators_config.verifier.name_or_path``, which vLLM
# requires): the converted directory, relative to the repository's root, where make install writes it.
VERIFIER_PATH = "models/smollm2-135m-instruct-q4_1"
DROPPED = ("embed_tokens.", "verifier_")  # shared with the target, or the trainer's own


def draft_vocab(vocab_from: Path) -> torch.Tensor:
    """The head's vocabulary: the distilled draft's 8,192 target ids (ascending; every special id)."""
    ids = load_file(str(vocab_from / "model.safetensors"))["draft_vocab_ids"].long()
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{vocab_from}: draft_vocab_ids must ascend")
    return ids


def layer_config(target: Path) -> LlamaConfig:
    """The head's decoder layer: one Llama layer of the target's shapes, eager attention on the CPU
    (speculators' default is flex attention, which the trainer builds block masks for on a GPU)."""
    cfg = LlamaConfig.from_pretrained(target)
    cfg.num_hidden_layers = 1
    cfg.tie_word_embeddings = False  # the head's own rows: its vocabulary is not the embedding's
    cfg._attn_implementation = "eager"
    return cfg


def new_head(target: Path, ids: torch.Tensor, ttt_steps: int, layer_ids: tuple[int, ...] = DEFAULT_LAYER_IDS,
             verifier_path: str = VERIFIER_PATH) -> Eagle3DraftModel:
    """A fresh head (speculators' ``from_training_args``) over the draft vocabulary ``ids`` (ascending
    target ids): its LM head rows and embedding copied from the target's (both frozen, as speculators
    trains them), everything else initialized."""
    from speculators.models.eagle3 import Eagle3DraftModel

    cfg = layer_config(target)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(len(ids))
    head = Eagle3DraftModel.from_training_args(
        cfg, t2d=t2d, d2t=d2t, num_layers=1, norm_before_residual=True, ttt_steps=ttt_steps,
        verifier_name_or_path=str(target), draft_vocab_size=len(ids), target_layer_ids=list(layer_ids),
        draft_attn_impl="eager")
    head.config.speculators_config.verifier.name_or_path = verifier_path
    head.config.speculators_config.verifier.architectures = ["LlamaForCausalLM"]
    return head


def config_json(head: Eagle3DraftModel) -> dict[str, Any]:
    raw: dict[str, Any] = head.config.to_dict()
    layer = raw["transformer_layer_config"]
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                 tie_word_embeddings=False)
    layer.pop("_attn_implementation", None)
    raw.update(speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
               draft_vocab_size=head.config.draft_vocab_size, norm_before_residual=True,
               target_hidden_size=layer["hidden_size"],
               eagle_aux_hidden_state_layer_ids=list(head.config.eagle_aux_hidden_state_layer_ids))
    return raw


def save_head(head: Eagle3DraftModel, out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith(DROPPED):
            continue
        state[name] = tensor.detach().to(torch.bfloat16 if tensor.is_floating_point() else tensor.dtype).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(head), indent=2) + "\n")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
