"""Sampling and the speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

Everything here is tensors in, tensors out. Temperature, top-k and top-p are applied by one
function to both the target's and the draft's logits, so the acceptance test compares the
distributions actually sampled from. Temperature 0 turns both into one-hot argmax
distributions, which makes the same rule exact greedy decoding: a draft token is accepted
iff it is the target's argmax, and the replacement is the target's argmax.

Seeded requests (temperature > 0) are sampled differently: by the Gumbel-max trick with noise
keyed by (seed, output position), shared by the draft and the target (``seeded_noise``,
``gumbel_max``). Every mode then computes the same token at every position, so a seed means
one answer whatever the decoding mode, K or batch (see ``gumbel_max``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.api.generation import SamplingParams

__all__ = ["SamplingParams", "Verdict", "gumbel_max", "noise_key", "probabilities", "sample", "seeded_noise",
           "verify", "verify_greedy"]
_U64 = (1 << 64) - 1


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> the distribution sampled from, (..., V), float32."""
    logits = logits.float()
    if params.temperature <= 0.0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs (..., V) -> token ids (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # accepted drafts followed by one target token (replacement or bonus)
    accepted: int  # how many of the K drafts were accepted


def verify(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> Verdict:
    """The speculative sampling rule for one sequence.

    draft_tokens (K,): proposals; q (K, V): draft distributions they were sampled from;
    p (K+1, V): target distributions at the same K positions plus the bonus position.
    Draft i is accepted with probability min(1, p_i/q_i); at the first rejection the
    replacement is drawn from normalize(max(0, p - q)); if all K pass, a bonus token is drawn
    from p_K. The emitted tokens are then distributed exactly as the target's.
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k)
    p_draft = p[idx, draft_tokens]
    q_draft = q[idx, draft_tokens]
    uniforms = torch.rand(k, generator=generator)
    # u < p/q, written without division so q = 0 (impossible for a sampled token) can't NaN.
    accepted_mask = uniforms * q_draft < p_draft
    rejected = (~accepted_mask).nonzero()
    n = int(rejected[0].item()) if len(rejected) else k
    tokens = draft_tokens[:n].tolist()
    if n < k:
        residual = (p[n] - q[n]).clamp_(min=0.0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; then p itself is the right distribution.
        dist = residual / total if total > 0 else p[n]
        tokens.append(int(sample(dist, generator).item()))
    else:
        tokens.append(int(sample(p[k], generator).item()))
    return Verdict(tokens, n)


def verify_point_mass(draft_tokens: list[int], p: torch.Tensor, generator: torch.Generator) -> Verdict:
    """The speculative sampling rule for proposals that are point masses (q = 1 at the proposed
    token: prompt lookup, suffix matching).

    p (K+1, V): the target's distributions at the K positions plus the bonus one. Proposal i is
    accepted with probability p_i(x_i); at the first rejection the replacement is drawn from p with
    x_i removed and renormalised (max(0, p − q) for a one-hot q); if all pass, a bonus token is
    drawn from p_K. Each emitted token is then distributed exactly as the target's.
    """
    k = len(draft_tokens)
    proposed = torch.tensor(draft_tokens, dtype=torch.long)
    accepted_mask = torch.rand(k, generator=generator) < p[torch.arange(k), proposed]
    rejected = (~accepted_mask).nonzero()
    n = int(rejected[0].item()) if len(rejected) else k
    tokens = draft_tokens[:n]
    if n < k:
        residual = p[n].clone()
        residual[draft_tokens[n]] = 0.0
        total = residual.sum()
        # All of p's mass on the rejected token cannot happen (it would have been accepted); guard anyway.
        tokens.append(int(sample(residual / total if total > 0 else p[n], generator).item()))
    else:
        tokens.append(int(sample(p[k], generator).item()))
    return Verdict(tokens, n)


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> Verdict:
    """Temperature 0: drafts are accepted while they equal the target's argmax (K+1 entries)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return Verdict([*draft_tokens[:n], target_argmax[n]], n)


# -- seeded requests: Gumbel-max sampling coupled across modes ------------------------------------
def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The generator seed for output position ``position`` of a request seeded ``seed``.

    A pure function of the two, so the noise at a position never depends on how many random
    numbers other positions (drafts, rejections) consumed, nor on the process.
    """
    return _mix64(_mix64(seed & _U64) ^ (position & _U64))


def seeded_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise (V,), float32, for one output position of a seeded request."""
    generator = torch.Generator().manual_seed(noise_key(seed, position))
    uniforms = torch.rand(vocab, generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(uniforms))


def gumbel_max(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> list[int]:
    """logits (n, V) and noise (n, V) -> argmax(log p + G) per row, p = ``probabilities``.

    argmax(log p + G) with standard Gumbel G is an exact draw from p (-inf where top-k/top-p
    filtered, so those never win). Plain decoding takes it from the target's p_t; the draft
    proposes it from its own q_t with the same G_t; verification accepts a draft while it
    equals the target's token, and emits the target's token at the first mismatch (or the
    bonus position's). The result is token for token the plain sequence for the seed, hence
    distributed exactly as the target. Its acceptance, P(argmax(log q + G) = argmax(log p + G)),
    is below standard speculative sampling's sum(min(p, q)): the price of mode independence.
    """
    scores = torch.log(probabilities(logits, params)) + noise
    tokens: list[int] = scores.argmax(dim=-1).tolist()
    return tokens
