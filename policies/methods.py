"""Speculation methods: where a step's proposals come from.

- ``draft``: the draft model (chains and token trees). Drafting costs a forward of the draft per
  token, and its proposals are distributions (``q``) that verification divides by.
- ``eagle3``: an EAGLE-3 head (chains): one decoder layer that reads the target's own hidden states
  from three of its layers and drafts over a reduced vocabulary. Its proposals are distributions
  as the draft's; a forward of the head per token, far cheaper than the draft model's. Its
  evidence is kept per method, as a lookup method's (``policies/lookup.py``), and it is priced on
  the worker's measured head costs (``policies.cost.head_step_cost``).
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

Method = Literal["draft", "eagle3", "ngram", "suffix"]
METHODS: tuple[Method, ...] = ("draft", "eagle3", "ngram", "suffix")
LOOKUP_METHODS: frozenset[Method] = frozenset({"ngram", "suffix"})
DEFAULT_METHOD: Method = "draft"


def is_method(value: object) -> TypeGuard[Method]:
    return isinstance(value, str) and value in METHODS


def is_lookup(method: Method) -> bool:
    """Proposals are point masses found in text already seen, at no model's cost."""
    return method in LOOKUP_METHODS


def keeps_own_evidence(method: Method) -> bool:
    """Evidence kept per method (``SessionState.lookups``), apart from the draft model's fields."""
    return method != "draft"

