"""The draft distillation (models/distill*.py, models/draft_format.py, models/expand_draft.py) on tiny random
models: the loss, resumed training against uninterrupted training, the head's subset, the draft format's round
trips and its checks, and the install-time expansion for vLLM."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models.distill import balanced
from models.distill_data import Teacher, choose_subset, cut_rows, epoch_order
from models.distill_prompts import CLASSES, PROMPTS_PATH, build_prompts, load_prompts
from models.distill_train import Data, Settings, Trainer, distill_loss
from models.draft_format import (
    DraftFormatError,
    DraftLlama,
    DraftShape,
    draft_config,
    expand_to_full_vocab,
    expected_shapes,
    load_draft,
    model_config,
    read_target_embedding,
    save_draft,
    sha256_of,
    special_ids,
)
from models.expand_draft import STAMP, expand
from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.llama import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "demo-target"  # its tokenizer (4096 ids) serves the tiny target
TINY = DraftShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, draft_vocab_size=256)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the demo tokenizer, float32 weights, tied embeddings."""
    directory = tmp_path_factory.mktemp("target")
    cfg = ModelConfig(vocab_size=4096, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=[0, 4])
    model = LlamaForCausalLM(cfg)
    model.init_weights(0)
    with torch.no_grad():  # a peakier teacher than 0.02-std weights give
        model.model.embed_tokens.weight.mul_(20)
    model.save_pretrained(directory, dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEMO / name, directory / name)
    return directory


def tiny_draft(target: Path, seed: int = 1) -> DraftLlama:
    raw = json.loads((target / "config.json").read_text())
    subset = choose_subset(np.arange(4096)[::-1].copy(), TINY.draft_vocab_size, special_ids(target))
    draft = DraftLlama(model_config(draft_config(raw, TINY, "x")), TINY.draft_vocab_size, read_target_embedding(target))
    draft.draft_vocab_ids.copy_(torch.from_numpy(subset))
    draft.init_weights(seed)
    return draft


@pytest.fixture()
def draft_dir(target: Path, tmp_path: Path) -> Iterator[Path]:
    draft = tiny_draft(target)
    with torch.no_grad():  # non-trivial norms, so the round trip checks them too
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    save_draft(draft, tmp_path / "draft", target, sha256_of(target / "model.safetensors"), dtype=torch.float32)
    yield tmp_path / "draft"


# -- the loss ----------------------------------------------------------------------------------------------------
def test_loss_is_forward_kl_over_the_cached_entries() -> None:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 5, 16, generator=gen) * 3
    student = torch.randn(2, 5, 16, generator=gen)
    log_p = F.log_softmax(teacher, -1)
    # Every entry cached: exactly KL(p || q).
    full = distill_loss(student, torch.arange(16).expand(2, 5, 16), log_p)
    expected = F.kl_div(F.log_softmax(student, -1), log_p, log_target=True, reduction="none").sum(-1).mean()
    assert torch.allclose(full, expected, atol=1e-6)
    assert float(distill_loss(teacher, torch.arange(16).expand(2, 5, 16), log_p)) == pytest.approx(0, abs=1e-6)
    # Top 4 only: the uncached mass weighs nothing, and the loss is the cached terms'.
    top = log_p.topk(4, dim=-1)
    partial = distill_loss(student, top.indices, top.values)
    terms = top.values.exp() * (top.values - F.log_softmax(student, -1).gather(-1, top.indices))
    assert torch.allclose(partial, terms.sum(-1).mean(), atol=1e-6)


def test_loss_trains_a_tiny_student_towards_the_teacher(target: Path) -> None:
    teacher = Teacher(target, "float32")
    draft = tiny_draft(target)
    subset = draft.draft_vocab_ids.clone()
    rows = torch.randint(5, 4096, (4, 33), generator=torch.Generator().manual_seed(1))
    rows[:, ::3] = subset[torch.arange(11) + 20]  # subset ids the student can learn to predict
    top_idx, top_logp, argmax = teacher.soft_targets(rows, subset, 16)
    assert top_idx.dtype == torch.int16 and top_logp.dtype == torch.float16 and argmax.shape == (4, 32)
    full = torch.log_softmax(teacher.logits(rows[:, :-1]), -1)
    assert torch.allclose(top_logp.float(), full[..., subset].gather(-1, top_idx.long()), rtol=1e-3, atol=1e-3)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = distill_loss(draft(rows[:, :-1]), top_idx.long(), top_logp.float())
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


# -- the data ----------------------------------------------------------------------------------------------------
def test_subset_always_holds_the_special_ids(target: Path) -> None:
    specials = special_ids(target)
    assert specials == [0, 1, 2, 3, 4]  # the demo tokenizer's added tokens; eos [0, 4]
    counts = np.zeros(4096, dtype=np.int64)
    counts[100:400] = np.arange(300, 0, -1)  # the specials themselves never occur
    subset = choose_subset(counts, 64, specials)
    assert len(subset) == 64 and list(subset) == sorted(set(subset.tolist()))
    assert set(specials) <= set(subset.tolist())
    assert set(subset.tolist()) - set(specials) == set(range(100, 159))  # then the most frequent
    with pytest.raises(ValueError, match="special ids"):
        choose_subset(counts, 3, specials)


def test_rows_and_epoch_order() -> None:
    rows = cut_rows(np.arange(21), 5)
    assert rows.shape == (4, 6) and rows[1, 0] == 5 and rows[-1, -1] == 20  # every id a target once
    order = epoch_order(3, 5, 4, seed=0, epoch=0)
    assert sorted(order.tolist()) == sorted([0, 1, 2] * 4 + [3, 4, 5, 6, 7])
    assert (order == epoch_order(3, 5, 4, seed=0, epoch=0)).all()
    assert not (order == epoch_order(3, 5, 4, seed=0, epoch=1)).all()


def test_generation_on_the_cache_equals_full_forwards(target: Path) -> None:
    teacher = Teacher(target, "float32")
    prompts = [teacher.chat_ids("def add(a, b):"), teacher.chat_ids("Write a haiku about the sea, please.")]
    replies = teacher.generate(prompts, 12, 0.0, seed=0)
    for prompt, reply in zip(prompts, replies, strict=True):
        ids = list(prompt)
        for token in reply:
            assert int(teacher.logits(torch.tensor([ids]))[0, -1].argmax()) == token
            ids.append(token)
        assert len(reply) == 12 or reply[-1] in teacher.stops
    sampled = teacher.generate(prompts, 12, 0.8, seed=3)
    assert sampled == teacher.generate(prompts, 12, 0.8, seed=3)


def test_prompt_set() -> None:
    prompts = load_prompts()
    assert PROMPTS_PATH.name == "distill_prompts.jsonl" and len(prompts) == 400
    assert len({p.id for p in prompts}) == 400
    for cls in CLASSES:
        mine = [p for p in prompts if p.cls == cls]
        assert len(mine) == 100 and sum(p.split == "heldout" for p in mine) == 20
    assert build_prompts(12, seed=3) == build_prompts(12, seed=3)
    picked = balanced([p for p in prompts if p.split == "train"], 8)
    assert [p.cls for p in picked] == [*CLASSES, *CLASSES]


# -- resumed training --------------------------------------------------------------------------------------------
def _trainer(target: Path, work: Path, autocast: bool = False) -> Trainer:
    rows = np.random.default_rng(0).integers(0, 4096, (12, 17)).astype(np.int32)
    draft = tiny_draft(target)
    data = Data(rows, draft.draft_vocab_ids.numpy().copy(), gen_rows=4, corpus_rows=8)
    settings = Settings(seq_len=16, batch=4, draft_vocab=TINY.draft_vocab_size, top_k=8, epochs=2, warmup=2,
                        gen_repeat=2, autocast=autocast, log_every=1)
    return Trainer(settings, data, Teacher(target, "float32"), draft, work)


def test_resumed_training_equals_uninterrupted(target: Path, tmp_path: Path) -> None:
    forever = time.monotonic() + 3600
    straight = _trainer(target, tmp_path / "a")
    straight.run(5, forever)
    first = _trainer(target, tmp_path / "b")
    first.run(2, forever)
    resumed = _trainer(target, tmp_path / "b")
    assert resumed.load() and resumed.step == 2 and int(resumed.done.sum()) == int(first.done.sum())
    resumed.run(5, forever)
    assert resumed.step == straight.step == 5
    for name, value in straight.student.state_dict().items():
        assert torch.equal(value, resumed.student.state_dict()[name]), name
    a, b = straight.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)
    assert torch.equal(straight.done, resumed.done)


def test_a_bfloat16_autocast_step_warns_nothing(target: Path, tmp_path: Path) -> None:
    trainer = _trainer(target, tmp_path, autocast=True)  # warnings are errors in this suite
    trainer.run(2, time.monotonic() + 3600, log=tmp_path / "log.jsonl")
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(np.isfinite(r["loss"]) for r in logged)


def test_resume_refuses_other_settings(target: Path, tmp_path: Path) -> None:
    _trainer(target, tmp_path).run(1, time.monotonic() + 3600)
    other = _trainer(target, tmp_path)
    other.settings = Settings(seq_len=16, batch=4, lr=1.0)
    with pytest.raises(ValueError, match="use the same settings"):
        other.load()


# -- the format --------------------------------------------------------------------------------------------------
def test_load_round_trip(target: Path, draft_dir: Path) -> None:
    original = load_file(str(draft_dir / "model.safetensors"))
    assert "model.embed_tokens.weight" not in original and original["draft_vocab_ids"].dtype == torch.int64
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["embedding"] == "target_projection" and config["draft_vocab_size"] == 256
    assert config["vocab_size"] == 4096 and config["tie_word_embeddings"] is False
    assert config["target_sha256"] == sha256_of(target / "model.safetensors")
    model, ids = load_draft(draft_dir, target)
    assert list(ids) == sorted(ids.tolist()) and {0, 1, 2, 3, 4} <= set(ids.tolist())
    for name, value in original.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_expanded_draft_matches_on_the_subset_and_is_zero_elsewhere(target: Path, draft_dir: Path,
                                                                    tmp_path: Path) -> None:
    draft, ids = load_draft(draft_dir, target)
    out = expand_to_full_vocab(draft_dir, target, tmp_path / "full", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert not {"draft_vocab_size", "embedding", "target_sha256"} & set(config)
    assert config["tie_word_embeddings"] is False and (out / "tokenizer.json").is_file()
    full = LlamaForCausalLM.from_pretrained(out, packed=False)
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, logits = draft(tokens), full.forward_train(tokens)
    assert torch.allclose(logits[..., ids], expected, atol=1e-5)
    others = torch.ones(4096, dtype=torch.bool)
    others[ids] = False
    assert bool((logits[..., others] == 0).all())
    bf16 = expand_to_full_vocab(draft_dir, target, tmp_path / "bf16")
    assert load_file(str(bf16 / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16


def test_the_engine_loads_the_draft_as_load_draft_does(target: Path, draft_dir: Path) -> None:
    """The embedded engine's own reader of the format (workers/engines/embedded/reduced_vocab.py)."""
    draft, ids = load_draft(draft_dir, target)
    served = LlamaForCausalLM.from_pretrained(draft_dir, packed=False, target=target)
    assert served.vocab_ids is not None and torch.equal(served.vocab_ids, ids)
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, logits = draft(tokens), served.forward_train(tokens)
    assert torch.allclose(logits, expected, atol=1e-5)


def test_default_draft_fits_in_15_mb() -> None:
    cfg = model_config(draft_config({"vocab_size": 49152, "rope_theta": 100000.0}, DraftShape(), "x"))
    size = sum(int(np.prod(s)) * (8 if name == "draft_vocab_ids" else 2)
               for name, s in expected_shapes(cfg, 8192, 576).items())
    assert size <= 15_000_000


def test_a_wrong_shape_names_the_file_and_tensor(target: Path, draft_dir: Path) -> None:
    path = draft_dir / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["lm_head.weight"][:-1].contiguous()
    save_file(state, str(path))
    with pytest.raises(DraftFormatError, match=r"model\.safetensors: lm_head\.weight has shape \(255, 32\)"):
        load_draft(draft_dir, target)


def test_a_stored_embedding_table_is_refused(target: Path, draft_dir: Path) -> None:
    path = draft_dir / "model.safetensors"
    state = load_file(str(path))
    state["model.embed_tokens.weight"] = torch.zeros(4096, 32)
    save_file(state, str(path))
    with pytest.raises(DraftFormatError, match=r"model\.safetensors: has model\.embed_tokens\.weight"):
        load_draft(draft_dir, target)


def test_a_different_tokenizer_names_the_file(target: Path, draft_dir: Path) -> None:
    tokenizer = json.loads((draft_dir / "tokenizer.json").read_text())
    tokenizer["added_tokens"][1]["content"] = "<|sys|>"
    (draft_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftFormatError, match=r"draft/tokenizer\.json: differs from the target's"):
        load_draft(draft_dir, target)


def test_config_and_target_checks_name_the_file(target: Path, draft_dir: Path) -> None:
    config = json.loads((draft_dir / "config.json").read_text())
    (draft_dir / "config.json").write_text(json.dumps(config | {"target_sha256": "0" * 64}))
    with pytest.raises(DraftFormatError, match=r"model\.safetensors: sha256 differs from target_sha256"):
        load_draft(draft_dir, target)
    load_draft(draft_dir, target, check_target=False)
    (draft_dir / "config.json").write_text(json.dumps(config | {"embedding": "table"}))
    with pytest.raises(DraftFormatError, match=r"config\.json: not a draft config"):
        load_draft(draft_dir, target)


# -- the install-time expansion (make install-vllm) --------------------------------------------------------------
def test_expansion_is_stamped_and_a_second_run_does_nothing(target: Path, draft_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "full"
    assert expand(draft_dir, target, out)
    stamp = json.loads((out / STAMP).read_text())
    assert stamp["target_sha256"] == sha256_of(target / "model.safetensors") and stamp["dtype"] == "float32"
    assert load_file(str(out / "model.safetensors"))["lm_head.weight"].shape == (4096, 32)
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert not expand(draft_dir, target, out)
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    # Another dtype, or a changed draft, expands again; no staging directory is left behind.
    assert expand(draft_dir, target, out, "bfloat16")
    assert load_file(str(out / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    state = load_file(str(draft_dir / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    save_file(state, str(draft_dir / "model.safetensors"))
    assert expand(draft_dir, target, out, "bfloat16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "full"]


def test_expansion_against_another_target_writes_nothing(target: Path, draft_dir: Path, tmp_path: Path) -> None:
    config = json.loads((draft_dir / "config.json").read_text())
    (draft_dir / "config.json").write_text(json.dumps(config | {"target_sha256": "0" * 64}))
    with pytest.raises(DraftFormatError, match=r"model\.safetensors: sha256 differs from target_sha256"):
        expand(draft_dir, target, tmp_path / "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
