"""The eagle3 method in the embedded engine (issue #54): an EAGLE-3 head in speculators' format drafts
from the target's own hidden states, and verification keeps the output the target's.

The heads here are random ones for the demo target (eagle3_heads.py): greedy parity, mixed batches and
the prefix cache do not depend on how good the head is, and the sampling test uses a head whose q is
uniform over its vocabulary, so drafts are accepted and rejected both. The trained head for SmolLM2 is
tested on the real model in tests/e2e/test_smollm2_eagle3.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.eagle3_data import target_states
from policies.methods import Method
from tests.unit.engine.eagle3_heads import DEMO_LAYER_IDS, DEMO_TARGET, demo_vocab, write_demo_head
from workers.engines.embedded.aux_states import AuxCapture
from workers.engines.embedded.eagle3.head import Eagle3Head, HeadFormatError
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine, StepEvent
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.lookup.proposer import LookupSettings
from workers.engines.embedded.sampling import SamplingParams, probabilities

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 40 + i, 300 + 7 * i, 55, 2000 + i, 17, 18, 19, 40 + i, 300 + 7 * i] for i in range(5)]


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(DEMO_TARGET, torch.float32)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_head(tmp_path_factory.mktemp("head") / "h")


def load_head(directory: Path, target: LlamaForCausalLM, slots: int = 6) -> Eagle3Head:
    return Eagle3Head.load(directory, target.cfg, target.embed_rows, slots,
                           target.cfg.max_position_embeddings)


def run(engine: SpeculativeEngine, request: GenerationRequest) -> list[StepEvent]:
    return engine.generate(request)


def tokens_of(events: Sequence[StepEvent]) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_the_forward_copies_the_targets_states_at_the_heads_layers(target: LlamaForCausalLM) -> None:
    """What a cached forward records is the residual stream a full causal forward computes there
    (the states the head was trained on: models/eagle3_data.py), and the logits do not change."""
    from workers.engines.embedded.kv_cache import CacheBatch, KVCache

    tokens = PROMPTS[0] * 3
    reference, _ = target_states(target, tokens, DEMO_LAYER_IDS)
    cache = KVCache.allocate(target.cfg, 1, torch.float32, 256)
    batch = CacheBatch.build([0], [0], [len(tokens)], len(tokens), 256)
    plain = target.forward_cached(torch.tensor([tokens]), cache, batch)
    target.aux_capture = capture = AuxCapture(DEMO_LAYER_IDS)
    try:
        logits = target.forward_cached(torch.tensor([tokens]), cache, batch)
    finally:
        target.aux_capture = None
    [(slot, start, states)] = capture.take()
    assert (slot, start) == (0, 0) and states.shape == reference.shape
    assert torch.allclose(states, reference, atol=1e-3, rtol=1e-3)
    assert torch.equal(logits, plain)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_with_the_head_is_plain_output(k: int, target: LlamaForCausalLM, head_dir: Path) -> None:
    plain = SpeculativeEngine(target, None, max_slots=2, max_k=8)
    engine = SpeculativeEngine(target, None, max_slots=2, max_k=8, eagle=load_head(head_dir, target, 2))
    proposed = 0
    for i, prompt in enumerate(PROMPTS):
        reference = tokens_of(run(plain, GenerationRequest(f"p{i}", prompt, 32, GREEDY)))
        events = run(engine, GenerationRequest(f"e{i}", prompt, 32, GREEDY, k=k, method="eagle3"))
        assert tokens_of(events) == reference, f"prompt {i}"
        proposed += sum(e.proposed for e in events)
    assert proposed > 0


def test_a_batch_mixing_the_head_the_draft_and_lookups_is_plain_output(target: LlamaForCausalLM,
                                                                       head_dir: Path) -> None:
    draft = LlamaForCausalLM.load_draft(DEMO_TARGET.parent / "demo-draft", target=DEMO_TARGET)
    plain = SpeculativeEngine(target, None, max_slots=6, max_k=8)
    references = {f"r{i}": tokens_of(run(plain, GenerationRequest(f"r{i}", p, 24, GREEDY)))
                  for i, p in enumerate(PROMPTS)}
    engine = SpeculativeEngine(target, draft, max_slots=6, max_k=8, eagle=load_head(head_dir, target),
                               lookup=LookupSettings())
    methods: tuple[Method, ...] = ("eagle3", "draft", "eagle3", "ngram", "eagle3")
    for i, prompt in enumerate(PROMPTS):
        engine.add(GenerationRequest(f"r{i}", prompt, 24, GREEDY, k=(3, 2, 5, 4, 0)[i], method=methods[i]))
    out: dict[str, list[int]] = {rid: [] for rid in references}
    while engine.has_work:
        for event in engine.step():
            assert event.error is None
            out[event.request_id] += event.tokens
    assert out == references


def test_prefix_cache_hits_keep_the_output_and_the_head_recomputes(target: LlamaForCausalLM, head_dir: Path) -> None:
    """A request whose prompt's chunks are cached: a draft-model one reuses them; an eagle3 one
    prefills (the cache holds no target states for the head) and answers the same."""
    prompt = list(range(5, 200))  # longer than a chunk (64)
    engine = SpeculativeEngine(target, None, max_slots=2, max_k=8, eagle=load_head(head_dir, target, 2),
                               prefix_cache_bytes=64 << 20)
    first = run(engine, GenerationRequest("a", prompt, 16, GREEDY, k=3, method="eagle3"))
    again = run(engine, GenerationRequest("b", prompt, 16, GREEDY, k=3, method="eagle3"))
    plain = run(engine, GenerationRequest("c", prompt, 16, GREEDY))
    assert tokens_of(first) == tokens_of(again) == tokens_of(plain)
    assert again[0].cached_tokens == 0 and (plain[0].cached_tokens or 0) > 0


def test_sampling_with_the_heads_q_is_the_targets_distribution(target: LlamaForCausalLM, tmp_path: Path,
                                                               chi_square: Callable[[Sequence[int], torch.Tensor],
                                                                                    float]) -> None:
    """The second output token, the first the head drafts, follows the target's p given the first.
    The prompt's first token is nearly certain (p 0.89 for id 16), so conditioning on it keeps most
    runs; the head's q is uniform over its vocabulary, so its drafts are accepted and rejected both."""
    out = write_demo_head(tmp_path / "uniform")
    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    save_file(state, str(out / "model.safetensors"))
    prompt = [0, 531, 516, 83, 83, 12, 920, 309, 270, 362, 498, 641, 561, 281]  # class Foo(object): def __init__(self
    first = 16
    engine = SpeculativeEngine(target, None, max_slots=32, max_k=8, eagle=load_head(out, target, 32))
    params = SamplingParams(temperature=1.0)
    seconds: list[int] = []
    proposed = accepted = wave = 0
    while len(seconds) < 1500:
        wave += 1
        for i in range(32):
            # Three tokens: the first from the prefill, the second the first drafted position (a
            # step drafts at most max_tokens - emitted - 1).
            engine.add(GenerationRequest(f"w{wave}-{i}", prompt, 3, params, k=1, method="eagle3"))
        outputs: dict[str, list[int]] = {}
        while engine.has_work:
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.tokens)
                proposed, accepted = proposed + event.proposed, accepted + event.accepted
        seconds += [toks[1] for toks in outputs.values() if len(toks) >= 2 and toks[0] == first]
    from workers.engines.embedded.kv_cache import CacheBatch, KVCache

    cache = KVCache.allocate(target.cfg, 1, torch.float32, 64)
    seq = [*prompt, first]
    logits = target.forward_cached(torch.tensor([seq]), cache, CacheBatch.build([0], [0], [len(seq)], len(seq), 64))
    assert 0 < accepted < proposed
    assert chi_square(seconds, probabilities(logits[0, -1], params)) > 1e-3


def test_a_head_that_does_not_fit_the_target_is_refused_naming_the_field(target: LlamaForCausalLM,
                                                                          head_dir: Path, tmp_path: Path) -> None:
    def variant(name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
        out = tmp_path / name
        out.mkdir()
        raw = json.loads((head_dir / "config.json").read_text())
        edit(raw)
        (out / "config.json").write_text(json.dumps(raw))
        (out / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
        return out

    def layer(key: str, value: object) -> Callable[[dict[str, Any]], None]:
        def edit(raw: dict[str, Any]) -> None:
            raw["transformer_layer_config"][key] = value
        return edit

    cases = {
        "hidden": (layer("hidden_size", 512), "hidden_size"),
        "vocab": (layer("vocab_size", 5000), "vocab_size"),
        "ids": (lambda raw: raw.update(eagle_aux_hidden_state_layer_ids=[1, 4, 8]), "eagle_aux_hidden_state_layer_ids"),
        "type": (layer("model_type", "qwen3"), "model_type"),
        "target": (lambda raw: raw.update(target_hidden_size=576), "target_hidden_size"),
    }
    for name, (edit, field) in cases.items():
        with pytest.raises(HeadFormatError, match=field):
            load_head(variant(name, edit), target)
    no_map = tmp_path / "no-d2t"
    no_map.mkdir()
    (no_map / "config.json").write_text((head_dir / "config.json").read_text())
    state = load_file(str(head_dir / "model.safetensors"))
    state.pop("d2t")
    save_file(state, str(no_map / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="d2t is missing"):
        load_head(no_map, target)


def test_the_maps_are_offsets(target: LlamaForCausalLM, head_dir: Path) -> None:
    """d2t holds offsets (target id = draft id + d2t[draft id]), as vLLM reads it; t2d marks the same ids."""
    state = load_file(str(head_dir / "model.safetensors"))
    ids = demo_vocab()
    assert torch.equal(torch.arange(len(ids)) + state["d2t"].long(), ids)
    assert torch.equal(state["t2d"].nonzero()[:, 0], ids)
    head = load_head(head_dir, target)
    assert head.vocab_ids is not None and torch.equal(head.vocab_ids, ids)
    assert "embed_tokens.weight" not in state and state["fc.weight"].dtype == torch.bfloat16


def test_an_engine_without_a_head_refuses_eagle3_requests(target: LlamaForCausalLM) -> None:
    engine = SpeculativeEngine(target, None, max_slots=1, max_k=8)
    with pytest.raises(ValueError, match="no EAGLE-3 head"):
        engine.add(GenerationRequest("x", PROMPTS[0], 4, GREEDY, k=2, method="eagle3"))


def test_the_heads_forward_is_speculators_own(target: LlamaForCausalLM, head_dir: Path) -> None:
    """The engine's head computes what speculators' Eagle3DraftModel (the trainer's model, and the
    format vLLM loads) computes from the same checkpoint: the first step's drafts at every position,
    and a second step fed its own output, as training-time test feeds it."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(head_dir))  # the config class validates the file
    config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, wants a GPU
    reference = Eagle3DraftModel.from_pretrained(str(head_dir), config=config).float()  # type: ignore[no-untyped-call]
    reference.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.detach())
    reference.eval()
    tokens = PROMPTS[2] * 2
    states, _ = target_states(target, tokens, DEMO_LAYER_IDS)
    n = len(tokens) - 1
    with torch.no_grad():
        drafts = reference(states[None, :-1], torch.tensor([tokens[1:]]), torch.zeros(1, n, dtype=torch.long),
                           position_ids=torch.arange(1, n + 1)[None], ttt_steps=2)
    head = load_head(head_dir, target)
    logits, out = head.forward(0, 0, states[:-1], tokens[1:], fused=True, logits_for_last=False)
    assert torch.equal(logits.argmax(-1), drafts[0][0])
    # The second step after position n - 2: its hidden is the first step's output there, its token the
    # one after (teacher-forced in training, the first draft when serving), written over position n - 1
    # as a chain's entry is.
    second, _ = head.forward(0, n - 1, out[n - 2:n - 1], [tokens[n]], fused=False)
    assert int(second.argmax()) == int(drafts[1][0, n - 2])
