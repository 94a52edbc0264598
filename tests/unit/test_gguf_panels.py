"""models/gguf_panels.py through models/convert_gguf.py on synthetic GGUF files: the blocks laid
out beside the float32 conversion serve the same model bit for bit (the Q and K rows un-permuted
as the float32 conversion's are), and a file the block kernels cannot read gets no panels, the
stamp and the engine naming the tensor, while its float32 conversion still serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from models.convert_gguf import STAMP, Source, convert
from tests.unit.test_convert_gguf import Tiny, write_gguf
from workers.engines.embedded.kernels import rowgemm
from workers.engines.embedded.kernels.blocks import PANELS_DIR, PANELS_FILE
from workers.engines.embedded.kv_cache import KVCache
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.quantized import blocks_unavailable, load_blocks

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
