"""The real model's held-out prompts for the end-to-end tests: the distillation prompts' held-out
split, chat-formatted with SmolLM2's template, ``per_class`` of each class in order."""

from __future__ import annotations

from pathlib import Path

from models.distill_prompts import CLASSES, load_prompts
from workers.api.wire import ChatMessage
from workers.text import TextCodec

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "smollm2-135m-instruct-q4_1"


def held_out(per_class: int) -> list[list[int]]:
    codec = TextCodec.from_model_dir(TARGET)
    prompts = load_prompts()
    return [codec.encode_chat([ChatMessage("user", p.user)]) for cls in CLASSES
            for p in [q for q in prompts if q.cls == cls and q.split == "heldout"][:per_class]]
