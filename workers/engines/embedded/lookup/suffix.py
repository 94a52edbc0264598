"""Suffix matching (``suffix``, after SuffixDecoding): propose the most frequent continuation of
the sequence's longest suffix match among the session's earlier prompts and outputs, the
worker's recent outputs, and the sequence itself.

**The structure.** A ``SuffixStore`` per worker holds *documents* (token arrays): each finished
request's prompt (visible to its own session only) and output (visible to its session, and to
every session as one of the worker's recent outputs), each within its cache scope: a document is
never matched for a request of another scope (``cache_salt``, behind the gateway the digest of
its tenant and salt, gateway/tenancy.py), so no tenant is proposed another's text. The index is
shared by the scopes and filtered at proposal (a key's most recent occurrences may then be
another scope's: they cost that scope's proposals quality, never leak their text).

An index maps each ``KEY_LEN``-gram (packed into one int) to its most recent occurrences (at
most ``MAX_OCCURRENCES`` per key), each a (document, position of the token that followed it). A
proposal takes the occurrences of the sequence's last ``KEY_LEN`` tokens, in the store and in
the sequence itself, extends each backwards to its match length (up to ``MAX_MATCH``), keeps
those with the longest match, and walks forward: at each depth the token most of the remaining
candidates continue with, while it holds at least ``MIN_SHARE`` of them; the candidates that
disagree drop out. That is a walk down a suffix tree's most frequent path, computed lazily from
the occurrences. The proposal is at most K long, and at most ``LENGTH_PER_MATCH`` × the match
length (SuffixDecoding's adaptive length: a short match is weak evidence, so it speculates
little).

**The memory bound.** ``max_bytes`` bounds ``memory_bytes()``, an upper bound of what the
store allocates, by a formula (O(1) to evaluate, kept as counters)::

    TOKEN_BYTES × tokens + DOCUMENT_BYTES × documents + session bytes (each document's session
    id and scope, sys.getsizeof) + KEY_BYTES × index keys + OCCURRENCE_BYTES × occurrences

A key costs its packed int, its list's header and its dict slot (with the dict's growth slack);
an occurrence, its int and its list slot; a document, its array's header, its object and its
slot in the LRU order. ``tests/unit/engine/test_lookup.py`` measures the store with
``tracemalloc`` (tiny documents with fresh session ids, long ones whose keys are all new, and
repetitive ones) and checks the formula is never below what was allocated. Whole documents are
evicted, least recently used first (added, or supplying a proposal), and their index entries
with them (a key whose last occurrence goes is deleted), until the bound holds; a document that
could not fit alone is not kept.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

KEY_LEN = 3
MAX_OCCURRENCES = 32  # per key: the most recent
MAX_MATCH = 32  # tokens compared backwards
MIN_SHARE = 0.3  # a continuation must be this share of the candidates left to be proposed
LENGTH_PER_MATCH = 2.0  # a proposal is at most this x the match length
TOKEN_BYTES = 4  # array('i')
# Upper bounds, measured with tracemalloc on CPython 3.11 (64-bit) by tests/unit/engine/test_lookup.py:
KEY_BYTES = 192  # the packed int (36), the list's header (56), the dict's slot with its growth slack
OCCURRENCE_BYTES = 48  # the int (up to 36) and its list slot (8), with the list's growth slack
DOCUMENT_BYTES = 320  # the array's header (64), the _Document (slots), the LRU OrderedDict's node and slot
DEFAULT_MAX_BYTES = 64 << 20
POSITION_BITS = 32  # an occurrence is (document id << POSITION_BITS) | position
KEY_BASE = 1 << 20  # token ids below this (any vocabulary here) pack KEY_LEN of them into one int key


@dataclass(slots=True)
class _Document:
    tokens: array[int]
    session: str | None
    shared: bool  # an output: every session of its scope may match it; a prompt: its own session only
    scope: str  # the cache scope of the request it came from ("" the default)


class SuffixStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._documents: OrderedDict[int, _Document] = OrderedDict()
        self._index: dict[int, list[int]] = {}
        self._next_id = 0
        self._tokens = 0
        self._entries = 0  # occurrences in the index
        self._session_bytes = 0  # the documents' session ids

    # -- the bound ------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        return (self._tokens * TOKEN_BYTES + len(self._documents) * DOCUMENT_BYTES + self._session_bytes
                + len(self._index) * KEY_BYTES + self._entries * OCCURRENCE_BYTES)

    @staticmethod
    def largest_cost(length: int, session: str | None, scope: str = "") -> int:
        """What a document of ``length`` tokens may add to ``memory_bytes()`` at most (every key new)."""
        return (length * TOKEN_BYTES + DOCUMENT_BYTES + _owner_size(session, scope)
                + (length - KEY_LEN) * (KEY_BYTES + OCCURRENCE_BYTES))

    @property
    def documents(self) -> int:
        return len(self._documents)

    def add(self, tokens: Sequence[int], session: str | None, shared: bool, scope: str = "") -> None:
        """A finished request's prompt (``shared`` False) or output (True), in its cache scope."""
        if len(tokens) <= KEY_LEN or self.largest_cost(len(tokens), session, scope) > self.max_bytes:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        document = _Document(array("i", tokens), session, shared, scope)
        self._documents[doc_id] = document
        self._tokens += len(tokens)
        self._session_bytes += _owner_size(session, scope)
        for pos, key in enumerate(_keys(tokens, KEY_LEN, len(tokens)), KEY_LEN):
            occurrences = self._index.get(key)
            if occurrences is None:
                occurrences = self._index[key] = []
            elif len(occurrences) == MAX_OCCURRENCES:
                del occurrences[0]  # the oldest falls off
                self._entries -= 1
            occurrences.append(doc_id << POSITION_BITS | pos)
            self._entries += 1
        while self.memory_bytes() > self.max_bytes and self._documents:
            self._evict(next(iter(self._documents)))

    def _evict(self, doc_id: int) -> None:
        document = self._documents.pop(doc_id)
        tokens = document.tokens
        self._tokens -= len(tokens)
        self._session_bytes -= _owner_size(document.session, document.scope)
        for pos, key in enumerate(_keys(tokens, KEY_LEN, len(tokens)), KEY_LEN):
            occurrences = self._index.get(key)
            if occurrences is None:
                continue
            try:
                occurrences.remove(doc_id << POSITION_BITS | pos)
            except ValueError:
                continue  # already pushed out by newer occurrences
            self._entries -= 1
            if not occurrences:
                del self._index[key]

    # -- proposing ------------------------------------------------------------------------------
    def propose(self, tokens: Sequence[int], session: str | None, k: int,
                own: SequenceKeys | None = None, touch: bool = True, scope: str = "") -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` (the sequence so far, whose own earlier
        occurrences ``own`` indexes) from the documents of ``scope``; [] where nothing matches.
        ``touch`` False leaves the LRU order alone (a replay, lookup/replay.py, proposes nothing
        anyone runs)."""
        if k <= 0 or len(tokens) <= KEY_LEN:
            return []
        key = _key(tokens, len(tokens))
        candidates: list[tuple[Sequence[int], int]] = []
        sources: dict[int, int] = {}  # id(document.tokens) -> document id, to refresh what matched
        for occurrence in self._index.get(key, ()):
            doc_id, pos = occurrence >> POSITION_BITS, occurrence & ((1 << POSITION_BITS) - 1)
            document = self._documents.get(doc_id)
            if document is not None and document.scope == scope and (
                    document.shared or (session is not None and document.session == session)):
                candidates.append((document.tokens, pos))
                sources[id(document.tokens)] = doc_id
        # The sequence itself, where its last KEY_LEN tokens occurred before.
        if own is not None:
            candidates += [(tokens, pos) for pos in own.positions(tokens, key)]
        if not candidates:
            return []
        lengths = [_match_length(tokens, source, pos) for source, pos in candidates]
        longest = max(lengths)
        best = [c for c, length in zip(candidates, lengths, strict=True) if length == longest]
        cap = min(k, max(1, int(LENGTH_PER_MATCH * longest)))
        proposal: list[int] = []
        for depth in range(cap):
            counts: dict[int, int] = {}
            for source, pos in best:
                if pos + depth < len(source) and (source is not tokens or pos + depth < len(tokens)):
                    counts[source[pos + depth]] = counts.get(source[pos + depth], 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
            if count < MIN_SHARE * len(best):
                break
            proposal.append(token)
            best = [(s, p) for s, p in best if p + depth < len(s) and s[p + depth] == token]
        # Least recently used, not least recently added: a document that keeps supplying
        # proposals (a session's growing context, a template every session repeats) stays.
        if proposal and touch:
            for source, _ in best:
                if (used := sources.get(id(source))) is not None:
                    self._documents.move_to_end(used)
        return proposal


class SequenceKeys:
    """One sequence's own ``KEY_LEN``-grams: each key's most recent positions (the token that
    followed), indexed incrementally as the sequence grows; freed with it."""

    def __init__(self) -> None:
        self._positions: dict[int, deque[int]] = {}
        self._indexed = KEY_LEN

    def positions(self, tokens: Sequence[int], key: int) -> list[int]:
        # A position counts once a token follows its key.
        for pos, k in enumerate(_keys(tokens, self._indexed, len(tokens)), self._indexed):
            found = self._positions.get(k)
            if found is None:
                found = self._positions[k] = deque(maxlen=MAX_OCCURRENCES)
            found.append(pos)
        self._indexed = max(self._indexed, len(tokens))
        return list(self._positions.get(key, ()))


def _owner_size(session: str | None, scope: str) -> int:
    return (0 if session is None else sys.getsizeof(session)) + (sys.getsizeof(scope) if scope else 0)


def _key(tokens: Sequence[int], end: int) -> int:
    """The KEY_LEN tokens before ``end`` as one int (cheaper than a tuple, in memory and in hashing)."""
    key = 0
    for token in tokens[end - KEY_LEN:end]:
        key = key * KEY_BASE + token
    return key


def _keys(tokens: Sequence[int], start: int, end: int) -> list[int]:
    """``_key(tokens, pos)`` for pos in range(start, end), a column at a time (a list
    comprehension per key token instead of a slice and a loop per position: adding a
    4,000-token document takes 2.6 ms instead of 3.1)."""
    keys = list(tokens[start - KEY_LEN:end - KEY_LEN]) if end > start else []
    for j in range(1, KEY_LEN):
        keys = [key * KEY_BASE + token for key, token in zip(keys, tokens[start - KEY_LEN + j:end - KEY_LEN + j],
                                                            strict=True)]
    return keys


def _match_length(tokens: Sequence[int], source: Sequence[int], pos: int) -> int:
    """How many tokens before ``pos`` in ``source`` equal the end of ``tokens`` (at most MAX_MATCH)."""
    length = 0
    while (length < MAX_MATCH and length < pos and length < len(tokens)
           and source[pos - 1 - length] == tokens[len(tokens) - 1 - length]):
        length += 1
    return length
