"""Models in the GGUF's blocks for the tests: a float model's weights quantized as llama.cpp
stores SmolLM2 (projections Q4_1; the embedding, and an untied LM head, Q8_0), written as
``make install`` writes a converted directory: ``config.json``, ``model.safetensors`` (the
float32 conversion of those blocks) and ``gguf-panels/`` (the blocks laid out for the kernels)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file

from workers.engines.embedded.kernels.blocks import LAYOUT, PANELS_DIR, PANELS_FILE, panel_bytes
from workers.engines.embedded.llama import LlamaForCausalLM

QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def quantized(w: torch.Tensor, kind: str) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """GGUF block rows of ``w`` (N, K) and their float32 conversion (gguf's own dequantizer)."""
    raw = quantize(w.detach().float().numpy(), QTYPES[kind])
    return raw, np.asarray(dequantize(raw, QTYPES[kind]), dtype=np.float32)


def write_block_model(model: LlamaForCausalLM, directory: Path) -> Path:
    """``model``'s weights in blocks, as a converted directory (see the module docstring)."""
    cfg = model.cfg
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    floats: dict[str, npt.NDArray[np.float32]] = {}
    panels: dict[str, npt.NDArray[np.generic]] = {}
    inputs: dict[str, int] = {}

    def add(name: str, parts: list[str], kind: str) -> None:
        raw, deq = quantized(torch.cat([state[p] for p in parts]), kind)
        panels[f"{name}.{kind}"] = panel_bytes(raw, kind, name)
        inputs[f"{name}.{kind}"] = deq.shape[1]
        row = 0
        for part in parts:
            rows = state[part].shape[0]
            floats[part] = np.ascontiguousarray(deq[row:row + rows])
            row += rows

    add("model.embed_tokens", ["model.embed_tokens.weight"], "q8_0")
    if not cfg.tie_word_embeddings:
        add("lm_head", ["lm_head.weight"], "q8_0")
    for i in range(cfg.num_hidden_layers):
        at = f"model.layers.{i}"
        add(f"{at}.self_attn.qkv_proj", [f"{at}.self_attn.{p}_proj.weight" for p in "qkv"], "q4_1")
        add(f"{at}.self_attn.o_proj", [f"{at}.self_attn.o_proj.weight"], "q4_1")
        add(f"{at}.mlp.gate_up_proj", [f"{at}.mlp.gate_proj.weight", f"{at}.mlp.up_proj.weight"], "q4_1")
        add(f"{at}.mlp.down_proj", [f"{at}.mlp.down_proj.weight"], "q4_1")
    for name, value in state.items():
        if name.endswith("norm.weight"):
            floats[name] = panels[name] = value.numpy().copy()
    directory.mkdir(parents=True, exist_ok=True)
    config = cfg.to_hf_json()
    config["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config))
    save_file(floats, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / PANELS_DIR).mkdir(exist_ok=True)
    save_file(panels, str(directory / PANELS_DIR / PANELS_FILE),
              metadata={"format": "pt", "layout": LAYOUT, "inputs": json.dumps(inputs)})
    return directory
