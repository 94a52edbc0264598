"""bench/data/task_prompts.jsonl: bench.tasks' prompts, 25 per class, none a copy of the draft's
distillation prompts (a draft measured on its own training prompts would read too well); and
bench.tasks' configurations and decision labels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.prompts import TASK_CLASSES, TASK_PER_CLASS, TASK_PROMPTS, load_task_prompts
from bench.tasks import decision_label, setups

REPO = Path(__file__).resolve().parents[2]
DISTILL_PROMPTS = REPO / "models" / "distill_prompts.jsonl"
SHARED_WORDS = 8  # a run of this many words in common counts as a copy


def _word_runs(text: str, length: int = SHARED_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + length]) for i in range(len(words) - length + 1)}


def _distill_texts() -> list[str]:
    rows = [json.loads(line) for line in DISTILL_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [str(message["content"]) for row in rows for message in row["messages"]]


def test_every_class_has_its_prompts() -> None:
    prompts = load_task_prompts()
    assert tuple(prompts) == TASK_CLASSES
    assert all(len(texts) == TASK_PER_CLASS for texts in prompts.values())
    every = [p for texts in prompts.values() for p in texts]
    assert len(set(every)) == len(every) and all(p.strip() for p in every)


def test_ids_are_unique_and_name_their_class() -> None:
    rows = [json.loads(line) for line in TASK_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len({row["id"] for row in rows}) == len(rows)
    assert all(row["id"].startswith(row["class"] + "-") for row in rows)


def test_no_prompt_repeats_the_drafts_training_prompts() -> None:
    distill = _distill_texts()
    assert len(distill) >= 400  # the file was read
    normalized = {" ".join(text.lower().split()) for text in distill}
    runs = set().union(*(_word_runs(text) for text in distill))
    for texts in load_task_prompts().values():
        for prompt in texts:
            assert " ".join(prompt.lower().split()) not in normalized, prompt
            shared = _word_runs(prompt) & runs
            assert not shared, (prompt, sorted(shared)[:3])


def test_the_copy_check_finds_a_copy() -> None:
    text = _distill_texts()[0]
    assert _word_runs("Please: " + text) & _word_runs(text)


@pytest.mark.parametrize(("header", "label"), [
    ("speculative; method=draft; k=3; reason=default", "K=3"),
    ("speculative; k=5; reason=default", "K=5"),
    ("speculative; method=suffix; k=8; reason=default", "suffix K=8"),
    ("speculative; method=draft; k=2; reason=free_batch", "K=2 (free_batch)"),
    ("plain; reason=high_temperature", "plain (high_temperature)"),
])
def test_auto_s_decisions_name_a_lookup_method(header: str, label: str) -> None:
    assert decision_label(header) == label


def test_auto_drafts_with_the_model_alone_unless_told() -> None:
    """Every configuration answers the same prompts on one worker: a lookup method would copy them."""
    auto = {s.name: s.policy for s in setups([2, 5])}["auto"]
    assert auto is not None and auto["methods"] == ["draft"] and auto["num_speculative_tokens"] == "auto"
    told = {s.name: s.policy for s in setups([5], {"methods": ["draft", "suffix"]})}["auto"]
    assert told is not None and told["methods"] == ["draft", "suffix"]
