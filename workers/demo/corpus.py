"""The demo models' corpus: the Python standard library's own source, present on every machine.

Files are split into train and held-out by a hash of their path relative to the stdlib root,
so the split is the same on every machine with the same Python. Held-out files supply the
benchmark's code prompts; they were never seen in training.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories whose files are not representative code (test data, generated tables, vendored
# third-party packages) or are huge.
_EXCLUDED_PARTS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__", "encodings"}
HELDOUT_MODULUS = 10  # one file in ten is held out

SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"
EOT_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOT_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN]


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str

    @property
    def heldout(self) -> bool:
        digest = hashlib.sha1(self.relpath.encode()).digest()
        return int.from_bytes(digest[:4], "big") % HELDOUT_MODULUS == 0


def stdlib_sources(root: Path | None = None, max_bytes: int = 200_000) -> list[SourceFile]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts) or path.stat().st_size > max_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(rel.as_posix(), text))
    return files


def chat_sample(user: str, assistant: str) -> str:
    """The chat template, as documented in models/README.md and tokenizer_config.json."""
    return f"{USER_TOKEN}\n{user}{END_TOKEN}\n{ASSISTANT_TOKEN}\n{assistant}{END_TOKEN}\n"


def docstring_chats(source: SourceFile, limit: int = 40) -> list[str]:
    """Chat samples from functions with docstrings: the docstring asks, the function answers.

    They teach the demo models the chat template so chat requests get on-topic code back.
    """
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return []
    lines = source.text.splitlines(keepends=True)
    chats = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None or len(doc) > 400:
            continue
        body = "".join(lines[node.lineno - 1:node.end_lineno])
        indent = len(body) - len(body.lstrip(" "))
        body = "".join(line[indent:] if line.startswith(" " * indent) else line
                       for line in body.splitlines(keepends=True))
        if len(body) > 1500:
            continue
        chats.append(chat_sample(f"Write a Python function `{node.name}`: {doc.splitlines()[0]}", body))
        if len(chats) >= limit:
            break
    return chats


def heldout_prompts(count: int, prompt_chars: int = 240, seed: int = 0,
                    root: Path | None = None) -> list[str]:
    """Code prompts cut from held-out files at line starts: the model has not seen them."""
    rng = random.Random(seed)
    files = [f for f in stdlib_sources(root) if f.heldout and len(f.text) > 4 * prompt_chars]
    prompts: list[str] = []
    while len(prompts) < count and files:
        source = files[rng.randrange(len(files))]
        cut = rng.randrange(prompt_chars, len(source.text) - prompt_chars)
        line_start = source.text.rfind("\n", 0, cut) + 1
        prompt = source.text[max(0, line_start - prompt_chars):line_start]
        if prompt.strip():
            prompts.append(prompt)
    return prompts
