"""The engine's lookup methods in one place: each running sequence's own index (``ngram``: its
n-grams; ``suffix``: its keys) and the worker's ``SuffixStore``, which a sequence joins when it
finishes (its prompt for its session, its output for every session)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.methods import Method
from workers.engines.embedded.lookup.ngram import DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN, NgramIndex
from workers.engines.embedded.lookup.suffix import DEFAULT_MAX_BYTES, SequenceKeys, SuffixStore

# A longer n-gram is rarely the one that decides, and each n costs a key per position per sequence.
MAX_PROMPT_LOOKUP = 32


class LookupSettingsError(ValueError):
    """A lookup knob out of range; the message names the field."""


@dataclass(frozen=True)
class LookupSettings:
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # the shortest n-gram prompt lookup matches
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # the longest, tried first
    # The worker's suffix store's bound (SuffixStore.memory_bytes); 0 keeps no documents (suffix
    # then matches the running sequence alone).
    suffix_cache_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max", "suffix_cache_bytes"):
            value = getattr(self, name)
            if type(value) is not int:
                raise LookupSettingsError(f"{name} must be an integer (got {value!r})")
        if not 1 <= self.prompt_lookup_min <= MAX_PROMPT_LOOKUP:
            raise LookupSettingsError(f"prompt_lookup_min must be in 1..{MAX_PROMPT_LOOKUP} "
                                      f"(got {self.prompt_lookup_min})")
        if not self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise LookupSettingsError(f"prompt_lookup_max must be in prompt_lookup_min ({self.prompt_lookup_min})"
                                      f"..{MAX_PROMPT_LOOKUP} (got {self.prompt_lookup_max})")
        if self.suffix_cache_bytes < 0:
            raise LookupSettingsError(f"suffix_cache_bytes must be >= 0 (got {self.suffix_cache_bytes}; "
                                      "0 keeps no documents)")


class LookupProposer:
    def __init__(self, settings: LookupSettings = LookupSettings()) -> None:
        self.settings = settings
        self.suffix = SuffixStore(settings.suffix_cache_bytes)
        self._ngrams: dict[str, NgramIndex] = {}
        self._keys: dict[str, SequenceKeys] = {}

    def propose(self, request_id: str, method: Method, tokens: Sequence[int], session: str | None,
                k: int, scope: str = "") -> list[int]:
        """Up to ``k`` point-mass proposals for the sequence ``tokens`` (prompt and output so far);
        the suffix store's from the documents of the request's cache ``scope`` only."""
        if k <= 0:
            return []
        if method == "ngram":
            index = self._ngrams.get(request_id)
            if index is None:
                index = self._ngrams[request_id] = NgramIndex(self.settings.prompt_lookup_min,
                                                              self.settings.prompt_lookup_max)
            return index.propose(tokens, k)
        keys = self._keys.get(request_id)
        if keys is None:
            keys = self._keys[request_id] = SequenceKeys()
        return self.suffix.propose(tokens, session, k, keys, scope=scope)

    def finished(self, request_id: str, prompt: Sequence[int], output: Sequence[int], session: str | None,
                 scope: str = "") -> None:
        """A sequence ended with its output: the store keeps both (whatever its method was), in
        the request's cache scope."""
        self.drop(request_id)
        if self.settings.suffix_cache_bytes > 0:
            if session is not None:  # a prompt is matched for its own session only
                self.suffix.add(prompt, session, shared=False, scope=scope)
            self.suffix.add(output, session, shared=True, scope=scope)

    def drop(self, request_id: str) -> None:
        self._ngrams.pop(request_id, None)
        self._keys.pop(request_id, None)
