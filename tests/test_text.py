"""Text in and out of the engine: chat template, incremental detokenizing, stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.protocol import ChatMessage
from workers.text import TextCodec, TextStream, render_chat

TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "demo-target" / "tokenizer.json"


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(TOKENIZER, bos_token_id=0)


def stream_all(codec: TextCodec, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    ids = codec.encode(text)[1:]
    stream = TextStream(codec, stop)
    deltas = [stream.push([token]) for token in ids]
    if not stream.stopped:
        deltas.append(stream.flush())
    return deltas, stream


def test_chat_template_matches_tokenizer_config() -> None:
    rendered = render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert rendered == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    config = (TOKENIZER.parent / "tokenizer_config.json").read_text()
    assert "<|assistant|>" in config and "add_generation_prompt" in config


def test_special_tokens_are_single_ids(codec: TextCodec) -> None:
    ids = codec.encode("<|user|>\nx<|end|>")
    assert ids[0] == 0 and ids[1] == 2 and 4 in ids


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1\n", "naïve café – 日本語 ✓", "a\tb\r\nc"])
def test_deltas_reassemble_the_text(codec: TextCodec, text: str) -> None:
    deltas, _ = stream_all(codec, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # split multi-byte characters are held back


@pytest.mark.parametrize(("text", "stop", "expected"), [
    ("def f(x):\n    return x\n\ndef g", ("\n\n",), "def f(x):\n    return x"),
    ("alpha beta gamma", ("gam", "beta"), "alpha "),  # the earliest stop wins
    ("alpha beta", ("zeta",), "alpha beta"),  # no stop: everything, after flush
    ("x = 1 # done", ("# done",), "x = 1 "),
])
def test_stop_strings_cut_exactly(codec: TextCodec, text: str, stop: tuple[str, ...], expected: str) -> None:
    deltas, stream = stream_all(codec, text, stop)
    assert "".join(deltas) == expected
    assert stream.stopped == (expected != text)


def test_nothing_after_a_stop(codec: TextCodec) -> None:
    stream = TextStream(codec, ("STOP",))
    stream.push(codec.encode("abc STOP")[1:])
    assert stream.stopped
    assert stream.push(codec.encode(" more")[1:]) == "" and stream.flush() == ""
