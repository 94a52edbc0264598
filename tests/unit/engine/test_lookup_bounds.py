"""Lookup methods at their edges: point-mass verification past the first position and the
chi-square test's power against a wrong rule; proposals bounded by K, the request and the context
(one repeated token, a prompt at the window's end); a draft-less engine stays plain; the suffix
store learns from finished requests; the lookup knobs are checked, naming the field; the
indexes' batched catch-up is the per-position rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine.engine_runs import GREEDY, generate, output_tokens
from workers.engines.embedded.adapter import EmbeddedSettings
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.lookup import suffix as suffix_module
from workers.engines.embedded.lookup.ngram import NgramIndex
from workers.engines.embedded.lookup.proposer import LookupProposer, LookupSettings, LookupSettingsError
from workers.engines.embedded.lookup.suffix import KEY_LEN, MAX_OCCURRENCES, SequenceKeys
from workers.engines.embedded.sampling import Verdict, sample, verify_point_mass

from .conftest import ChiSquare, GreedyReference


# -- point-mass verification -------------------------------------------------------------------
def test_every_emitted_position_is_distributed_as_the_target(chi_square: ChiSquare) -> None:
    """With three proposals: given the first j tokens were the proposals (accepted: a rejection's
    replacement is never the proposal), token j is distributed as p_j, the bonus one included."""
    gen = torch.Generator().manual_seed(21)
    p = torch.softmax(torch.randn(4, 10, generator=gen) * 1.5, dim=-1)
    proposals = [int(p[j].argmax()) for j in range(3)]  # likely enough that the bonus is often reached
    runs = [verify_point_mass(proposals, p, gen) for _ in range(30_000)]
    for j in range(4):
        reached = [v.tokens[j] for v in runs if v.tokens[:j] == proposals[:j]]
        assert len(reached) > 1000, (j, len(reached))
        assert chi_square(reached, p[j]) > 1e-3, j
    assert all(v.accepted == len(v.tokens) - 1 and v.tokens[:v.accepted] == proposals[:v.accepted] for v in runs)


def _resample_from_p(draft_tokens: list[int], p: torch.Tensor, generator: torch.Generator) -> Verdict:
    """A deliberately WRONG rule: on a rejection, resample from p without removing x (x gets
    its mass twice)."""
    if float(torch.rand(1, generator=generator)) < float(p[0, draft_tokens[0]]):
        return Verdict([draft_tokens[0], int(sample(p[1], generator).item())], 1)
    return Verdict([int(sample(p[0], generator).item())], 0)


def test_the_chi_square_test_catches_a_wrong_point_mass_rule(chi_square: ChiSquare) -> None:
    gen = torch.Generator().manual_seed(22)
    p = torch.softmax(torch.randn(2, 10, generator=gen), dim=-1)
    proposal = int(p[0].argmax())
    draws = [_resample_from_p([proposal], p, gen).tokens[0] for _ in range(20_000)]
    assert chi_square(draws, p[0]) < 1e-6


# -- bounds --------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_one_repeated_token_proposes_at_most_k(method: str) -> None:
    proposer = LookupProposer()
    tokens = [7] * 20_000
    for k in (0, 1, 6, 64):
        proposal = proposer.propose("r", method, tokens, "s", k)  # type: ignore[arg-type]
        assert len(proposal) <= k and set(proposal) <= {7}
    proposer.finished("r", tokens, tokens, "s")  # the store keeps both, and stays bounded by K
    assert len(proposer.propose("q", method, [7] * 10, "s", 6)) <= 6  # type: ignore[arg-type]


def _check_bounds(events: list[StepEvent], prompt_len: int, max_tokens: int, k: int, max_positions: int) -> None:
    emitted = 0
    for event in events:
        assert event.proposed <= min(k, max_tokens - emitted - 1, max_positions - (prompt_len + emitted) - 1), (
            event, emitted)
        emitted += len(event.tokens)
    assert emitted == max_tokens


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_lookup_stays_within_k_the_request_and_the_context(method: str, target_model: LlamaForCausalLM,
                                                           draft_model: LlamaForCausalLM,
                                                           greedy_reference: GreedyReference) -> None:
    k, max_positions = 6, 64
    engine = SpeculativeEngine(target_model, draft_model, max_slots=2, max_k=k, max_positions=max_positions)
    window = max_positions - k
    # One repeated token up to the window's end: every suffix matches, so only the bounds hold it.
    for prompt_len in (window - 12, window - 2, window - 1):
        prompt, max_tokens = [5] * prompt_len, window - prompt_len
        events = generate(engine, GenerationRequest(f"{method}-{prompt_len}", prompt, max_tokens, GREEDY, k=k,
                                                    method=method, session="s"))  # type: ignore[arg-type]
        _check_bounds(events, prompt_len, max_tokens, k, max_positions)
        assert output_tokens(events) == greedy_reference(prompt, max_tokens)
        if max_tokens == 1:
            assert all(e.proposed == 0 for e in events)  # the one token is the verification's own


def test_a_draftless_engine_stays_plain_with_a_lookup_method(target_model: LlamaForCausalLM,
                                                             greedy_reference: GreedyReference) -> None:
    engine = SpeculativeEngine(target_model, None, max_slots=1, max_k=6)
    assert engine.max_k == 0 and engine.lookup is None
    prompt = [3, 4, 5] * 8
    events = generate(engine, GenerationRequest("plain", prompt, 12, GREEDY, k=6, method="ngram"))
    assert all(e.proposed == 0 for e in events) and output_tokens(events) == greedy_reference(prompt, 12)


def test_the_suffix_store_learns_from_a_finished_request(target_model: LlamaForCausalLM,
                                                         draft_model: LlamaForCausalLM) -> None:
    """The same request again, in the same session: its prompt and output are in the store now,
    so the second run proposes its whole answer from the first's and takes fewer steps."""
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=6)
    prompt = torch.randint(0, 48, (30,), generator=torch.Generator().manual_seed(23)).tolist()
    runs = [generate(engine, GenerationRequest(f"again-{i}", prompt, 30, GREEDY, k=6, method="suffix",
                                               session="s")) for i in range(2)]
    assert output_tokens(runs[0]) == output_tokens(runs[1])
    accepted = [sum(e.accepted for e in run) for run in runs]
    assert accepted[1] > accepted[0] and len(runs[1]) < len(runs[0]), (accepted, [len(r) for r in runs])
    # Another session does not see the first one's prompt, only its (shared) output.
    assert engine.lookup is not None
    assert engine.lookup.suffix.propose(prompt[:12], "other", 6) == []
    assert engine.lookup.suffix.propose(prompt[:12], "s", 6) == prompt[12:18]


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be in 1..32"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, r"prompt_lookup_max must be in prompt_lookup_min \(4\)"),
    ({"prompt_lookup_max": 33}, "prompt_lookup_max must be in"),
    ({"prompt_lookup_max": 5.0}, "prompt_lookup_max must be an integer"),
    ({"suffix_cache_bytes": -1}, "suffix_cache_bytes must be >= 0"),
])
def test_lookup_settings_are_checked_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(LookupSettingsError, match=message):
        LookupSettings(**fields)
    with pytest.raises(LookupSettingsError, match=message):
        EmbeddedSettings(target=Path("t"), draft=None, **fields)


def test_lookup_settings_reach_the_engine(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
    settings = EmbeddedSettings(target=Path("t"), draft=None, prompt_lookup_min=3, prompt_lookup_max=4,
                                suffix_cache_bytes=0)
    engine = SpeculativeEngine(target_model, draft_model, max_slots=1, max_k=4, lookup=settings.lookup)
    assert engine.lookup is not None and engine.lookup.settings == LookupSettings(3, 4, 0)
    assert engine.lookup.propose("r", "ngram", [1, 2, 9, 1, 2], None, 4) == []  # a 2-gram is below the minimum
    generate(engine, GenerationRequest("r", [1, 2, 3, 4, 5], 6, GREEDY, k=4, method="suffix", session="s"))
    assert engine.lookup.suffix.documents == 0  # a bound of 0 keeps nothing


# -- the indexes' fast paths ------------------------------------------------------------------------
def test_the_indexes_built_a_column_at_a_time_are_the_per_position_ones() -> None:
    """NgramIndex's and the suffix keys' batched catch-up against the rule written per position,
    on random sequences grown a few tokens at a time (a small vocabulary: many repeats)."""
    gen = torch.Generator().manual_seed(24)
    for _ in range(20):
        tokens = torch.randint(0, 6, (int(torch.randint(1, 120, (1,), generator=gen)),), generator=gen).tolist()
        index, keys = NgramIndex(2, 5), SequenceKeys()
        for end in range(1, len(tokens) + 1, 7):
            prefix = tokens[:end]
            index.propose(prefix, 1)
            expected: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(2, 6)}
            for i in range(1, len(prefix)):
                for n in range(2, 6):
                    if i >= n:
                        expected[n][tuple(prefix[i - n:i])] = i
            assert index._after == expected
            if end > KEY_LEN:
                last = suffix_module._key(prefix, end)
                assert keys.positions(prefix, last) == [
                    pos for pos in range(KEY_LEN, end) if suffix_module._key(prefix, pos) == last][-MAX_OCCURRENCES:]
        assert suffix_module._keys(tokens, KEY_LEN, len(tokens)) == [
            suffix_module._key(tokens, pos) for pos in range(KEY_LEN, len(tokens))]
