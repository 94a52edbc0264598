"""The benches' prompt sets, committed as JSONL (one ``{"prompt": ...}`` object a line, the shape
``vllm bench serve --dataset-name custom`` reads), and the code that made them.

``code_prompts.jsonl``: six-line snippets of the Python standard library's *held-out* files (the
demo models never trained on them, ``workers.demo.corpus``), each starting at a ``def`` line, in
groups of four from one file: a session of four requests reads one file (``sessions_of``). Regenerate with
``python -m bench.prompts`` (the stdlib of another Python version gives other snippets).

``task_prompts.jsonl``: ``bench.tasks``' chat prompts for a real instruct model, written by hand,
``TASK_PER_CLASS`` of each of ``TASK_CLASSES`` (``{"id", "class", "prompt"}`` a line, the prompt a
user message): ``code`` (complete a function stub), ``json`` (fill a given schema from a short
text), ``math`` (word problems), ``chat`` (open questions). None repeats the real draft's
distillation prompts (``models/distill_prompts.jsonl``; tests/unit/test_task_prompts.py).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.demo.corpus import stdlib_sources

DATA = Path(__file__).resolve().parent / "data"
CODE_PROMPTS = DATA / "code_prompts.jsonl"
TASK_PROMPTS = DATA / "task_prompts.jsonl"
TASK_CLASSES = ("code", "json", "math", "chat")
TASK_PER_CLASS = 25
SNIPPET_LINES = 6
PER_FILE = 4  # prompts per session, all from one held-out file
MAX_GROUPS_PER_FILE = 3


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_prompts(path: Path = CODE_PROMPTS) -> list[str]:
    return [str(row["prompt"]) for row in _rows(path)]


def load_task_prompts(path: Path = TASK_PROMPTS) -> dict[str, list[str]]:
    """The prompts of each class, in file order (classes in the order they first appear)."""
    by_class: dict[str, list[str]] = {}
    for row in _rows(path):
        by_class.setdefault(str(row["class"]), []).append(str(row["prompt"]))
    return by_class


def sessions_of(prompts: Sequence[str], sessions: int, per_session: int = PER_FILE) -> list[list[str]]:
    """``sessions`` sessions of ``per_session`` consecutive prompts each (cycling through the set)."""
    return [[prompts[(s * per_session + j) % len(prompts)] for j in range(per_session)] for s in range(sessions)]


def make_code_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` snippets in groups of ``PER_FILE`` from one held-out file (a file gives at most
    ``MAX_GROUPS_PER_FILE`` groups)."""
    rng = random.Random(seed)
    files = [f for f in stdlib_sources() if f.heldout]
    rng.shuffle(files)
    prompts: list[str] = []
    for source in files:
        lines = source.text.splitlines()
        starts = [i for i, line in enumerate(lines[:-SNIPPET_LINES]) if line.lstrip().startswith("def ")]
        groups = min(MAX_GROUPS_PER_FILE, len(starts) // PER_FILE)  # sessions this file can give
        for start in sorted(rng.sample(starts, groups * PER_FILE)):
            prompts.append("\n".join(lines[start:start + SNIPPET_LINES]) + "\n")
        if len(prompts) >= count:
            break
    return prompts[:count]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--out", type=Path, default=CODE_PROMPTS)
    args = parser.parse_args(argv)
    prompts = make_code_prompts(args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
