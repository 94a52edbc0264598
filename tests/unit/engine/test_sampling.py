"""The speculative acceptance rule on fixed distributions, and the sampling transforms."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from workers.engines.embedded.sampling import (
    SamplingParams,
    Verdict,
    gumbel_max,
    probabilities,
    sample,
    seeded_noise,
    verify,
)

ChiSquare = Callable[[Sequence[int], torch.Tensor], float]
VerifyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], Verdict]

DRAWS = 20_000
GUMBEL_DRAWS = 5_000  # one seeded generator each: slower per draw

# Target distributions at K=2 draft positions plus the bonus position, and the draft's at the two
# draft positions. They differ a lot, so both the acceptance and the residual paths carry mass.
P = torch.tensor([
    [0.35, 0.25, 0.15, 0.10, 0.10, 0.05],
    [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
    [0.20, 0.20, 0.20, 0.15, 0.15, 0.10],
])
Q = torch.tensor([
    [0.05, 0.10, 0.40, 0.25, 0.10, 0.10],
    [0.30, 0.10, 0.10, 0.20, 0.10, 0.20],
])


def run_rule(rule: VerifyFn, draws: int, seed: int) -> list[Verdict]:
    gen = torch.Generator().manual_seed(seed)
    verdicts = []
    for _ in range(draws):
        drafts = sample(Q, gen)  # (K,), each row drawn from its q
        verdicts.append(rule(drafts, Q, P, gen))
    return verdicts


@pytest.fixture(scope="module")
def correct_verdicts() -> list[Verdict]:
    return run_rule(verify, DRAWS, seed=1234)


def test_verdict_shape(correct_verdicts: list[Verdict]) -> None:
    k = Q.shape[0]
    for v in correct_verdicts:
        assert 0 <= v.accepted <= k
        assert len(v.tokens) == v.accepted + 1
        assert all(0 <= t < P.shape[1] for t in v.tokens)
    counts = [sum(v.accepted == a for v in correct_verdicts) for a in range(k + 1)]
    assert all(c > 500 for c in counts), f"every acceptance count must be exercised, got {counts}"


def test_first_token_follows_target(correct_verdicts: list[Verdict], chi_square: ChiSquare) -> None:
    assert chi_square([v.tokens[0] for v in correct_verdicts], P[0]) > 1e-3


def test_later_tokens_follow_target(correct_verdicts: list[Verdict], chi_square: ChiSquare) -> None:
    # Given that a second token is emitted at all (draft 1 accepted), it is a fresh speculative
    # draw at position 1; the bonus token after K acceptances is a plain draw from p_K.
    second = [v.tokens[1] for v in correct_verdicts if len(v.tokens) >= 2]
    bonus = [v.tokens[-1] for v in correct_verdicts if v.accepted == Q.shape[0]]
    assert len(second) > 3000 and len(bonus) > 1000
    assert chi_square(second, P[1]) > 1e-3
    assert chi_square(bonus, P[2]) > 1e-3


def test_acceptance_rate_matches_overlap(correct_verdicts: list[Verdict]) -> None:
    # P(draft 1 accepted) = sum_x min(p0(x), q0(x)).
    beta = float(torch.minimum(P[0], Q[0]).sum())
    rate = sum(v.accepted >= 1 for v in correct_verdicts) / DRAWS
    sigma = (beta * (1 - beta) / DRAWS) ** 0.5
    assert abs(rate - beta) < 5 * sigma


def test_wrong_rule_is_rejected(wrong_verify: VerifyFn, chi_square: ChiSquare) -> None:
    verdicts = run_rule(wrong_verify, DRAWS, seed=1234)
    assert chi_square([v.tokens[0] for v in verdicts], P[0]) < 1e-6


def test_greedy_verify_is_argmax_matching() -> None:
    gen = torch.Generator().manual_seed(0)
    target_argmax = [3, 1, 4, 0]
    p = torch.nn.functional.one_hot(torch.tensor(target_argmax), 6).float()
    q_tokens = [3, 1, 2]  # drafts agree twice, then disagree
    q = torch.nn.functional.one_hot(torch.tensor(q_tokens), 6).float()
    for _ in range(50):
        v = verify(torch.tensor(q_tokens), q, p, gen)
        assert v == Verdict([3, 1, 4], 2)
    all_agree = verify(torch.tensor([3, 1, 4]), p[:3], p, gen)
    assert all_agree == Verdict([3, 1, 4, 0], 3)


def test_identical_distributions_always_accept() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = sample(P[:2], gen)
        assert verify(drafts, P[:2], P, gen).accepted == 2


def test_probabilities_greedy_is_one_hot() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    probs = probabilities(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize(("params", "support"), [
    (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
    (SamplingParams(temperature=1.0, top_k=2), {1, 3}),
    (SamplingParams(temperature=1.0, top_p=0.5), {1}),
    (SamplingParams(temperature=1.0, top_p=0.8), {1, 3}),
])
def test_probabilities_truncation(params: SamplingParams, support: set[int]) -> None:
    logits = torch.log(torch.tensor([0.1, 0.6, 0.05, 0.25]))
    probs = probabilities(logits, params)
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    assert {i for i in range(4) if probs[i] > 0} == support
    full = torch.softmax(logits, -1)
    kept = torch.tensor(sorted(support))
    assert torch.allclose(probs[kept], full[kept] / full[kept].sum())


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(probabilities(logits, SamplingParams(temperature=0.5)), torch.softmax(logits / 0.5, -1))


def test_gumbel_max_draws_follow_the_distribution(chi_square: ChiSquare) -> None:
    """Over seeds, argmax(log p + G) with the seeded noise is a draw from p, per position."""
    params = SamplingParams(temperature=1.0)
    logits = torch.log(P)
    for position in range(P.shape[0]):
        draws = [gumbel_max(logits[position:position + 1], params, seeded_noise(seed, position, P.shape[1])[None])[0]
                 for seed in range(GUMBEL_DRAWS)]
        assert chi_square(draws, P[position]) > 1e-3


def test_gumbel_max_never_picks_a_filtered_token() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.05, 0.25]]))
    params = SamplingParams(temperature=1.0, top_k=2)
    picked = {gumbel_max(logits, params, seeded_noise(seed, 0, 4)[None])[0] for seed in range(2000)}
    assert picked == {1, 3}
