"""The engine tests' fixtures (torch, scipy): tiny Llama target/draft pairs, a cache-free greedy
reference, statistics helpers.

The models are random but deliberately peaky (weights scaled up, the LM head more so) so that
greedy decoding is well defined (no near-ties) and sampled distributions are far from uniform.
The draft is the target plus seeded noise: it agrees with the target often, not always, which
exercises both acceptance and rejection paths of the speculative rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from scipy import stats

from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.measurement.measure import verification_bit_identical
from workers.engines.embedded.projections import bf16_prepacking_available
from workers.engines.embedded.sampling import Verdict, sample

VOCAB = 48
MAX_POSITIONS = 192
TARGET_SEED = 1
DRAFT_NOISE_SEED = 2
BODY_SCALE = 4.0  # non-norm, non-head weights are multiplied by this
HEAD_SCALE = 20.0  # the (untied) LM head by this: logits spread over several nats
DRAFT_NOISE = 0.1  # draft = target + DRAFT_NOISE * std(weight) * N(0, 1), per weight
FAR_DRAFT_NOISE = 0.3  # a draft that disagrees more (distribution tests)

# Prepacked bfloat16 projections exist only on CPUs with AVX512-BF16/AMX.
requires_bf16_prepacking = pytest.mark.skipif(
    not bf16_prepacking_available(),
    reason="this CPU cannot prepack bfloat16 (no AVX512-BF16/AMX)")

GreedyReference = Callable[[Sequence[int], int], list[int]]
ChiSquare = Callable[[Sequence[int], torch.Tensor], float]
VerifyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], Verdict]


def prepare_for_inference(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """What ``from_pretrained`` does after loading: eval, no grad, fused projections."""
    return model.prepare_inference()


def build_target(cfg: ModelConfig, seed: int = TARGET_SEED) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("lm_head"):
                param.mul_(HEAD_SCALE)
            elif not name.endswith("norm.weight"):
                param.mul_(BODY_SCALE)
    return prepare_for_inference(model)


def build_noisy_copy(source: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A model with ``source``'s architecture and weights plus seeded relative Gaussian noise."""
    model = LlamaForCausalLM(source.cfg)
    model.load_state_dict(source.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * noise)
    return prepare_for_inference(model)


def copy_with_config(source: LlamaForCausalLM, cfg: ModelConfig) -> LlamaForCausalLM:
    """``source``'s weights under a different (shape-compatible) config, e.g. other EOS ids."""
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(source.state_dict())
    return prepare_for_inference(model)


def converted(source: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """``source``'s weights in another dtype, prepared for inference as a worker loads them."""
    model = LlamaForCausalLM(source.cfg)
    model.load_state_dict(source.state_dict())
    return model.to(dtype).prepare_inference()


def greedy_by_full_forward(model: LlamaForCausalLM, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence per token (no KV cache involved)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model.forward_train(torch.tensor([tokens]))[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def chi_square_pvalue(draws: Sequence[int], probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness-of-fit p-value of integer draws against ``probs`` (V,).

    Categories whose expected count is below ``min_expected`` are pooled into one bucket
    (pooled with the smallest regular category if the bucket itself stays too small).
    """
    n = len(draws)
    assert n > 0
    p = probs.double().cpu().numpy()
    p = p / p.sum()
    observed = np.bincount(np.asarray(draws, dtype=np.int64), minlength=len(p)).astype(np.float64)
    assert len(observed) == len(p), "a draw lies outside the vocabulary"
    expected = p * n
    order = np.argsort(expected)
    small = [i for i in order if expected[i] < min_expected]
    big = [i for i in order if expected[i] >= min_expected]
    obs_cells = [observed[i] for i in big]
    exp_cells = [expected[i] for i in big]
    if small:
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        if pooled_exp < min_expected and obs_cells:
            obs_cells[0] += pooled_obs
            exp_cells[0] += pooled_exp
        else:
            obs_cells.append(pooled_obs)
            exp_cells.append(pooled_exp)
    assert len(obs_cells) >= 2, "need at least two categories for a chi-square test"
    return float(stats.chisquare(obs_cells, exp_cells).pvalue)


def verify_resampling_from_p(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                             generator: torch.Generator) -> Verdict:
    """A deliberately WRONG acceptance rule: at the first rejection it resamples from p instead of
    normalize(max(0, p - q)). Tokens the draft under-proposes get their mass twice, so the output
    is biased towards min(p, q)'s support. Same random stream layout as the real ``verify``."""
    k = draft_tokens.shape[0]
    idx = torch.arange(k)
    uniforms = torch.rand(k, generator=generator)
    accepted_mask = uniforms * q[idx, draft_tokens] < p[idx, draft_tokens]
    rejected = (~accepted_mask).nonzero()
    n = int(rejected[0].item()) if len(rejected) else k
    tokens = draft_tokens[:n].tolist()
    tokens.append(int(sample(p[n], generator).item()))
    return Verdict(tokens, n)


@pytest.fixture(scope="session")
def _single_thread() -> Iterator[None]:
    """Tiny models: thread fan-out costs far more than it saves, especially on a busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=False, eos_token_id=[])


@pytest.fixture(scope="session")
def target_model(tiny_config: ModelConfig, _single_thread: None) -> LlamaForCausalLM:
    return build_target(tiny_config)


@pytest.fixture(scope="session")
def draft_model(target_model: LlamaForCausalLM) -> LlamaForCausalLM:
    return build_noisy_copy(target_model, DRAFT_NOISE_SEED, DRAFT_NOISE)


@pytest.fixture(scope="session")
def bf16_models(target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM
                ) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The serving defaults: a bfloat16 target with prepacked projections, a float32 draft."""
    return converted(target_model, torch.bfloat16), converted(draft_model, torch.float32)


@pytest.fixture(scope="session")
def bf16_exact(bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """Skips unless bfloat16 verification is bit-identical to one-at-a-time decoding on this CPU:
    the start-up check a worker runs (workers/engines/embedded/measurement/measure.py) before ``exact: true`` may serve
    bfloat16. Prepacked (AVX512-BF16/AMX) and unpacked (``F.linear``, e.g. AVX2) bfloat16 both
    pass it on the CPUs measured so far; a CPU where it fails serves float32 only with
    ``exact: false``, so bit-identity is not promised there."""
    if not verification_bit_identical(bf16_models[0], 7):
        pytest.skip("bfloat16 verification is not bit-identical on this CPU (the worker's start-up check)")


@pytest.fixture(scope="session")
def far_draft_model(target_model: LlamaForCausalLM) -> LlamaForCausalLM:
    return build_noisy_copy(target_model, DRAFT_NOISE_SEED + 1, FAR_DRAFT_NOISE)


@pytest.fixture(scope="session")
def eos_target_factory(target_model: LlamaForCausalLM) -> Callable[[list[int]], LlamaForCausalLM]:
    """Target weights under a config whose ``eos_token_id`` is the given list."""

    def make(eos: list[int]) -> LlamaForCausalLM:
        return copy_with_config(target_model, dataclasses.replace(target_model.cfg, eos_token_id=eos))

    return make


@pytest.fixture(scope="session")
def greedy_reference(target_model: LlamaForCausalLM) -> GreedyReference:
    """(prompt, n) -> the target's first n greedy tokens, memoised per prompt (prefix-closed)."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: Sequence[int], n: int) -> list[int]:
        key = tuple(prompt)
        known = memo.get(key, [])
        if len(known) < n:
            known = known + greedy_by_full_forward(target_model, list(key) + known, n - len(known))
            memo[key] = known
        return known[:n]

    return reference


@pytest.fixture(scope="session")
def chi_square() -> ChiSquare:
    return chi_square_pvalue


@pytest.fixture(scope="session")
def wrong_verify() -> VerifyFn:
    return verify_resampling_from_p


@pytest.fixture(scope="session", autouse=True)
def _kernels_built() -> None:
    """Builds the row-invariant kernels (a C compiler run, cached per machine) before any test:
    a build step, as ``make`` would run it, not a process a unit test starts (tests/unit/conftest.py).
    The 8-wide build too: test_rowgemm compares the served tiles with it."""
    if rowgemm.load() is not None:
        rowgemm.load_variant(("WIDE_TILES=0",))
