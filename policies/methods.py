"""Speculation methods: where a step's proposals come from.

- ``draft``: the draft model (chains and token trees). Drafting costs a forward of the draft per
  token, and its proposals are distributions (``q``) that verification divides by.
- ``ngram``: prompt lookup. The last n tokens (n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``, vLLM's names) matched against the prompt and the output so far; the
  proposal is what followed the most recent match.
- ``suffix``: suffix matching against the session's earlier prompts and outputs and, bounded in
  memory, the worker's recent outputs (SuffixDecoding); the most frequent continuation, its
  length adapted to the match's.

Lookup proposals are point masses: verification accepts a proposed x with probability p(x) and,
on a rejection, samples from p with x removed and renormalised, so every method's output is the
target's distribution exactly. They cost next to nothing to make, so a lookup step costs the
target's verification of its K + 1 tokens, and a step without a match is a plain step.

Pure, as the rest of ``policies/``: the names and the parsing both sides of the wire share.
"""

from __future__ import annotations

from typing import Literal, TypeGuard

Method = Literal["draft", "ngram", "suffix"]
METHODS: tuple[Method, ...] = ("draft", "ngram", "suffix")
LOOKUP_METHODS: frozenset[Method] = frozenset({"ngram", "suffix"})
DEFAULT_METHOD: Method = "draft"


def is_method(value: object) -> TypeGuard[Method]:
    return isinstance(value, str) and value in METHODS


def is_lookup(method: Method) -> bool:
    """Proposals are point masses found in text already seen, at no model's cost."""
    return method in LOOKUP_METHODS

