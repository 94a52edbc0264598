"""A reduced-vocabulary draft (issue #41): its LM head scores a subset of the target's tokens,
its input embedding is the target's own table projected, and verification stays exact.

Built here from the demo pair: the demo draft's layers, a head over 1,024 of the 4,096 tokens,
and an embedding projection fitted to the demo draft's own table by least squares.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams, probabilities, sample, verify

REPO = Path(__file__).resolve().parents[3]
TARGET, DRAFT = REPO / "models" / "demo-target", REPO / "models" / "demo-draft"
SUBSET = 1024
GREEDY = SamplingParams(temperature=0.0)


def reduced_draft(out: Path, subset: int = SUBSET) -> torch.Tensor:
    """Writes a reduced-vocabulary draft directory; returns its vocabulary (target ids)."""
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(DRAFT / "model.safetensors"))
    config = json.loads((DRAFT / "config.json").read_text())
    table = state.pop("model.embed_tokens.weight").float()
    # The special ids 0..4 and every id the demo tokenizer gives its commonest text (low ids:
    # byte-level merges are numbered by frequency), then a spread of the rest.
    ids = torch.cat([torch.arange(subset // 2), torch.arange(subset // 2, 4096, (4096 - subset // 2) // (subset // 2))])
    ids = torch.sort(ids[:subset]).values
    assert ids.numel() == subset and bool((ids[1:] > ids[:-1]).all())
    target_table = load_file(str(TARGET / "model.safetensors"))["model.embed_tokens.weight"].float()
    projection = torch.linalg.lstsq(target_table, table).solution.T  # (draft hidden, target hidden)
    state.update({"lm_head.weight": table[ids].to(torch.bfloat16), "draft_vocab_ids": ids,
                  "embed_proj.weight": projection.contiguous().to(torch.bfloat16)})
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config.update(draft_vocab_size=subset, embedding="target_projection", tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TARGET / name, out / name)
    vocabulary: torch.Tensor = ids
    return vocabulary


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reduced-draft")
    reduced_draft(out)
    return out


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(TARGET, torch.float32)


@pytest.fixture(scope="module")
def draft(draft_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.load_draft(draft_dir, target=TARGET)


def generate(engine: SpeculativeEngine, request: GenerationRequest) -> list[StepEvent]:
    engine.add(request)
    events: list[StepEvent] = []
    while engine.has_work:
        events += [e for e in engine.step() if e.request_id == request.request_id]
    return events


def tokens_of(events: Sequence[StepEvent]) -> list[int]:
    return [t for e in events for t in e.tokens]


PROMPTS = [[1, 40 + i, 300 + 7 * i, 55, 2000 + i] for i in range(6)]


def test_the_draft_loads_with_the_targets_embedding_and_scores_its_subset(draft: LlamaForCausalLM) -> None:
    assert draft.lm_head.weight.shape[0] == SUBSET and draft.model.embed_tokens.weight.shape[0] == 4096
    assert draft.vocab_ids is not None and draft.vocab_ids.numel() == SUBSET
    logits = draft.full_vocab_logits(torch.randn(3, SUBSET))
    outside = torch.ones(4096, dtype=torch.bool)
    outside[draft.vocab_ids] = False
    assert logits.shape == (3, 4096) and torch.isneginf(logits[:, outside]).all()
    assert torch.isfinite(logits[:, draft.vocab_ids]).all()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_output_is_the_targets_with_a_reduced_draft(k: int, target: LlamaForCausalLM,
                                                           draft: LlamaForCausalLM) -> None:
    plain = SpeculativeEngine(target, None, max_slots=2, max_k=8)
    speculative = SpeculativeEngine(target, draft, max_slots=2, max_k=8)
    proposed = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        reference = tokens_of(generate(plain, GenerationRequest(f"p{i}", prompt, 24, GREEDY, k=0)))
        events = generate(speculative, GenerationRequest(f"s{i}", prompt, 24, GREEDY, k=k))
        assert tokens_of(events) == reference, f"prompt {i}"
        proposed += sum(e.proposed for e in events)
        accepted += sum(e.accepted for e in events)
    assert proposed > 0 and 0 < accepted <= proposed  # the draft drafted, and was right sometimes


def test_a_mixed_batch_with_a_reduced_draft_is_the_targets(target: LlamaForCausalLM, draft: LlamaForCausalLM) -> None:
    plain = SpeculativeEngine(target, None, max_slots=6, max_k=8)
    references = {f"r{i}": tokens_of(generate(plain, GenerationRequest(f"r{i}", p, 20, GREEDY, k=0)))
                  for i, p in enumerate(PROMPTS)}
    engine = SpeculativeEngine(target, draft, max_slots=6, max_k=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add(GenerationRequest(f"r{i}", prompt, 20, GREEDY, k=(0, 1, 3, 6, 2, 0)[i]))
    out: dict[str, list[int]] = {rid: [] for rid in references}
    while engine.has_work:
        for event in engine.step():
            out[event.request_id] += event.tokens
    assert out == references


def test_point_masses_outside_the_subset_keep_verification_exact(chi_square: object) -> None:
    """The chi-square test of the acceptance rule with a q that is 0 outside a subset: the first
    token still follows p (including the tokens the draft can never propose)."""
    gen = torch.Generator().manual_seed(41)
    p = torch.softmax(torch.randn(2, 12, generator=gen), -1)
    subset = torch.tensor([0, 2, 3, 7, 9])
    logits = torch.full((1, 12), float("-inf"))
    logits[0, subset] = torch.randn(5, generator=gen)
    q = probabilities(logits[0], SamplingParams(temperature=1.0))[None]
    firsts = []
    for _ in range(40_000):
        drafts = sample(q, gen)
        firsts.append(verify(drafts, q, p, gen).tokens[0])
    assert callable(chi_square)
    assert chi_square(firsts, p[0]) > 1e-3
    assert set(firsts) - set(subset.tolist())  # tokens outside the draft's subset come from the residual


def test_a_draft_with_another_tokenizer_is_refused_naming_the_files(tmp_path: Path) -> None:
    reduced_draft(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages }}"
    (tmp_path / "d" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer_config.json differs from .*demo-target/tokenizer_config.json"):
        LlamaForCausalLM.load_draft(tmp_path / "d", target=TARGET)
    (tmp_path / "d" / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer.json missing in "):
        LlamaForCausalLM.load_draft(tmp_path / "d", target=TARGET)


@pytest.mark.parametrize(("drop", "change", "message"), [
    ("draft_vocab_ids", None, "draft_vocab_ids is missing"),
    ("embed_proj.weight", None, "embed_proj.weight is missing"),
    (None, ("embed_proj.weight", torch.zeros(256, 10)), "does not map the target's"),
    (None, ("draft_vocab_ids", torch.zeros(SUBSET, dtype=torch.long)), "distinct ids"),
])
def test_a_malformed_reduced_draft_is_refused(tmp_path: Path, drop: str | None,
                                              change: tuple[str, torch.Tensor] | None, message: str) -> None:
    reduced_draft(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    if drop is not None:
        state.pop(drop)
    if change is not None:
        state[change[0]] = change[1]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM.load_draft(tmp_path, target=TARGET)


def test_its_embedding_needs_the_target(draft_dir: Path) -> None:
    with pytest.raises(ValueError, match="load it with the target's directory"):
        LlamaForCausalLM.load_draft(draft_dir)
