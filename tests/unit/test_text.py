"""Text in and out of the engine: chat template, incremental detokenizing, stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.api.wire import ChatMessage
from workers.text import TextCodec, TextStream

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "demo-target"
BOS = 0


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_model_dir(MODEL_DIR)


def stream_all(codec: TextCodec, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    ids = codec.encode(text)[1:]
    stream = TextStream(codec, stop)
    deltas = [stream.push([token]) for token in ids]
    if not stream.stopped:
        deltas.append(stream.flush())
    return deltas, stream


def test_chat_is_rendered_by_the_model_directorys_template(codec: TextCodec) -> None:
    rendered = codec.render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert rendered == "<|endoftext|><|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_special_tokens_are_single_ids(codec: TextCodec) -> None:
    ids = codec.encode("<|user|>\nx<|end|>")
    assert ids[0] == BOS and ids[1] == 2 and 4 in ids


@pytest.mark.parametrize("model", ["demo-target", "demo-draft"])
def test_one_prompt_encoding_declared_by_the_model_directory(model: str) -> None:
    """D1: text and chat prompts start with exactly one BOS, as the directory declares for
    every tokenizer that reads it (tokenizer.json post-processor, add_bos_token, template)."""
    codec = TextCodec.from_model_dir(MODEL_DIR.parent / model)
    config = json.loads((MODEL_DIR.parent / model / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<|endoftext|>"
    bare = codec.tokenizer.encode("def f():", add_special_tokens=False).ids
    assert codec.encode("def f():") == [BOS, *bare]
    chat = codec.encode_chat([ChatMessage("user", "hi")])
    assert chat[0] == BOS and chat[1] != BOS and chat[1] == 2  # <|user|>
    assert codec.encode("") == [BOS]


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


def test_a_stop_inside_a_multi_token_push_keeps_tokens_up_to_it(codec: TextCodec) -> None:
    """A speculative step pushes several tokens at once; only those up to the one that completed
    the stop string count (vLLM adds tokens one by one and stops there)."""
    ids = codec.encode("alpha beta gamma delta epsilon")[1:]
    needed = next(n for n in range(1, len(ids) + 1) if "gam" in codec.decode(ids[:n]))
    assert needed < len(ids)
    stream = TextStream(codec, ("gam",))
    first = stream.push(ids[:1])
    assert stream.last_kept == 1 and not stream.stopped
    assert first + stream.push(ids[1:]) == "alpha beta "
    assert stream.stopped and stream.last_kept == needed - 1 and stream.ids == ids[:needed]


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_primed_stream_continues_as_if_never_interrupted(codec: TextCodec, cut: int) -> None:
    """A resumed request (mid-stream migration): a fresh TextStream primed with the ids generated
    so far and the characters already sent delivers exactly the rest, and finds a stop string
    that spans the boundary."""
    text = "def f(x):\n    return x + 1\n\nEND of it"
    ids = codec.encode(text)[1:]
    stop = ("\n\nEND",)
    whole, reference = stream_all(codec, text, stop)
    first = TextStream(codec, stop)
    sent = "".join(first.push([t]) for t in ids[:cut])
    resumed = TextStream(codec, stop)
    resumed.prime(ids[:cut], len(sent))
    rest = []
    for token in ids[cut:]:
        rest.append(resumed.push([token]))
        if resumed.stopped:
            break
    if not resumed.stopped:
        rest.append(resumed.flush())
    assert sent + "".join(rest) == "".join(whole) == "def f(x):\n    return x + 1"
    assert resumed.stopped and resumed.ids == reference.ids
